"""What a model trains: :func:`summary` of a training model (or an inference model) and of a session.

``summary(model)`` lists the trainable and frozen tensors with their shapes, the parameter
counts, the optimizer with the size of its state, the loss and the ops the gradient flows
through (each with a derivative rule). ``print(summary(model))`` gives a table; the
:class:`ModelSummary` fields are plain lists for programs. The builder's
``metadata["trainable"]`` (a comma-joined string) stays as it is: it is a file format.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper

from ..autodiff.graph import active_values, gradient_path
from ..autodiff.registry import has_rule
from ..builder.metadata import TrainingMetadata
from ..passes._graph import value_types
from ..storage.model_files import ModelLike, as_model

FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
               onnx.TensorProto.BFLOAT16)


@dataclass(frozen=True)
class TensorInfo:
    """One tensor: its name, shape, element type (numpy's name) and element count."""

    name: str
    shape: tuple[int, ...]
    dtype: str

    @property
    def size(self) -> int:
        """Elements in the tensor."""
        return int(np.prod(self.shape, dtype=np.int64)) if self.shape else 1

    @property
    def nbytes(self) -> int:
        """Bytes the tensor takes."""
        return self.size * np.dtype(self.dtype).itemsize


@dataclass(frozen=True)
class ModelSummary:
    """What :func:`summary` found. Lists, not strings: ``trainable``/``frozen`` tensors,
    ``optimizer_state`` tensors (V, H, ...: one entry per state variable), the optimizer as
    its builder record (``{"type": "AdamW", "lr": ...}``, None if not built by
    :func:`~onnx_training_ops.build_training_model`), ``loss`` (the loss value's name),
    ``labels`` (the label input), ``mode``, ``learning_rates`` (input name -> default),
    ``gradient_ops`` (op type -> nodes the gradient flows through, each with a derivative
    rule) and ``ops_without_rules`` (op types of the graph that have none: fine off the
    gradient path). ``precision``: the builder's mixed precision record (``{"precision":
    "fp16", "16-bit": [nodes], "fp32": [nodes], "loss_scaling": {...} or None}``), None for
    a float32 build. ``training`` is False for an inference model."""

    training: bool
    trainable: list[TensorInfo]
    frozen: list[TensorInfo]
    optimizer: dict | None = None
    optimizer_state: list[TensorInfo] = field(default_factory=list)
    loss: str | None = None
    labels: str | None = None
    mode: str | None = None
    learning_rates: dict[str, float] = field(default_factory=dict)
    gradient_ops: dict[str, int] = field(default_factory=dict)
    ops_without_rules: list[str] = field(default_factory=list)
    precision: dict | None = None

    @property
    def trainable_count(self) -> int:
        """Elements in the trainable tensors (torch's ``sum(p.numel() for p in params)``)."""
        return sum(t.size for t in self.trainable)

    @property
    def frozen_count(self) -> int:
        """Elements in the other initializers (frozen weights, buffers, constants)."""
        return sum(t.size for t in self.frozen)

    @property
    def optimizer_state_bytes(self) -> int:
        """Bytes of the optimizer's state (V, H... and the step count)."""
        return sum(t.nbytes for t in self.optimizer_state)

    def to_dict(self) -> dict:
        """The summary as JSON-ready data (what ``onnx-training-ops summary --json`` prints)."""
        def tensors(items):
            return [{"name": t.name, "shape": list(t.shape), "dtype": t.dtype} for t in items]
        return {"training": self.training, "trainable": tensors(self.trainable), "frozen": tensors(self.frozen),
                "trainable_count": self.trainable_count, "frozen_count": self.frozen_count,
                "optimizer": self.optimizer, "optimizer_state": tensors(self.optimizer_state),
                "optimizer_state_bytes": self.optimizer_state_bytes, "loss": self.loss, "labels": self.labels,
                "mode": self.mode, "learning_rates": self.learning_rates, "gradient_ops": self.gradient_ops,
                "ops_without_rules": self.ops_without_rules, "precision": self.precision}

    def __str__(self) -> str:
        width = max([len(t.name) for t in self.trainable + self.frozen] + [10])
        lines = []
        if self.training:
            opt = dict(self.optimizer or {})
            kind = opt.pop("type", "unknown")
            lines.append(f"optimizer: {kind}(" + ", ".join(f"{k}={v}" for k, v in opt.items()) + ")"
                         f", state {len(self.optimizer_state)} tensors, {_bytes(self.optimizer_state_bytes)}")
            lines.append(f"loss: {self.loss} (labels: {self.labels}, mode: {self.mode})")
            if self.precision:
                scaling = self.precision.get("loss_scaling")
                lines.append(f"precision: {self.precision['precision']} ({len(self.precision['16-bit'])} nodes "
                             f"16-bit, {len(self.precision['fp32'])} kept float32; "
                             + (f"loss scaling from {scaling['init_scale']:g})" if scaling else "no loss scaling)"))
            if self.learning_rates:
                lines.append("learning rates: " + ", ".join(f"{k}={v:g}" for k, v in self.learning_rates.items()))
        lines.append(f"trainable: {len(self.trainable)} tensors, {self.trainable_count:,} parameters")
        lines += [f"  {t.name:<{width}}  {_shape(t.shape):<16} {t.dtype}" for t in self.trainable]
        lines.append(f"frozen: {len(self.frozen)} tensors, {self.frozen_count:,} elements")
        lines += [f"  {t.name:<{width}}  {_shape(t.shape):<16} {t.dtype}" for t in self.frozen]
        if self.training:
            lines.append("gradient through: " + (", ".join(f"{op} x{n}" for op, n in self.gradient_ops.items())
                                                 or "nothing"))
        if self.ops_without_rules:
            lines.append("ops without a derivative rule: " + ", ".join(self.ops_without_rules)
                         + (" (off the gradient path)" if self.training else ""))
        return "\n".join(lines)


def _shape(shape) -> str:
    return "[" + ", ".join(str(d) for d in shape) + "]"


def _bytes(n: int) -> str:
    size = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if size < 1024 or unit == "GiB":
            return f"{size:.0f} {unit}" if unit == "B" else f"{size:.1f} {unit}"
        size /= 1024
    return f"{size} B"  # pragma: no cover


def _info(t: onnx.TensorProto) -> TensorInfo:
    dtype = np.dtype(helper.tensor_dtype_to_np_dtype(t.data_type)).name
    return TensorInfo(t.name, tuple(int(d) for d in t.dims), dtype)


def _all_tensors(model: onnx.ModelProto) -> dict[str, TensorInfo]:
    found = {t.name: _info(t) for t in model.graph.initializer}
    for info in model.training_info:
        for graph in (info.algorithm, info.initialization):
            found.update({t.name: _info(t) for t in graph.initializer if t.name not in found})
    return found


def _ops_without_rules(nodes) -> list[str]:
    return sorted({n.op_type for n in nodes if not has_rule(n)})


def _gradient_ops(model: onnx.ModelProto) -> tuple[dict[str, int], list]:
    """Op types (with counts) on the path from the trainables to the loss, and the forward nodes."""
    algorithm = model.training_info[0].algorithm
    cut = next((i for i, n in enumerate(algorithm.node) if n.op_type == "Gradient"), None)
    if cut is None:
        return {}, list(model.graph.node)
    gradient = algorithm.node[cut]
    attrs = {a.name: helper.get_attribute_value(a) for a in gradient.attribute}
    xs = [x.decode() if isinstance(x, bytes) else x for x in attrs.get("xs", [])]
    y = attrs.get("y", b"")
    y = y.decode() if isinstance(y, bytes) else y
    nodes = list(model.graph.node) + list(algorithm.node[:cut])
    types = value_types(model)
    floats = {name for name, vt in types.items() if vt.elem_type in FLOAT_TYPES}
    known = set(types)
    order = range(len(nodes))
    active = active_values(nodes, order, xs, lambda n: n in floats or n not in known)
    path, _ = gradient_path(nodes, order, y, active)
    counts = Counter(nodes[i].op_type for i in path)
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0]))), nodes


