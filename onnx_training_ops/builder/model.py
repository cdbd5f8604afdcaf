"""Inference model + loss + optimizer -> one ONNX training model (``ModelProto.training_info``).

The result follows the IR spec ("Training Related Information"): the main graph is the
inference graph, unchanged; one TrainingInfoProto holds

* ``initialization``: the optimizer state (V, H) at its initial value and T = 0,
  bound by ``initialization_binding``;
* ``algorithm``: the loss over the main graph's output, one ``Gradient`` node for all
  trainables, **one** multi-tensor optimizer node and T <- T + 1, bound by
  ``update_binding`` (every parameter, V, H and T).

The spec runs the algorithm on the main graph and the algorithm graph concatenated, so the
forward pass is the main graph itself: the algorithm's nodes read the main graph's inputs
and outputs by name and the algorithm adds only the loss inputs (``labels`` or ``target``)
and the learning rate (``learning_rate``, a float scalar input whose initializer holds the
optimizer's ``lr`` as default, so schedules just feed it).

Optimizer state lives in the algorithm graph's initializers (``<param>.V``, ``<param>.H``,
``optimizer.T``); the spec lets update bindings name them, and the main graph stays as it was.

:func:`build_training_model` runs named steps in order, each in a module of its own:
``_forward`` (the forward pass the loss reads: the main graph in ``mode="eval"``, a
training-mode copy in ``mode="train"``, :mod:`.train_mode`), :func:`.loss_graph.add_loss`,
:func:`.trainables.choose_trainables` and :func:`.trainables.check_differentiable` (every
op without a derivative rule listed at once), :func:`.update.add_learning_rates`,
:func:`.update.add_update` (T + 1, one Gradient, one optimizer node per group, their
bindings), :func:`.initialization.initialization_graph`, ``_finish`` (versions, metadata).
"""

from __future__ import annotations

import json
import warnings
from collections.abc import Mapping, Sequence

import onnx
from onnx import helper

from ..errors import TrainingOpError
from ..lora.spec import LoraSpec, lora_spec
from ..optim.base import Optimizer
from ..optim.registry import OPTIMIZER_CLASSES, to_json
from ..optim.rmsprop import RMSProp
from ..passes._graph import all_names, value_types
from ..passes.fit_runtime import fit_runtime, runtime_limits
from ..passes.mixed_precision import mixed_precision
from ..schema import DOMAIN, OPSET_VERSION
from ..storage.large_model import LargeModel
from ..storage.model_files import ModelLike, as_model
from . import sparse_updates as sparse_updates_
from .algorithm import Algorithm, training_info
from .dynamo_params import Restored, exported_parameters, restore_parameters
from .eval_mode import to_inference
from .grad_clip import checked_limit
from .initialization import initialization_graph
from .kv_cache import drop_kv_cache
from .loss_graph import add_loss, label_range, label_shape
from .loss_scaling import LossScaler, LossScaling, checked_scaling
from .losses import Loss
from .metadata import TrainingMetadata
from .padding_rows import detect_padding_rows, mark_lookups, recorded_padding_rows, resolve_padding_rows
from .param_groups import groups_record, resolve_groups
from .torch_record import LOST_KEY, UNHELD_KEY
from .torch_record import read as read_record
from .train_mode import fit_opset, training_forward
from .trainables import check_differentiable, choose_trainables, refuse_lost
from .untie import describe as describe_untied
from .untie import untie_merged_initializers
from .update import add_learning_rates, add_update
from .value_params import folded_conv_weights, restore_copies

MIN_OPSET = 13
TRAIN_MODE_OPS = ("Dropout", "BatchNormalization")  # what mode="train" changes


def default_opset(model: onnx.ModelProto) -> int:
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            return o.version
    raise TrainingOpError("the model imports no ai.onnx opset")


