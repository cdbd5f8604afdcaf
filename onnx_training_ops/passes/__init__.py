"""Graph rewrites: named passes (one per module) and the pipelines that chain them.

Each pass takes a ModelProto and returns it rewritten (pure ONNX in, ONNX out; nothing here
talks to onnxruntime beyond reading its supported versions). :data:`PASSES` targets the PyOp
kernels, :data:`NATIVE_PASSES` the native ones, :data:`PORTABLE_PASSES` plain onnxruntime
(:data:`FLAT_PORTABLE_PASSES` the same for a GPU: one optimizer chain over all parameters);
:func:`onnx_training_ops.prepare` (``runtime/pipeline.py``) picks one and runs it on a copy.

May import: errors, schema, walk, storage, optim (the optimizers' lowerings), kernels, autodiff.
"""

from __future__ import annotations

from collections.abc import Callable

from onnx import ModelProto

from .batch_statistics_native import batch_statistics_native
from .conv_forward_gemm import conv_forward_gemm
from .encode_exact_attributes import encode_exact_attributes
from .expand_gradient import expand_gradient, expand_gradient_gpu, expand_gradient_native
from .fill_defaults import fill_default_attributes
from .fit_runtime import fit_runtime
from .flatten_optimizers import flatten_optimizers
from .fuse_gelu import fuse_gelu
from .lower_cross_entropy import lower_cross_entropy
from .lower_cross_entropy_native import lower_cross_entropy_native
from .lower_group_query_attention import lower_group_query_attention
from .lower_optimizers import lower_optimizers
from .lower_recurrent import lower_recurrent
from .split_multi_tensor import split_multi_tensor_nodes
from .split_sequences import split_sequences
from .target_native import target_native
from .validate import validate

Pass = Callable[[ModelProto], ModelProto]

# The PyOp kernels: multi-tensor optimizer nodes split per tensor, float attributes encoded
# exactly (PyOp reads them as 6-digit text).
PASSES: list[tuple[str, Pass]] = [
    ("validate", validate),
    ("split_sequences", split_sequences),
    ("lower_recurrent", lower_recurrent),
    ("fuse_gelu", fuse_gelu),
    ("expand_gradient", expand_gradient),
    ("lower_cross_entropy", lower_cross_entropy),
    ("fill_default_attributes", fill_default_attributes),
    ("split_multi_tensor_nodes", split_multi_tensor_nodes),
    ("encode_exact_attributes", encode_exact_attributes),
    ("fit_runtime", fit_runtime),
]
"""The (name, pass) pipeline :func:`~onnx_training_ops.prepare` runs for the PyOp kernels, in order.

Each pass takes a ModelProto and returns a new one. The native kernels' pipeline
(``NATIVE_PASSES``) and the portable form's (``PORTABLE_PASSES``) share its first passes;
what each pass does: [Kernel paths](../kernels.md#prepare-passes).
"""
# The native kernels take multi-tensor nodes whole and read the attributes themselves; the
# Gradient is expanded with the native backward kernels where a rule has one, the cross
# entropy lowered to its native loss kernel, a forward Conv reuses its native im2col columns,
# and train-mode BatchNorm statistics are one native node.
NATIVE_PASSES: list[tuple[str, Pass]] = [
    ("validate", validate),
    ("split_sequences", split_sequences),
    ("lower_recurrent", lower_recurrent),
    ("fuse_gelu", fuse_gelu),
    ("expand_gradient", expand_gradient_native),
    ("lower_cross_entropy", lower_cross_entropy_native),
    ("fill_default_attributes", fill_default_attributes),
    ("conv_forward_gemm", conv_forward_gemm),
    ("batch_statistics_native", batch_statistics_native),
    ("target_native", target_native),
    ("fit_runtime", fit_runtime),
]
# The portable form: standard ONNX ops only (no com.microsoft Gelu, every optimizer node
# lowered; no plugin needed).
PORTABLE_PASSES: list[tuple[str, Pass]] = [
    ("validate", validate),
    ("split_sequences", split_sequences),
    ("lower_recurrent", lower_recurrent),
    ("expand_gradient", expand_gradient),
    ("lower_cross_entropy", lower_cross_entropy),
    ("fill_default_attributes", fill_default_attributes),
    ("lower_optimizers", lower_optimizers),
    ("fit_runtime", fit_runtime),
]
# The portable form for a GPU (CUDA, WebGPU): each multi-tensor optimizer node runs over its
# tensors laid end to end, one chain of elementwise kernels for all parameters. On a CPU the
# copies in and out cost more than the per-tensor chains (BERT 4L/256: 1.26x the step).
_LOWERING = [name for name, _ in PORTABLE_PASSES].index("lower_optimizers")
FLAT_PORTABLE_PASSES: list[tuple[str, Pass]] = [
    *PORTABLE_PASSES[:_LOWERING], ("flatten_optimizers", flatten_optimizers), *PORTABLE_PASSES[_LOWERING:],
]  # the portable pipeline with flatten_optimizers right before the lowering
# A CUDA device's: the flat form, convolution gradients as Conv/ConvTranspose (cuDNN) where the
# CPU's pipelines write im2col Gemms (hundreds of Pad/Slice nodes for a ResNet), and float32
# GroupQueryAttention (no CUDA kernel: float16/bfloat16 only) in standard ops before the Gradient
# is expanded.
GPU_PASSES: list[tuple[str, Pass]] = [
    step for name, run in FLAT_PORTABLE_PASSES
    for step in ([("lower_group_query_attention", lower_group_query_attention), ("expand_gradient",
                                                                                 expand_gradient_gpu)]
                 if name == "expand_gradient" else [(name, run)])]
