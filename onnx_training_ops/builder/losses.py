"""Losses the builder puts on a model's output, with torch.nn's names and semantics.

Each loss is a small frozen dataclass whose :meth:`emit` writes standard ONNX nodes from the
prediction (and a new label/target input the builder declares) to a scalar loss. Strings
keep working: ``"mse"`` is :class:`MSELoss`, ``"cross_entropy"`` :class:`CrossEntropyLoss`.

============================  =============================================================
torch                         here
============================  =============================================================
``CrossEntropyLoss``          ``CrossEntropyLoss(class_axis, ignore_index, label_smoothing,
                              weight, reduction, shift_labels)``
``MSELoss`` / ``L1Loss``      ``MSELoss(reduction)`` / ``L1Loss(reduction)``
``HuberLoss(delta)``          ``HuberLoss(delta, reduction)``
``SmoothL1Loss(beta)``        ``SmoothL1Loss(beta, reduction)``
``BCEWithLogitsLoss``         ``BCEWithLogitsLoss(pos_weight, weight, reduction)``
============================  =============================================================

``ignore_index=None`` drops torch's default -100 and, with it, the per-sample masking in the
gradient (about 10% of a small MLP's step).

``class_axis``: torch reads classes on axis 1 (``[N, C, d1...]``). A language-model head
gives ``[N, T, C]``; pass ``class_axis=-1`` there. For logits of rank >= 3 the axis must be
stated: guessing it would train silently on the wrong loss when T happens to equal C.
``shift_labels=True`` is the causal-LM loss of transformers: ``logits[:, :-1]`` against
``labels[:, 1:]`` (class axis last).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrainingOpError

REDUCTIONS = ("mean", "sum")
NEVER_A_LABEL = -(2 ** 62)  # an ignore_index no class number equals


class Emit:
    """Node emission for one loss: fresh names from the builder's ``unique`` function."""

    def __init__(self, unique: Callable[[str], str], np_dtype):
        self.unique, self.np_dtype = unique, np_dtype
        self.nodes: list[onnx.NodeProto] = []

    def op(self, op_type: str, inputs: Sequence[str], **attrs) -> str:
        out = self.unique(f"loss/{op_type}")
        self.nodes.append(helper.make_node(op_type, list(inputs), [out], name=out, **attrs))
        return out

    def const(self, value, dtype=None) -> str:
        name = self.unique("loss/const")
        array = np.asarray(value, dtype=dtype or self.np_dtype)
        self.nodes.append(helper.make_node("Constant", [], [name], name=name,
                                           value=numpy_helper.from_array(array)))
        return name

    def reduce(self, x: str, reduction: str) -> str:
        op = "ReduceMean" if reduction == "mean" else "ReduceSum"
        return self.op(op, [x], keepdims=0)


def _check_reduction(loss: str, reduction: str) -> None:
    if reduction not in REDUCTIONS:
        raise TrainingOpError(f"{loss}: reduction must be one of {REDUCTIONS}, found {reduction!r}")


@dataclass(frozen=True)
class Loss:
    """Base: ``emit(em, prediction, label, shape) -> loss name``; ``label_type`` says what the
    label input is ("int64 classes" or "like prediction")."""

    integer_labels: ClassVar[bool] = False
    default_label_name: ClassVar[str] = "target"

    def label_shape(self, shape):
        return shape

    def emit(self, em: Emit, pred: str, label: str, shape) -> str:
        """The loss's nodes (into ``em``) reading ``pred`` and ``label``; the loss value's name."""
        raise NotImplementedError


@dataclass(frozen=True)
class _Pointwise(Loss):
    """MSELoss and L1Loss: the mean or sum of the squared (``_square``) or absolute difference of prediction
    and target; a subclass declares its ``reduction`` field."""

    _square: ClassVar[bool]
    if TYPE_CHECKING:
        reduction: str  # a field of each subclass (declared there, after its own fields)

    def __post_init__(self):
        _check_reduction(type(self).__name__, self.reduction)

    def emit(self, em: Emit, pred: str, label: str, shape) -> str:
        diff = em.op("Sub", [pred, label])
        return em.reduce(em.op("Mul", [diff, diff]) if self._square else em.op("Abs", [diff]), self.reduction)


@dataclass(frozen=True)
class MSELoss(_Pointwise):
    """``torch.nn.MSELoss``: the squared difference of prediction and target (string ``"mse"``).

    Args:
        reduction: ``"mean"`` or ``"sum"`` over every element.

    Raises:
        TrainingOpError: a reduction other than mean/sum.
    """

    reduction: str = "mean"
    _square = True


@dataclass(frozen=True)
class L1Loss(_Pointwise):
    """``torch.nn.L1Loss``: the absolute difference of prediction and target (string ``"l1"``).

    Args:
        reduction: ``"mean"`` (torch's default) or ``"sum"`` over every element.

    Raises:
        TrainingOpError: a reduction other than mean/sum.
    """

    reduction: str = "mean"
    _square = False


