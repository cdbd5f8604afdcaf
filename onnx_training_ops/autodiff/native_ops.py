"""Names of the native backward ops some derivative rules emit on the native path.

A rule emits one of these only when the expansion allows it (``Emitter.native``, set by
:data:`onnx_training_ops.passes.NATIVE_PASSES`); the kernels are
:mod:`onnx_training_ops.kernels._native_grad_kernels`, registered by
:mod:`onnx_training_ops.runtime.native_grads`. Every rule keeps its standard-op form for the
other paths.
"""

DOMAIN = "ai.onnx.contrib"  # where onnxruntime-extensions registers external ops
IM2COL = "TrainingIm2Col"
COL2IM = "TrainingCol2Im"
ALL = frozenset({IM2COL, COL2IM})
COLS_OF = "cols of Conv node "  # doc_string of an Im2Col a Conv's rule emits, + the Conv's name
BATCH_NORM_GRAD = "TrainingBatchNormGrad"  # kernels._native_norm_kernels
ALL = ALL | {BATCH_NORM_GRAD}
BATCH_STATS = "TrainingBatchStats"  # written by passes.batch_statistics_native, not by a rule
