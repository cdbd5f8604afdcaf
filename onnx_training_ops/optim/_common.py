"""Shared plumbing of the reference kernels: scalar inputs, tensor groups, dtypes."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from ..errors import TrainingOpError
from ..schema import OPTIMIZERS

FLOAT_DTYPES = (np.dtype(np.float32), np.dtype(np.float64))


def float_defaults(op_type: str) -> dict[str, float]:
    """The schema's defaults of ``op_type``'s float attributes (float32-exact, as a model holds them)."""
    return {name: value for name, value in OPTIMIZERS[op_type].defaults.items() if isinstance(value, float)}


def scalar_rate(r, op_type: str) -> float:
    """The learning rate R (a float scalar of shape [] or [1]) as a Python float (exact)."""
    r = np.asarray(r)
    if r.dtype not in FLOAT_DTYPES or r.size != 1 or r.ndim > 1:
        raise TrainingOpError(
            f"{op_type}: input 'R' must be a float32/float64 scalar of shape [] or [1], "
            f"found {r.dtype} of shape {list(r.shape)}"
        )
    return float(r.reshape(()))


def scalar_count(t, op_type: str) -> int:
    """The update count T (an int64 scalar of shape [] or [1]) as a Python int."""
    t = np.asarray(t)
    if t.dtype != np.int64 or t.size != 1 or t.ndim > 1:
        raise TrainingOpError(
            f"{op_type}: input 'T' must be an int64 scalar of shape [] or [1], "
            f"found {t.dtype} of shape {list(t.shape)}"
        )
    return int(t.reshape(()))


def split_groups(tensors: Sequence, names: Sequence[str], op_type: str) -> list[tuple]:
    """Regroup ``X1..Xn, G1..Gn, V1..Vn, ...`` into per-tensor tuples ``(Xi, Gi, Vi, ...)``.

    Checks the count, that every tensor is a float array of one dtype per group, and
    that the group's shapes broadcast to the shape of its X.
    """
    k = len(names)
    if not tensors or len(tensors) % k:
        raise TrainingOpError(
            f"{op_type}: expected R, T and then {k}*N tensors ({', '.join(names)} per optimized "
            f"tensor), found {len(tensors)} tensors after R and T"
        )
    n = len(tensors) // k
    groups = []
    for i in range(n):
        group = tuple(np.asarray(tensors[j * n + i]) for j in range(k))
        check_group(group, names, op_type, i)
        groups.append(group)
    return groups


def check_group(group: Sequence[np.ndarray], names: Sequence[str], op_type: str, index: int = 0) -> None:
    """Raise TrainingOpError unless the group shares one float dtype and broadcasts to X's shape."""
    x = group[0]
    label = f"{op_type}: tensor {index}"
    for name, a in zip(names, group):
        if a.dtype not in FLOAT_DTYPES:
            raise TrainingOpError(f"{label}: input {name!r} must be float32 or float64, found {a.dtype}")
        if a.dtype != x.dtype:
            raise TrainingOpError(
                f"{label}: inputs {', '.join(names)} must share one dtype; "
                f"{names[0]!r} is {x.dtype} but {name!r} is {a.dtype}"
            )
    try:
        shape = np.broadcast_shapes(*(a.shape for a in group))
    except ValueError:
        shape = None
    if shape != x.shape:
        found = ", ".join(f"{n}{list(a.shape)}" for n, a in zip(names, group))
        raise TrainingOpError(
            f"{label}: shapes must broadcast to the shape of {names[0]!r} {list(x.shape)}, found {found}"
        )


def interleave(per_tensor: Sequence[tuple]) -> tuple:
    """Per-tensor output tuples ``(Xi_new, Vi_new, ...)`` -> ``X1_new..Xn_new, V1_new..Vn_new, ...``."""
    return tuple(out for outputs in zip(*per_tensor) for out in outputs)
