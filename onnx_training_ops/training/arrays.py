"""numpy helpers shared by the training modules."""

from __future__ import annotations

import numpy as np
from onnx import helper


def np_dtype(elem_type: int) -> np.dtype:
    """The numpy dtype of an ONNX tensor element type."""
    return np.dtype(helper.tensor_dtype_to_np_dtype(elem_type))


def dtype_name(dtype) -> str:
    """``float32``, ``int64``, ...: a dtype as error messages name it."""
    return np.dtype(dtype).name


def owned(array: np.ndarray) -> np.ndarray:
    """A C-contiguous, aligned, writeable array owning its memory (what the fused kernels want)."""
    return np.array(array, copy=True, order="C")