def _fit_opset(model: onnx.ModelProto) -> onnx.ModelProto:
    """ai.onnx opset >= 13 (SoftmaxCrossEntropyLoss, ReduceMean forms); fit_runtime clamps the top."""
    opset = default_opset(model)
    if opset < MIN_OPSET:
        try:
            model = onnx.version_converter.convert_version(model, MIN_OPSET)
        except Exception as error:  # noqa: BLE001
            raise TrainingOpError(
                f"the model imports ai.onnx opset {opset}; training models need >= {MIN_OPSET} and "
                f"onnx.version_converter failed: {error}"
            ) from error
    return model


def _check_choices(mode: str, optimizer) -> None:
    if mode not in ("eval", "train"):
        raise TrainingOpError(f"mode must be 'eval' or 'train', found {mode!r}")
    if not isinstance(optimizer, tuple(OPTIMIZER_CLASSES.values())):
        raise TrainingOpError(
            f"optimizer must be onnx_training_ops.Adam, AdamW, Momentum, Adagrad, RMSProp or OrtAdamW, found "
            f"{type(optimizer).__name__}"
        )


def _forward(model: onnx.ModelProto, mode: str, seed: int, t_name: str, types,
             algo: Algorithm) -> tuple[dict[str, str], list[tuple[str, str]]]:
    """The forward pass the loss reads. ``"eval"``: the main graph itself (nothing to add).
    ``"train"``: a training-mode copy in the algorithm graph (:mod:`.train_mode`); returns
    the copy's names of main-graph values and the running-statistic updates."""
    if mode == "eval":
        return {}, []
    if not any(n.op_type in TRAIN_MODE_OPS and n.domain in ("", "ai.onnx") for n in model.graph.node):
        warnings.warn("mode='train' changes nothing for this model: it holds no Dropout or BatchNormalization "
                      "(torch.onnx.export drops Dropout from a module in eval mode); export the module after "
                      "model.train() (TorchScript exporter: training=torch.onnx.TrainingMode.TRAINING) to "
                      "train with them, or build with mode='eval'", stacklevel=3)
    to_inference(model.graph)
    ranks = {name: len(vt.shape) for name, vt in types.items() if vt.shape is not None}
    forward, renamed, stat_updates = training_forward(
        model.graph, ranks, default_opset(model), t_name, seed, algo.name)
    algo.nodes += forward
    return renamed, stat_updates


def _finish(model: onnx.ModelProto, meta: TrainingMetadata) -> onnx.ModelProto:
    """Versions the installed onnxruntime loads (IR >= 7 for training_info), the training
    domain's opset, and the builder's metadata (replacing an earlier build's)."""
    max_ir, _ = runtime_limits()
    model = fit_runtime(model)
    model.ir_version = max(min(model.ir_version or max_ir, max_ir), 7)
    if not any(o.domain == DOMAIN for o in model.opset_import):
        model.opset_import.append(helper.make_opsetid(DOMAIN, OPSET_VERSION))
    meta.write(model)
    return model