@dataclass(frozen=True)
class _QuadraticThenLinear(Loss):
    """HuberLoss and SmoothL1Loss: ``0.5 d^2 / (1 or width)`` inside ``|d| < width``, else a line meeting it.

    A subclass declares its width field (named as torch names it) and a ``reduction`` field, and says in
    ``_width`` which field is the width and in ``_scale_linear`` whether the line is scaled by the width
    (Huber) or the square divided by it (SmoothL1).
    """

    _width: ClassVar[str]
    _scale_linear: ClassVar[bool]
    if TYPE_CHECKING:
        reduction: str  # a field of each subclass (declared there, after its own fields)

    def __post_init__(self):
        loss, width = type(self).__name__, getattr(self, self._width)
        _check_reduction(loss, self.reduction)
        if not width > 0:
            raise TrainingOpError(f"{loss}: {self._width} must be > 0, found {width}")

    def emit(self, em: Emit, pred: str, label: str, shape) -> str:
        width = getattr(self, self._width)
        d = em.op("Abs", [em.op("Sub", [pred, label])])
        inside = em.op("Less", [d, em.const(width)])
        square = em.op("Mul", [em.op("Mul", [d, d]), em.const(0.5 if self._scale_linear else 0.5 / width)])
        line = em.op("Sub", [d, em.const(0.5 * width)])
        if self._scale_linear:
            line = em.op("Mul", [line, em.const(width)])
        return em.reduce(em.op("Where", [inside, square, line]), self.reduction)


@dataclass(frozen=True)
class HuberLoss(_QuadraticThenLinear):
    """``torch.nn.HuberLoss``: ``0.5 d^2`` inside ``|d| < delta``, else ``delta (|d| - 0.5 delta)``
    (string ``"huber"``).

    Args:
        delta: where the quadratic part meets the linear one (> 0).
        reduction: ``"mean"`` or ``"sum"`` over every element.

    Raises:
        TrainingOpError: a reduction other than mean/sum, or ``delta <= 0``.
    """

    delta: float = 1.0
    reduction: str = "mean"
    _width = "delta"
    _scale_linear = True


@dataclass(frozen=True)
class SmoothL1Loss(_QuadraticThenLinear):
    """``torch.nn.SmoothL1Loss``: ``0.5 d^2 / beta`` inside ``|d| < beta``, else ``|d| - 0.5 beta``
    (string ``"smooth_l1"``).

    Args:
        beta: the half-width of the quadratic part, which is divided by it (> 0); at ``beta -> 0`` the loss
            tends to L1.
        reduction: ``"mean"`` or ``"sum"`` over every element.

    Raises:
        TrainingOpError: a reduction other than mean/sum, or ``beta <= 0``.
    """

    beta: float = 1.0
    reduction: str = "mean"
    _width = "beta"
    _scale_linear = False


@dataclass(frozen=True)
class BCEWithLogitsLoss(Loss):
    """``torch.nn.BCEWithLogitsLoss`` (string ``"bce_with_logits"``).

    ``(1 - t) x + (1 + (pos_weight - 1) t) softplus(-x)``, times ``weight``; softplus written as
    ``relu(-x) + log(1 + exp(-|x|))`` so it never overflows.

    Args:
        pos_weight: weight of the positive term, one value per class (broadcast over the batch).
        weight: weight of each element's loss, broadcast to the logits.
        reduction: ``"mean"`` or ``"sum"`` over every element.

    Raises:
        TrainingOpError: a reduction other than mean/sum, or a value out of range.
    """

    pos_weight: tuple | None = None
    weight: tuple | None = None
    reduction: str = "mean"

    def __post_init__(self):
        _check_reduction("BCEWithLogitsLoss", self.reduction)

    def emit(self, em: Emit, pred: str, label: str, shape) -> str:
        neg = em.op("Neg", [pred])
        softplus = em.op("Add", [em.op("Relu", [neg]), em.op("Log", [em.op("Add", [
            em.const(1.0), em.op("Exp", [em.op("Neg", [em.op("Abs", [pred])])])])])])
        one_minus_t = em.op("Sub", [em.const(1.0), label])
        if self.pos_weight is not None:
            coeff = em.op("Add", [em.const(1.0), em.op("Mul", [
                em.op("Sub", [em.const(self.pos_weight), em.const(1.0)]), label])])
            softplus = em.op("Mul", [coeff, softplus])
        loss = em.op("Add", [em.op("Mul", [one_minus_t, pred]), softplus])
        if self.weight is not None:
            loss = em.op("Mul", [loss, em.const(self.weight)])
        return em.reduce(loss, self.reduction)


