"""The class-label range check a step runs before the run (:mod:`onnx_training_ops.training.inputs.checks`).

One loop over the labels: numpy's reduction machinery costs about 5 µs when the cache was
just flushed by onnxruntime's run (a small model's step is about 70 µs), this about 1.
"""

from __future__ import annotations

from ._numba_kernels import _jit


@_jit(parallel=False)
def labels_in_range(labels, classes, ignore, has_ignore):
    """True when every element of the flat integer array ``labels`` lies in ``[0, classes)``
    or (``has_ignore``) equals ``ignore``."""
    for i in range(labels.size):
        value = labels[i]
        if (value < 0 or value >= classes) and not (has_ignore and value == ignore):
            return False
    return True