def build_training_model(
    model: ModelLike,
    loss: str | Loss,
    optimizer: Optimizer | RMSProp,
    trainable: Sequence[str] | None = None,
    *,
    output: str | None = None,
    labels: str | None = None,
    learning_rate: str = "learning_rate",
    mode: str = "eval",
    seed: int = 0,
    param_groups: Sequence[Mapping] | None = None,
    clip_grad_norm: float | None = None,
    clip_grad_value: float | None = None,
    sparse_updates: Mapping[str, str] | None = None,
    precision: str = "fp32",
    precision_provider: str | None = None,
    loss_scaling: LossScaling | bool | None = None,
    padding_rows: Mapping[str, int | None] | None = None,
) -> onnx.ModelProto | LargeModel:
    """An ONNX training model (one ModelProto with ``training_info``) for ``model``.

    A large model comes back as a :class:`~onnx_training_ops.storage.LargeModel` (its
    message and its big tensors as arrays): when ``model`` is one, or a file past
    :func:`~onnx_training_ops.storage.large_model_bytes` of tensors (its weights then stay
    memory-mapped from the file), or when the training model's tensors (weights and
    optimizer state) would pass that size. Its optimizer state takes no memory: read-only
    constant arrays that a :class:`~onnx_training_ops.TrainingSession` materializes.

    Args:
        model: an inference model (ModelProto, LargeModel, path or bytes), e.g. from
            ``onnx.helper`` or ``torch.onnx.export`` (past 2 GB: with external data), or a
            folder of onnxruntime-genai's model builder (its key/value cache inputs and
            outputs are left out: a step sees whole sequences). Opsets
            below 13 are converted.
        loss: a loss of :mod:`onnx_training_ops.builder.losses` (``CrossEntropyLoss(...)``,
            ``MSELoss()``, ``L1Loss()``, ``HuberLoss()``, ``SmoothL1Loss()``,
            ``BCEWithLogitsLoss()``), one of their names (``"mse"``, ``"cross_entropy"``,
            ``"l1"``, ``"huber"``, ``"smooth_l1"``, ``"bce_with_logits"``; defaults as in torch)
            reading ``output`` and a new input (``labels`` int64 for cross-entropy, ``target``
            shaped like the output otherwise), or the name of a scalar float output already in
            the model.
        optimizer: :class:`~onnx_training_ops.Adam`, :class:`~onnx_training_ops.AdamW`,
            :class:`~onnx_training_ops.Momentum`, :class:`~onnx_training_ops.Adagrad`,
            :class:`~onnx_training_ops.RMSProp` or :class:`~onnx_training_ops.OrtAdamW`.
        trainable: names of main-graph initializers to train; default: the LoRA adapters of a
            model from :func:`~onnx_training_ops.add_lora`, else what torch would call the
            parameters, every float/double initializer of rank >= 1 with a differentiable
            path to the loss, except BatchNormalization's running statistics and quantized
            weights (``MatMulNBits``, ``GatherBlockQuantized``, ``DequantizeLinear``: frozen).
        output: the model output the loss reads; default the first output.
        labels: name of the new label/target input; default ``"labels"`` (cross_entropy) or
            ``"target"`` (the other losses).
        learning_rate: name of the algorithm graph's learning-rate input R (default value
            ``optimizer.lr``); other parameter groups get ``<learning_rate>.<group name>``.
        mode: ``"eval"`` (default): the loss reads the inference graph as it is. ``"train"``:
            the algorithm graph runs a training-mode copy of the forward pass, like torch's
            ``model.train()``: BatchNormalization on batch statistics with its running
            statistics updated as state, Dropout with a fresh mask each step (see
            :mod:`onnx_training_ops.builder.train_mode`); the main graph stays the eval-mode graph.
        seed: the dropout masks' seed (``mode="train"``): same seed, same masks.
        param_groups: torch-style parameter groups chosen by glob or regex patterns, with
            per-group optimizer values and ``frozen`` groups
            (:mod:`onnx_training_ops.builder.param_groups`): one optimizer node and one
            learning-rate input per group.
        clip_grad_norm: clip the global gradient norm as ``torch.nn.utils.clip_grad_norm_``
            (:mod:`onnx_training_ops.builder.grad_clip`); the norm before clipping is the output
            ``grad_norm`` that ``step`` returns.
        clip_grad_value: clip each gradient element as ``torch.nn.utils.clip_grad_value_``.
        sparse_updates: ``{trainable name or glob pattern: "dense" | "lazy" | "sparse"}`` for
            embedding tables (trainables read only by axis-0 ``Gather``): gradients kept as
            (unique indices, summed rows) and, with ``"lazy"``, only the looked-up rows updated
            (torch ``SparseAdam``); ``"sparse"`` is TensorFlow's sparse apply. See
            :mod:`onnx_training_ops.builder.sparse_updates`.
        precision: ``"fp32"`` (default), ``"fp16"`` or ``"bf16"``: mixed precision
            (:mod:`onnx_training_ops.passes.mixed_precision`): MatMul, Gemm, Conv,
            ConvTranspose and Einsum run in 16-bit (their float32 inputs cast down, their
            outputs cast back up), everything else in float32; the weights and the optimizer
            state stay float32.
        precision_provider: the execution provider whose 16-bit kernels decide which ops go
            16-bit (an op without one stays float32;
            :data:`~onnx_training_ops.passes.mixed_precision.KERNELS_16BIT`); default
            ``"CUDAExecutionProvider"``. onnxruntime's CPU EP has no 16-bit compute kernels: an
            fp16 model runs there with those nodes computed in float32; a bf16 one is refused.
        loss_scaling: dynamic loss scaling (:class:`~onnx_training_ops.builder.loss_scaling.LossScaling`,
            torch ``GradScaler``'s semantics, state in the graph); default on for fp16 with
            torch's defaults, off otherwise; ``False`` turns it off.
        padding_rows: ``{embedding table name: row}``: torch's ``nn.Embedding(padding_idx=row)``,
            the row's gradient from the table's lookups kept zero (weight decay still applies).
            Read from a dynamo export's node metadata (torch's default exporter); the
            TorchScript exporter keeps nothing of it, so pass it then. Entries here override
            what was read; ``None`` trains that table's padding row. See
            :mod:`onnx_training_ops.builder.padding_rows`.

    Returns:
        The training model: a ModelProto, or a ``LargeModel`` as said above. It passes
        ``onnx.checker.check_model(full_check=True)``.

    Raises:
        TrainingOpError: bad arguments (a ``padding_rows`` entry naming no table looked up
            on axis 0, or a row out of range), a model that already has ``training_info``, no
            trainable tensor, or ops on the path to the loss without a derivative rule (all
            of them listed at once, with a hint).
    """
    scaling, clip_grad_norm, clip_grad_value = _checked_arguments(
        mode, optimizer, precision, precision_provider, loss_scaling, clip_grad_norm, clip_grad_value)
    opened = as_model(model)
    model, lora = _prepared(opened.model_proto, mode)
    restored = _restored_parameters(model, opened)
    padding = resolve_padding_rows(padding_rows, detect_padding_rows(model.graph, recorded_padding_rows(model)),
                                   model)
    mixed = mixed_precision(model, precision, precision_provider)[1] if precision != "fp32" else None
    types = value_types(model)
    elem_types = {name: vt.elem_type for name, vt in types.items()}
    algo = Algorithm(all_names(model.graph))

    t_name = algo.name("optimizer.T")  # the update count, also the dropout masks' counter
    renamed, stat_updates = _forward(model, mode, seed, t_name, types, algo)
    spec, loss_name, eval_loss, target = add_loss(model, loss, output, labels, types, renamed, algo)
    candidates = choose_trainables(model, trainable, algo.nodes, loss_name, elem_types, restored)
    groups, frozen = resolve_groups([p.name for p in candidates], param_groups, optimizer, learning_rate)
    params = [p for p in candidates if p.name not in frozen]
    refuse_lost(restored, trainable, [p.name for p in params], param_groups, {t.name for t in model.graph.initializer})
    if restored:
        warnings.warn(restored.describe(), stacklevel=2)
    check_differentiable(model, algo.nodes, loss_name, params, elem_types)

    add_learning_rates(groups, params, algo)
    modes = sparse_updates_.resolve_modes(sparse_updates, [p.name for p in params])
    tables = sparse_updates_.find_tables(modes, params, list(model.graph.node) + algo.nodes,
                                         algo.nodes if mode == "train" else model.graph.node)
    scaler = LossScaler(scaling, algo) if scaling is not None else None
    forward, others = (algo.nodes, list(model.graph.node)) if mode == "train" else (list(model.graph.node), [])
    padding = mark_lookups(padding, params, forward, others, given=set(padding_rows or ()))
    state_names, norm_name = add_update(params, groups, loss_name, t_name, clip_grad_norm,
                                        clip_grad_value, algo, tables, scaler, padding)
    # the optimizer state as constant arrays (no memory): a small model gets its values at the end
    initialization, init_binding = initialization_graph(params, groups, state_names, t_name,
                                                        algo.taken, algo.inits, opened.large_initializers)
    if scaler is not None:
        scaler.initialization(initialization, init_binding, algo.taken)
    inits = {t.name: t for t in model.graph.initializer}
    for stat, new in stat_updates:  # running statistics (mode="train"): state, not trained
        algo.bind(stat, new, inits[stat].data_type, inits[stat].dims)
    model.training_info.append(training_info(algo, initialization, init_binding))

    outputs = {o.name: o for o in model.graph.output}
    meta = TrainingMetadata(
        optimizer=json.loads(to_json(optimizer)),
        loss=(loss_name,),
        labels=target,
        label_range=label_range(spec, types, outputs, output),
        label_shape=label_shape(spec, types, outputs, output),
        learning_rate=(learning_rate,),
        trainable=tuple(p.name for p in params),
        # each trainable's optimizer state variables (what sharding the state must keep together)
        optimizer_state={p.name: tuple(state_names[p.name].values()) for p in params},
        mode=mode,
        seed=seed,
        eval_loss=eval_loss if eval_loss != loss_name else None,
        param_groups=tuple(groups_record(groups)) if param_groups is not None else None,
        grad_norm=norm_name or None,
        sparse_updates=modes or None,
        precision=precision if mixed is not None else None,
        precision_provider=mixed.provider if mixed is not None else None,
        precision_nodes={"16-bit": list(mixed.converted), "fp32": list(mixed.kept_fp32)} if mixed is not None else None,
        loss_scaling=scaler.metadata() if scaler is not None else None,
        padding_rows=dict(sorted(padding.items())) if padding else None,
        lora=lora.to_json() if lora is not None else None,  # add_lora's record, for save_adapter
    )
    model = _finish(model, meta)
    return opened.with_proto(model).remeasured().public()