@dataclass(frozen=True)
class CrossEntropyLoss(Loss):
    """``torch.nn.CrossEntropyLoss`` on logits and int64 class labels (string ``"cross_entropy"``).

    Args:
        class_axis: the logits' class axis: 1 for torch's ``[N, C, d...]``, -1 for a language
            model's ``[N, T, C]``; must be stated for logits of rank >= 3 (None: rank 2).
        ignore_index: a label value that contributes no loss (torch's -100); None: every label
            counts, and no per-sample mask is built.
        label_smoothing: torch's label smoothing, in [0, 1].
        weight: one weight per class.
        reduction: ``"mean"`` or ``"sum"`` over every element.
        shift_labels: the causal-LM next-token loss: logits at position t score the label at
            t + 1 (labels = input_ids); implies ``class_axis=-1``.

    Raises:
        TrainingOpError: a reduction other than mean/sum, or a value out of range.
    """

    class_axis: int | None = None
    ignore_index: int | None = -100
    label_smoothing: float = 0.0
    weight: tuple | None = None
    reduction: str = "mean"
    shift_labels: bool = False

    integer_labels: ClassVar[bool] = True
    default_label_name: ClassVar[str] = "labels"

    def __post_init__(self):
        _check_reduction("CrossEntropyLoss", self.reduction)
        if not 0.0 <= self.label_smoothing <= 1.0:
            raise TrainingOpError("CrossEntropyLoss: label_smoothing must be in [0, 1], "
                                  f"found {self.label_smoothing}")
        if self.shift_labels and self.class_axis not in (None, -1):
            raise TrainingOpError("CrossEntropyLoss: shift_labels reads [N, T, C] logits "
                                  f"(class_axis=-1), found class_axis={self.class_axis}")

    def axis(self, shape) -> int:
        """The class axis for logits of ``shape`` (None: rank unknown)."""
        rank = None if shape is None else len(shape)
        axis = -1 if self.shift_labels and self.class_axis is None else self.class_axis
        if rank is not None and rank < 2:
            raise TrainingOpError(f"cross_entropy needs logits of rank >= 2 ([N, C, ...]), "
                                  f"found shape {list(shape)}")
        if axis is None:
            if rank is None or rank == 2:
                return 1
            raise TrainingOpError(
                f"cross_entropy on logits of rank {rank} (shape {list(shape)}): state the class "
                "axis, CrossEntropyLoss(class_axis=1) for torch's [N, C, d1, ...] layout or "
                "class_axis=-1 for a language-model head's [N, T, C]")
        if rank is not None:
            if not -rank <= axis < rank or axis % rank == 0:
                raise TrainingOpError(f"class_axis {axis} is not a class axis of logits of rank "
                                      f"{rank}")
            axis %= rank
        return axis

    def label_shape(self, shape):
        if shape is None:
            return ["N"]
        axis = self.axis(shape)
        dims = [d for i, d in enumerate(shape) if i != axis]
        return dims

    def emit(self, em: Emit, pred: str, label: str, shape) -> str:
        axis = self.axis(shape)
        rank = 2 if shape is None else len(shape)
        logits, labels, ignore_index = pred, label, self.ignore_index
        if self.shift_labels:
            # position t predicts label t + 1: the labels move left by one and the last
            # position is ignored. The logits are not sliced: no copy of them, and their
            # gradient is the loss node's own (zero where ignored)
            ignore_index = NEVER_A_LABEL if ignore_index is None else ignore_index
            labels = self._shifted(em, labels, rank - 1, None if shape is None else shape[1], ignore_index)
        if shape is not None and rank > 2 and axis == rank - 1:
            # classes last ([N, T, C], an LM head): rows of classes, no transpose
            classes = shape[-1]
            rows = em.const([-1, classes], np.int64) if isinstance(classes, int) else em.op("Concat", [
                em.const([-1], np.int64), em.op("Shape", [logits], start=-1)], axis=0)
            logits = em.op("Reshape", [logits, rows])
            labels = em.op("Reshape", [labels, em.const([-1], np.int64)])
            rank = 2
        elif axis != 1:  # classes to axis 1, as the ONNX loss ops read them
            perm = [0, axis] + [i for i in range(1, rank) if i != axis]
            logits = em.op("Transpose", [logits], perm=perm)
        weights = [em.const(self.weight)] if self.weight is not None else []
        # one SoftmaxCrossEntropyLoss node: its derivative rule is the compact
        # (softmax - onehot) * coefficient and reuses the log-probabilities it outputs
        log_probs = em.unique("loss/log_prob")
        nll = em.unique("loss/SoftmaxCrossEntropyLoss")
        ignore: dict[str, Any] = {} if ignore_index is None else {"ignore_index": ignore_index}
        em.nodes.append(helper.make_node(
            "SoftmaxCrossEntropyLoss", [logits, labels, *weights], [nll, log_probs], name=nll,
            reduction=self.reduction, **ignore))
        if not self.label_smoothing:
            return nll
        return self._smoothed(em, nll, log_probs, labels, rank, ignore_index)

    @staticmethod
    def _shifted(em: Emit, labels: str, label_rank: int, steps, ignore_index: int) -> str:
        """``labels[:, 1:]`` with a last column of ``ignore_index``, by ``Gather`` (columns
        1, 2, ..., T-1, T-1) and ``Where`` (the last one ignored): int64 ops with kernels on
        every execution provider (onnxruntime's CUDA ``Pad`` takes no int64), and no ragged
        ``Concat`` (a host table per run on CUDA). With the steps ``T`` symbolic, the
        positions come from its Shape (constant once the shapes are fixed)."""
        trailing = [1] * (label_rank - 2)  # the mask along axis 1 of labels [N, T, d...]
        if isinstance(steps, int):
            numbers = np.arange(1, steps + 1, dtype=np.int64)
            columns = em.const(np.minimum(numbers, steps - 1), np.int64)
            last = em.const((numbers == steps).reshape([steps, *trailing]), np.bool_)
        else:
            count = em.op("Shape", [labels], start=1, end=2)
            positions = em.op("Range", [em.const(1, np.int64), em.op("Add", [em.op("Squeeze", [count]),
                                                                          em.const(1, np.int64)]),
                                        em.const(1, np.int64)])
            columns = em.op("Min", [positions, em.op("Sub", [count, em.const([1], np.int64)])])
            last = em.op("Equal", [positions, count])
            if trailing:
                last = em.op("Unsqueeze", [last, em.const(list(range(1, 1 + len(trailing))), np.int64)])
        gathered = em.op("Gather", [labels, columns], axis=1)
        return em.op("Where", [last, em.const(ignore_index, np.int64), gathered])

    def _smoothed(self, em: Emit, nll: str, log_probs: str, labels: str, rank: int,
                  ignore_index: int | None) -> str:
        """torch: (1 - eps) nll + eps * sum_c(-log p_c * w_c) / C, reduced like nll (the mean
        divides by the number, or the total weight, of the non-ignored targets)."""
        eps = self.label_smoothing
        per_class = em.op("Neg", [log_probs])
        if self.weight is not None:
            shape = [1, len(self.weight)] + [1] * (rank - 2)
            per_class = em.op("Mul", [per_class, em.const(np.reshape(self.weight, shape))])
        smooth = em.op("ReduceSum", [per_class, em.const([1], np.int64)], keepdims=0)
        ignored = NEVER_A_LABEL if ignore_index is None else ignore_index
        kept = em.op("Not", [em.op("Equal", [labels, em.const(ignored, np.int64)])])
        smooth = em.op("Where", [kept, smooth, em.const(0.0)])
        total = em.op("ReduceSum", [smooth], keepdims=0)
        if self.reduction == "mean":
            if self.weight is not None:
                safe = em.op("Where", [kept, labels, em.const(0, np.int64)])
                target_w = em.op("Gather", [em.const(self.weight), safe], axis=0)
                count = em.op("ReduceSum", [em.op("Where", [kept, target_w, em.const(0.0)])],
                              keepdims=0)
            else:
                count = em.op("CastLike", [em.op("ReduceSum", [
                    em.op("Cast", [kept], to=TensorProto.INT64)], keepdims=0), total])
            total = em.op("Div", [total, count])
        n_classes = len(self.weight) if self.weight is not None else None
        if n_classes is None:
            classes = em.op("CastLike", [em.op("Gather", [em.op("Shape", [log_probs]),
                                                          em.const(1, np.int64)], axis=0),
                                         total])
            smooth_term = em.op("Div", [total, classes])
        else:
            smooth_term = em.op("Mul", [total, em.const(1.0 / n_classes)])
        return em.op("Add", [em.op("Mul", [nll, em.const(1.0 - eps)]),
                             em.op("Mul", [smooth_term, em.const(eps)])])


NAMED = {"mse": MSELoss, "cross_entropy": CrossEntropyLoss, "l1": L1Loss, "huber": HuberLoss,
         "smooth_l1": SmoothL1Loss, "bce_with_logits": BCEWithLogitsLoss}


def resolve(loss) -> Loss | None:
    """A Loss for a loss object or one of the :data:`NAMED` strings; None for other strings
    (the name of a scalar output already in the model)."""
    if isinstance(loss, Loss):
        return loss
    if isinstance(loss, str) and loss in NAMED:
        return NAMED[loss]()
    if isinstance(loss, str):
        return None
    raise TrainingOpError(f"loss must be a loss object (e.g. CrossEntropyLoss()), one of "
                          f"{sorted(NAMED)} or the name of a scalar output, found {loss!r}")