def summary(model: ModelLike, state: Mapping[str, np.ndarray] | None = None) -> ModelSummary:
    """What ``model`` trains, as lists (``print`` it for a table).

    Args:
        model: a training model (from :func:`~onnx_training_ops.build_training_model` or a
            checkpoint) or an inference model: ModelProto, LargeModel, path or bytes.
        state: the live state arrays of a session (shapes and dtypes read from them); default:
            the model's tensors.

    Returns:
        A :class:`ModelSummary`. For an inference model ``training`` is False, ``trainable``
        lists what :func:`~onnx_training_ops.build_training_model` would train by default
        (float initializers of rank >= 1) and ``frozen`` the other initializers.

    Raises:
        TrainingOpError: the model cannot be read.
    """
    proto = as_model(model, copy=False).model_proto
    tensors = _all_tensors(proto)
    if state is not None:
        tensors.update({n: TensorInfo(n, tuple(a.shape), a.dtype.name) for n, a in state.items()})
    inits = [tensors[t.name] for t in proto.graph.initializer]
    if not proto.training_info:
        trainable = [t for t in inits if t.shape and np.dtype(t.dtype).kind == "f"]
        frozen = [t for t in inits if t not in trainable]
        return ModelSummary(False, trainable, frozen, ops_without_rules=_ops_without_rules(proto.graph.node))
    meta = TrainingMetadata.from_model(proto)
    names = list(meta.trainable)
    if not names:  # a training model written by hand: what its update binding writes that is a parameter
        bound = {b.key for info in proto.training_info for b in info.update_binding}
        names = [t.name for t in proto.graph.initializer
                 if t.name in bound and np.dtype(tensors[t.name].dtype).kind == "f"]
    chosen = set(names)
    trainable = [tensors[n] for n in names if n in tensors]
    frozen = [t for t in inits if t.name not in chosen]
    state_map = meta.optimizer_state or {}
    t_names = sorted({b.key for info in proto.training_info for b in info.update_binding
                      if b.key.startswith("optimizer.T")})
    optimizer_state = [tensors[s] if s in tensors else TensorInfo(s, tensors[p].shape, tensors[p].dtype)
                       for p in names for s in state_map.get(p, ())] + [tensors[t] for t in t_names if t in tensors]
    optimizer = dict(meta.optimizer) if meta.optimizer else None
    rates = _learning_rates(proto, meta)
    gradient_ops, nodes = _gradient_ops(proto)
    return ModelSummary(True, trainable, frozen, optimizer, optimizer_state, ",".join(meta.loss) or None, meta.labels,
                        meta.mode, rates, gradient_ops,
                        _ops_without_rules(n for n in nodes if n.op_type not in gradient_ops), _precision(meta))


def _precision(meta: TrainingMetadata) -> dict | None:
    """The builder's mixed precision record, or None for a float32 build."""
    if not meta.precision:
        return None
    nodes = meta.precision_nodes or {}
    return {"precision": meta.precision, "provider": meta.precision_provider,
            "16-bit": nodes.get("16-bit", []), "fp32": nodes.get("fp32", []),
            "loss_scaling": dict(meta.loss_scaling) if meta.loss_scaling else None}


def _learning_rates(proto: onnx.ModelProto, meta: TrainingMetadata) -> dict[str, float]:
    """The learning-rate inputs of the algorithm with their defaults (scalar float initializers fed as inputs)."""
    base = ",".join(meta.learning_rate)
    out = {}
    for info in proto.training_info:
        inputs = {i.name for i in info.algorithm.input}
        for t in info.algorithm.initializer:
            if t.name in inputs and base and (t.name == base or t.name.startswith(base + ".")):
                out[t.name] = float(onnx.numpy_helper.to_array(t).reshape(-1)[0])
    return out