def _checked_arguments(mode: str, optimizer: Optimizer | RMSProp, precision: str, precision_provider: str | None,
                       loss_scaling: LossScaling | bool | None, clip_grad_norm: float | None,
                       clip_grad_value: float | None) -> tuple[LossScaling | None, float | None, float | None]:
    """The choices checked: the loss scaling to use and the clipping limits."""
    _check_choices(mode, optimizer)
    if precision not in ("fp32", "fp16", "bf16"):
        raise TrainingOpError(f"precision must be 'fp32', 'fp16' or 'bf16', found {precision!r}")
    if precision == "fp32" and precision_provider is not None:
        raise TrainingOpError("precision_provider is for precision='fp16' or 'bf16'; found precision='fp32'")
    return (checked_scaling(loss_scaling, precision), checked_limit("clip_grad_norm", clip_grad_norm),
            checked_limit("clip_grad_value", clip_grad_value))


def _prepared(model: onnx.ModelProto, mode: str) -> tuple[onnx.ModelProto, LoraSpec | None]:
    """The inference model at a usable opset, without key/value caches, and its LoRA record."""
    model = _fit_opset(model)
    if mode == "train":
        model = fit_opset(model)  # Dropout masks need opset 18
    if model.training_info:
        raise TrainingOpError("the model already has training_info; pass the inference model")
    lora = lora_spec(model)
    drop_kv_cache(model)  # a training step sees whole sequences: no past keys and values
    return model, lora


def _restored_parameters(model: onnx.ModelProto, opened: LargeModel) -> Restored:
    """torch's parameters the export folded or copied, restored as initializers (with what is lost)."""
    restored = restore_parameters(model, opened.array)
    if exported_parameters(model.graph) is None:  # TorchScript: folded copies of parameters it holds
        restored.computed += restore_copies(model, opened.array)
        restored.lost.update(folded_conv_weights(model, read_record(model)))
    restored.lost.update(read_record(model, LOST_KEY) or {})
    unheld = read_record(model, UNHELD_KEY)
    if unheld:
        warnings.warn(f"{len(unheld)} torch parameter(s) that no initializer of the export holds (recorded by "
                      f"record_torch_names) will not train: {', '.join(list(unheld)[:6])}"
                      f"{' ...' if len(unheld) > 6 else ''}: {next(iter(unheld.values()))}", stacklevel=3)
    untied = untie_merged_initializers(model)
    if untied:
        warnings.warn(describe_untied(untied), stacklevel=3)
    return restored
