"""``prepare``: a valid training-domain graph -> one that onnxruntime runs, by the pass pipeline
of the chosen kernels."""

from __future__ import annotations

import onnx
from onnx import ModelProto

from ..passes import FLAT_PORTABLE_PASSES, GPU_PASSES, NATIVE_PASSES, PASSES, PORTABLE_PASSES
from ..storage.external_data import transposed
from ..storage.large_model import LargeModel
from ..storage.model_files import ModelLike, as_model
from ..storage.tensors import add_array, all_tensors, location
from ..walk import remove_nodes
from . import plugin
from .options import select_kernels


def prepare(model: ModelLike, kernels: str | None = None, portable: bool = False,
            flat: bool = False) -> ModelProto | LargeModel:
    """Return a copy of ``model`` that a plain onnxruntime session (with :func:`session_options`) runs.

    Validates every node of ai.onnx.preview.training (raising TrainingOpError), expands
    Gradient nodes, fills default attributes, then targets the optimizer kernels: the
    native ones (nodes become ``ai.onnx.contrib::TrainingAdam`` etc.) or the PyOp ones
    (multi-tensor nodes split, exact attribute values stored); last, fits IR version and
    opsets to onnxruntime. Idempotent; nodes of other domains are left as they are.
    Registers the kernels with onnxruntime-extensions (so that options registering its
    library see them).

    Args:
        model: a ModelProto, LargeModel, path or bytes, using the training domain anywhere
            (main graph, subgraphs, ``training_info``).
        kernels: ``"native"``, ``"pyop"`` or ``None``/``"auto"`` (the
            ``ONNX_TRAINING_OPS_KERNELS`` environment variable, else native where it works).
        portable: lower the optimizer nodes to standard ONNX ops instead
            (:data:`PORTABLE_PASSES`): the result runs in any onnxruntime, or
            ``onnx.reference``, with nothing registered.
        flat: with ``portable``, run each multi-tensor optimizer node over its tensors laid
            end to end (:data:`FLAT_PORTABLE_PASSES`): a few elementwise kernels for all
            parameters, what a GPU wants (bit for bit the per-tensor result).

    Returns:
        The prepared copy; ``model`` is left as it was. A
        :class:`~onnx_training_ops.storage.LargeModel`, or a file past
        :func:`~onnx_training_ops.storage.large_model_bytes`, comes back as a LargeModel: the
        passes rewrite its message, its big tensors stay arrays (memory-mapped from the file).

    Raises:
        TrainingOpError: an invalid node of the domain (naming it, what was expected and
            found), an op without a derivative rule under a Gradient, or ``kernels="native"``
            where the native kernels do not work.
    """
    return prepare_model(as_model(model, copy=False), kernels, portable, flat).public()


def prepare_model(model: LargeModel, kernels: str | None = None, portable: bool = False,
                  flat: bool = False, gpu: bool = False) -> LargeModel:
    """:func:`prepare` on the package's one model type: ``model`` (left as it was) prepared,
    its detached tensors still arrays. ``gpu`` (with ``portable``): the flat form for a CUDA
    device, its convolution gradients as Conv/ConvTranspose (:data:`GPU_PASSES`)."""
    if portable:
        passes = GPU_PASSES if gpu else FLAT_PORTABLE_PASSES if flat else PORTABLE_PASSES
    else:
        passes = NATIVE_PASSES if select_kernels(kernels) == "native" else PASSES
    opened = model.copy()
    fold_constant_transposes(opened)
    result = opened.model_proto
    for _, run_pass in passes:
        result = run_pass(result)
    if not portable:
        plugin.register()
    return opened.with_proto(result)


def fold_constant_transposes(model: LargeModel) -> None:
    """``Transpose`` of a detached initializer read by nothing else becomes a detached
    initializer of the transposed values (in place). torch exports ``nn.Linear`` as
    ``MatMul(x, Transpose(W))``: onnxruntime's constant folding would keep a transposed copy
    of every frozen weight next to the original (a LoRA base model twice); this copy is read
    from the file without mapping it, and the original leaves the model."""
    graph = model.model_proto.graph
    inits = {t.name: t for t in graph.initializer if location(t) is not None}
    reads: dict[str, int] = {}
    for node in graph.node:
        for name in node.input:
            reads[name] = reads.get(name, 0) + 1
    outputs = {o.name for o in graph.output}
    folded = []
    for node in graph.node:
        if node.op_type != "Transpose" or node.domain not in ("", "ai.onnx") or len(node.input) != 1:
            continue
        source = inits.get(node.input[0])
        if source is None or reads.get(source.name) != 1 or source.name in outputs:
            continue
        perm = next((list(a.ints) for a in node.attribute if a.name == "perm"), None)
        array = model.array(source)
        perm = perm or list(reversed(range(array.ndim)))
        tensor = onnx.TensorProto(name=node.output[0], data_type=source.data_type,
                                  dims=[array.shape[p] for p in perm])
        add_array(model, tensor, transposed(array, perm))
        graph.initializer.append(tensor)
        folded.append((node, source))
    for _, source in folded:
        graph.initializer.remove(source)
    remove_nodes(graph, [node for node, _ in folded])
    if folded:  # the originals' arrays go with them
        used = {location(t) for t in all_tensors(model.model_proto)}
        model.large_initializers = {k: v for k, v in model.large_initializers.items() if k in used}
