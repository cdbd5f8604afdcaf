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
RELU_GRAD = "TrainingReluGrad"
CROSS_ENTROPY_LOSS = "TrainingCrossEntropyLoss"  # emitted by passes.lower_cross_entropy_native
CROSS_ENTROPY_GRAD = "TrainingCrossEntropyGrad"
BATCH_NORM_GRAD = "TrainingBatchNormGrad"  # kernels._native_norm_kernels
BATCH_STATS = "TrainingBatchStats"  # written by passes.batch_statistics_native, not by a rule
DEQUANTIZE_ROWS = "TrainingDequantizeRows"  # kernels._native_dequant_kernels
INT8_BLOCKS = "TrainingInt8Blocks"  # the same; written by passes.dequantize_matmul_nbits, not by a rule
ALL = frozenset({IM2COL, COL2IM, RELU_GRAD, CROSS_ENTROPY_LOSS, CROSS_ENTROPY_GRAD, BATCH_NORM_GRAD, DEQUANTIZE_ROWS})
# not an op: asks the Conv rule for onnxruntime's Conv/ConvTranspose forms of the input and weight
# gradients (cuDNN on a GPU) instead of the im2col Gemms tuned for the CPU
CONV_BY_CONV = "conv_by_conv"
# not an op: asks the MatMulNBits rule for row ranges sized for a GPU's memory (DEQUANTIZED_BYTES_GPU)
# instead of a CPU's cache: measured on an H200 (TinyLlama's int4 LoRA step, 3 rounds), 4 MB ranges
# took 0.95x torch's step time, 32 MB ranges 0.67x (every range is a few more kernels)
GPU_RANGES = "gpu_ranges"
COLS_OF = "cols of Conv node "  # doc_string of an Im2Col a Conv's rule emits, + the Conv's name
