"""Moved to :mod:`onnx_training_ops.optim._common`; kept for old imports."""

from ..optim._common import FLOAT_DTYPES, check_group, interleave, scalar_count, scalar_rate, split_groups

__all__ = ["FLOAT_DTYPES", "check_group", "interleave", "scalar_count", "scalar_rate", "split_groups"]
