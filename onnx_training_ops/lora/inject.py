"""add_lora: LoRA adapters beside a model's linear layers, over a frozen (maybe quantized) base.

Each adapted module gets ``y[..., start:stop] += scaling * (dropout(x) @ A) @ B`` beside its
linear node (``MatMul``, ``Gemm``, ``MatMulNBits``), with float32 ``A`` ``[in, r]`` and ``B``
``[r, out]`` initializers: peft's ``lora_A``/``lora_B`` transposed, initialized as peft does
(A Kaiming-uniform, bound ``1/sqrt(in)``; B zeros). The base node is left as it is, so a
4-bit ``MatMulNBits`` keeps its kernel and its numerics.

The same rewrite in its *serving* form (:func:`insert_adapters` with ``serve=True``) is
what onnxruntime's multi-LoRA runs: A and B are graph inputs with a dynamic rank
``lora_r``, defaulting to empty tensors (rank 0: the base model), the scaling folded into B,
no dropout; an ``.onnx_adapter`` file feeds them (:mod:`.formats`).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrainingOpError
from ..passes._graph import all_names, unique_name, value_types
from ..storage import as_model
from ..storage.large_model import LargeModel
from ..storage.model_files import GENAI_CONFIG, ModelLike, model_file
from .spec import Adapter, LoraSpec, lora_spec, set_lora_spec
from .targets import Linear, Slice, choose, linear_nodes

DEFAULT_TARGETS = ("q_proj", "v_proj")  # peft's default for Llama, Mistral, Qwen2, Gemma
LORA_RANK = "lora_r"  # the serving model's dynamic rank dimension (Olive's name)


def add_lora(model: ModelLike, rank: int = 8, alpha: float | None = None,
             targets: Sequence[str] | str = DEFAULT_TARGETS, dropout: float = 0.0,
             seed: int = 0) -> onnx.ModelProto | LargeModel:
    """``model`` with LoRA adapters beside the linear layers ``targets`` picks (peft's LoRA).

    Args:
        model: an inference model: a ModelProto, LargeModel, a file, or a folder written by
            onnxruntime-genai's model builder (``genai_config.json``, ``model.onnx`` and its
            external data), e.g. 4-bit ``MatMulNBits`` weights.
        rank: peft's ``r``.
        alpha: peft's ``lora_alpha`` (default ``rank``: scaling 1); the adapters' product is
            scaled by ``alpha / rank``.
        targets: peft's ``target_modules``: module names (``["q_proj", "v_proj"]``, matched as
            peft does, by the end of the module path; onnxruntime-genai's fused ``qkv_proj``
            gets one adapter per q/k/v slice), a regular expression over whole module paths,
            or ``"all-linear"`` (every linear layer but ``lm_head``).
        dropout: peft's ``lora_dropout`` on the adapters' input; it drops only in a model
            built with ``mode="train"``.
        seed: the seed of A's initialization.

    Returns:
        The model (same kind as :func:`~onnx_training_ops.build_training_model` returns) whose
        metadata records the adapters: ``build_training_model`` on it trains only them by
        default, and :meth:`~onnx_training_ops.TrainingSession.save_adapter` writes them out.

    Raises:
        TrainingOpError: a bad setting, a model that already has adapters, or a target that
            matches no linear layer (the error names the modules there are).
    """
    if not _is_positive_int(rank):
        raise TrainingOpError(f"rank must be a positive integer, found {rank!r}")
    alpha = float(rank if alpha is None else alpha)
    if not np.isfinite(alpha) or alpha == 0:
        raise TrainingOpError(f"alpha must be a finite nonzero number, found {alpha!r}")
    if not 0 <= dropout < 1:
        raise TrainingOpError(f"dropout must be in [0, 1), found {dropout!r}")
    source = os.path.abspath(os.fspath(model)) if isinstance(model, (str, os.PathLike)) else None
    genai = read_genai_config(source)
    opened = as_model(model)
    proto = opened.model_proto
    if lora_spec(proto) is not None:
        raise TrainingOpError("the model already has LoRA adapters (add_lora was applied to it)")
    decoder = (genai or {}).get("model", {}).get("decoder")
    chosen = choose(linear_nodes(proto, decoder), targets)
    rng = np.random.default_rng(seed)
    types = value_types(proto)
    x_type = types.get(chosen[0][0].node.input[0])
    dtype = helper.tensor_dtype_to_np_dtype(x_type.elem_type if x_type is not None and x_type.elem_type
                                            else TensorProto.FLOAT)
    adapters = insert_adapters(proto, chosen, alpha / rank, dropout, types=types)
    for adapter in adapters:  # peft: A Kaiming-uniform (a=sqrt(5)): bound 1/sqrt(fan_in); B zeros
        bound = 1.0 / np.sqrt(adapter.in_features)
        a = rng.uniform(-bound, bound, (rank, adapter.in_features)).astype(np.float32).T
        _add_initializer(opened, adapter.a, np.ascontiguousarray(a))
        _add_initializer(opened, adapter.b, np.zeros((rank, adapter.out_features), np.float32))
    spec = LoraSpec(rank=rank, alpha=alpha, dropout=float(dropout),
                    targets=targets if isinstance(targets, str) else tuple(targets), adapters=tuple(adapters),
                    source=source, model_type=(genai or {}).get("model", {}).get("type"),
                    activation_dtype=np.dtype(dtype).name)
    set_lora_spec(proto, spec)
    return opened.remeasured().public()


def read_genai_config(path: str | None) -> dict | None:
    """The ``genai_config.json`` of onnxruntime-genai's builder folder ``path``, or of the
    folder whose decoder model is file ``path``; None when there is none."""
    if path is None:
        return None
    folder = path if os.path.isdir(path) else os.path.dirname(path)
    config = os.path.join(folder, GENAI_CONFIG)
    if not os.path.isfile(config) or os.path.abspath(model_file(folder)) != os.path.abspath(model_file(path)):
        return None
    with open(config, encoding="utf-8") as f:
        return json.load(f)


def _add_initializer(model: LargeModel, name: str, value: np.ndarray) -> None:
    tensor = model.model_proto.graph.initializer.add()
    tensor.name = name
    tensor.data_type = TensorProto.FLOAT
    tensor.dims.extend(value.shape)
    model.set_value(tensor, value)


def insert_adapters(model: onnx.ModelProto, chosen: Sequence[tuple[Linear, Sequence[Slice]]],
                    scaling: float, dropout: float, serve: bool = False,
                    names: Sequence[Adapter] | None = None, types: dict | None = None) -> list[Adapter]:
    """Put the adapter subgraphs beside the chosen linear nodes of ``model`` (in place).

    The training form reads A and B as initializers (the caller adds them, float32), scales
    the rank-wide product and applies ``dropout``. The serving form (``serve=True``) makes
    A and B graph inputs of rank ``lora_r`` in the activations' dtype with empty defaults,
    and no scaling (the adapter file holds B already scaled). ``names``: the adapters to
    recreate (their tensor names), in ``chosen``'s order; default: fresh names. ``types``:
    :func:`~onnx_training_ops.passes._graph.value_types` of ``model``, if at hand.
    """
    graph = model.graph
    taken = all_names(graph)
    types = value_types(model) if types is None else types
    named = iter(names) if names is not None else None
    new_nodes: dict[int, _Nodes] = {}
    index = {id(n): i for i, n in enumerate(graph.node)}
    adapters = []
    scale_name = None
    for linear, slices in chosen:
        node = linear.node
        x = node.input[0]
        x_type = types.get(x)
        dtype = x_type.elem_type if x_type is not None and x_type.elem_type else TensorProto.FLOAT
        work_type = dtype if serve else TensorProto.FLOAT  # training: float32 adapters
        nodes = _Nodes(taken)
        op = nodes.op
        stem = linear.path
        x_in = x if work_type == dtype else op("Cast", [x], f"{stem}/lora/input_f32", to=work_type)
        deltas: dict[Slice, str] = {}
        for s in slices:
            adapter = next(named) if named is not None else Adapter(
                module=s.module, output=linear.output, a=unique_name(taken, f"{s.module}.lora_A.weight"),
                b=unique_name(taken, f"{s.module}.lora_B.weight"), start=s.start, stop=s.stop,
                in_features=linear.in_features, node_out_features=linear.out_features)
            adapters.append(adapter)
            if serve:
                _serving_input(graph, adapter.a, dtype, [linear.in_features, LORA_RANK])
                _serving_input(graph, adapter.b, dtype, [LORA_RANK, s.stop - s.start])
            h = x_in
            if dropout and not serve:
                ratio = unique_name(taken, f"{s.module}/lora/dropout_ratio")
                graph.initializer.append(numpy_helper.from_array(np.array(dropout, np.float32), ratio))
                h = op("Dropout", [h, ratio], f"{s.module}/lora/dropout")
            h = op("MatMul", [h, adapter.a], f"{s.module}/lora_A")
            if not serve:
                if scale_name is None:
                    scale_name = unique_name(taken, "lora.scaling")
                    graph.initializer.append(numpy_helper.from_array(np.array(scaling, np.float32), scale_name))
                h = op("Mul", [h, scale_name], f"{s.module}/lora/scaled")
            deltas[s] = op("MatMul", [h, adapter.b], f"{s.module}/lora_B")
        y = node.output[0]
        base = unique_name(taken, f"{y}/base")
        node.output[0] = base
        covered = [s.stop - s.start for s in linear.slices] if len(slices) == len(linear.slices) else None
        if covered is not None:  # every slice adapted: one delta the width of y
            parts = [deltas[s] for s in linear.slices]
            delta = parts[0] if len(parts) == 1 else op("Concat", parts, f"{stem}/lora/delta", axis=-1)
            if work_type != dtype:
                delta = op("Cast", [delta], f"{stem}/lora/delta_cast", to=dtype)
            nodes.op("Add", [base, delta], f"{stem}/lora/Add", out=y)
        else:  # some slices only: split y, add to those, put it back together
            split = unique_name(taken, f"{stem}/lora/splits")
            graph.initializer.append(numpy_helper.from_array(
                np.array([s.stop - s.start for s in linear.slices], np.int64), split))
            pieces = [unique_name(taken, f"{s.module}/lora/base") for s in linear.slices]
            nodes.append(helper.make_node("Split", [base, split], pieces, name=unique_name(taken, f"{stem}/lora/Split"),
                                          axis=-1))
            summed = []
            for s, piece in zip(linear.slices, pieces):
                if s in deltas:
                    d = deltas[s] if work_type == dtype else op("Cast", [deltas[s]], f"{s.module}/lora/delta_cast",
                                                                 to=dtype)
                    piece = op("Add", [piece, d], f"{s.module}/lora/sum")
                summed.append(piece)
            nodes.op("Concat", summed, f"{stem}/lora/Concat", out=y, axis=-1)
        new_nodes[index[id(node)]] = nodes
    ordered = []
    for i, node in enumerate(graph.node):
        ordered.append(node)
        ordered.extend(new_nodes.get(i, ()))
    del graph.node[:]
    graph.node.extend(ordered)
    return adapters


class _Nodes(list):
    """New nodes, each named after its output (unique names in ``taken``)."""

    def __init__(self, taken: set[str]) -> None:
        super().__init__()
        self.taken = taken

    def op(self, op_type: str, inputs, base: str, out: str | None = None, **attrs) -> str:
        out = out or unique_name(self.taken, base)
        self.append(helper.make_node(op_type, list(inputs), [out], name=unique_name(self.taken, base + "_node"),
                                     **attrs))
        return out


def _serving_input(graph: onnx.GraphProto, name: str, dtype: int, shape: list) -> None:
    """``name`` as a graph input of ``shape`` whose default (an initializer of the same name)
    is empty: rank 0, the base model's output when no adapter feeds it."""
    graph.input.append(helper.make_tensor_value_info(name, dtype, shape))
    empty = np.zeros([0 if d == LORA_RANK else d for d in shape], helper.tensor_dtype_to_np_dtype(dtype))
    graph.initializer.append(numpy_helper.from_array(empty, name))


def _is_positive_int(value: object) -> bool:
    """An int >= 1, not a bool (a setting as given: the annotation is not enforced)."""
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1
