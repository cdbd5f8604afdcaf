"""Which nodes of a graph onnxruntime's CUDA execution provider has a kernel for, at their types.

A node the CUDA EP has no kernel for (its op, at the opset the model imports, for its input and
output element types) runs on the CPU: onnxruntime copies its inputs to the host and its
outputs back (Memcpy nodes) on every run, and refuses to capture a CUDA graph. Such nodes are
easy to make by accident (an int64 ``Pad``, a bfloat16 ``ReduceMean``), and nothing fails: the
step is just slow. :func:`cpu_nodes` finds them without a GPU, from :data:`CUDA_KERNELS`.

:data:`CUDA_KERNELS` is onnxruntime's own table of the CUDA EP's kernels (domain ``ai.onnx``,
opset ranges reaching 11 and later; :data:`CUDA_CONTRIB_KERNELS` its ``com.microsoft`` ops, the
contrib ops of onnxruntime-genai's graphs among them), condensed from ``docs/OperatorKernels.md`` of
microsoft/onnxruntime (the file generated from the registered kernels by
``tools/python/gen_opkernel_doc.py``; read at commit 001d12d2623fd411ce0f83d05abb5e82304a3389,
the 1.2x line; the kernels the supported releases 1.17-1.31 register at these types are the
same for every op used by a training step: kernels are added over releases, not removed).
One line per op and opset range: ``Op first[-last|+] CONSTRAINT=types ...``. Types use short
names (:data:`TYPE_NAMES`) and groups (:data:`TYPE_GROUPS`); a constraint written ``*`` takes
any type (sequences and optional values, which this check does not look into). Which
constraint each input and output of an op takes comes from the op's schema: onnx's for
``ai.onnx``, onnxruntime's own (``get_all_operator_schema``) for ``com.microsoft``.

:func:`host_tables` finds the other per-run host work the CUDA EP does: a ``Concat`` (or
``Split``) whose pieces differ in size along the axis fills a table with one int64 per element
of that axis on the host and uploads it on every run (``onnxruntime/core/providers/cuda/tensor/
concat.cc``: ``axis_dimension_input_output_mapping``; onnxruntime PR #32119 passes it by value
for at most 32 pieces).
"""

from __future__ import annotations

import functools
from collections.abc import Iterable, Mapping
from dataclasses import dataclass

import numpy as np
import onnx
from onnx import ModelProto, TensorProto

CUDA = "CUDAExecutionProvider"
PROVIDERS = (CUDA,)
"""The execution providers whose kernel tables this module holds."""
MS = "com.microsoft"

TYPE_NAMES: dict[str, int] = {
    "b": TensorProto.BOOL, "bf16": TensorProto.BFLOAT16, "f16": TensorProto.FLOAT16, "f32": TensorProto.FLOAT,
    "f64": TensorProto.DOUBLE, "i8": TensorProto.INT8, "i16": TensorProto.INT16, "i32": TensorProto.INT32,
    "i64": TensorProto.INT64, "u8": TensorProto.UINT8, "u16": TensorProto.UINT16, "u32": TensorProto.UINT32,
    "u64": TensorProto.UINT64, "s": TensorProto.STRING, "f8e4m3fn": TensorProto.FLOAT8E4M3FN,
    "f8e4m3fnuz": TensorProto.FLOAT8E4M3FNUZ, "f8e5m2": TensorProto.FLOAT8E5M2,
    "f8e5m2fnuz": TensorProto.FLOAT8E5M2FNUZ, "i4": TensorProto.INT4, "u4": TensorProto.UINT4,
}
"""Short type names of :data:`CUDA_KERNELS` -> onnx element types."""

TYPE_GROUPS: dict[str, str] = {
    "all": "b bf16 f16 f32 f64 i8 i16 i32 i64 u8 u16 u32 u64",  # the fixed-size types, bool included
    "num": "bf16 f16 f32 f64 i8 i16 i32 i64 u8 u16 u32 u64",  # the same without bool
    "flt": "f16 f32 f64",
    "bflt": "bf16 f16 f32 f64",
    "f8": "f8e4m3fn f8e4m3fnuz f8e5m2 f8e5m2fnuz",
}
"""Type groups of :data:`CUDA_KERNELS` (a group name stands for its types)."""

CUDA_KERNELS = """
Abs 13+ T=num
Abs 6-12 T=flt,i8,i16,i32,i64,u8,u16,u32,u64
Add 14+ T=num
Add 13 T=bflt,i32,i64,u32,u64
Add 7-12 T=flt,i32,i64,u32,u64
And 7+ T=b T1=b
ArgMax 1+ T=flt
ArgMin 1+ T=flt
Attention 23+ T1=bf16,f16,f32 T2=bf16,f16,f32 U=bf16,b,f16,f32
AveragePool 22+ T=bflt
AveragePool 11-21 T=flt
BatchNormalization 15+ T=flt T1=flt T2=flt
BatchNormalization 14 T=flt U=flt
BatchNormalization 9-13 T=flt
Cast 19+ T1=all,f8 T2=all,f8
Cast 13-18 T1=all T2=all
Cast 9-12 T1=b,flt,i8,i16,i32,i64,u8,u16,u32,u64 T2=all
Ceil 6+ T=flt
Clip 12+ T=flt,i8,i64,u8,u64
Clip 11 T=f32
Compress 9+ T=all T1=b
Concat 4+ T=all
ConcatFromSequence 11+ S=*
ConstantOfShape 9+ T1=i64 T2=all
Conv 22+ T=bflt
Conv 11-21 T=flt
ConvTranspose 11+ T=flt
Cos 7+ T=flt
CumSum 14+ T=flt,i32,i64,u32,u64 T2=i32,i64
CumSum 11-13 T=f32,f64,i32,i64,u32,u64 T2=i32,i64
DepthToSpace 1+ T=flt
DequantizeLinear 21+ T1=f8e4m3fn,f8e5m2,i4,i8,u4,u8 T2=f16,f32
DequantizeLinear 19-20 T1=f8e4m3fn,f8e5m2,i8,u8 T2=f16,f32
DequantizeLinear 10-18 T=i8,u8
Div 14+ T=num
Div 13 T=bflt,i32,i64,u32,u64
Div 7-12 T=flt,i32,i64,u32,u64
Dropout 13+ T=bflt T1=bflt T2=b
Dropout 12 T=flt T1=flt T2=b
Dropout 10-11 T=flt T1=b
Einsum 12+ T=flt
Elu 6+ T=flt
Equal 11+ T=b,flt,i32,i64,u32,u64 T1=b
Erf 13+ T=bflt
Erf 9-12 T=flt
Exp 13+ T=bflt
Exp 6-12 T=flt
Expand 8+ T=all
EyeLike 9+ T1=f32,f64,i32,i64,u64 T2=f32,f64,i32,i64,u64
Flatten 1+ T=all
Floor 6+ T=flt
GRU 7+ T=flt T1=i32
Gather 1+ T=all Tind=i32,i64
GatherElements 11+ T=all Tind=i32,i64
GatherND 13+ T=bf16,b,flt,i64
GatherND 11-12 T=b,flt,i64
Gelu 20+ T=bflt
Gemm 13+ T=bflt
Gemm 7-12 T=flt
GlobalAveragePool 1+ T=flt
GlobalMaxPool 1+ T=flt
Greater 13+ T=flt,i32,i64,u32,u64 T1=b
Greater 9-12 T=flt,i32,i64,u32,u64
GreaterOrEqual 12+ T=flt,i32,i64,u32,u64 T1=b
GridSample 16+ T1=f32 T2=f32
HardSigmoid 22+ T=bflt
HardSigmoid 6-21 T=flt
HardSwish 22+ T=bflt
HardSwish 14-21 T=flt
Identity 14+ V=*
Identity 1-13 T=all
If 11+ B=b V=*
InstanceNormalization 6+ T=flt
IsInf 20+ T1=bflt,f8 T2=b
IsInf 10-19 T1=f32,f64 T2=b
IsNaN 20+ T1=bflt,f8 T2=b
IsNaN 13-19 T1=bflt T2=b
IsNaN 9-12 T1=flt T2=b
LRN 1+ T=flt
LSTM 7+ T=flt T1=i32
LayerNormalization 17+ T=bflt U=f32
LayerNormalization 1-16 T=bflt U=f32,f64 V=bflt
LeakyRelu 6+ T=flt
Less 13+ T=flt,i32,i64,u32,u64 T1=b
Less 9-12 T=flt,i32,i64,u32,u64
LessOrEqual 12+ T=flt,i32,i64,u32,u64 T1=b
Log 6+ T=flt
LogSoftmax 1+ T=flt
Loop 11+ B=b I=i64 V=*
MatMul 13+ T=bflt
MatMul 1-12 T=flt
MatMulInteger 10+ T1=i8 T2=i8 T3=i32
Max 12+ T=bflt,i32,i64,u32,u64
Max 6-11 T=bflt
MaxPool 12+ I=i64 T=flt,i8,u8
MaxPool 8-11 I=i64 T=flt
Min 12+ T=bflt,i32,i64,u32,u64
Min 6-11 T=bflt
Mod 13+ T=bflt,i32,i64,u32,u64
Mod 10-12 T=flt,i32,i64,u32,u64
Mul 14+ T=num
Mul 13 T=bflt,i32,i64,u32,u64
Mul 7-12 T=flt,i32,i64,u32,u64
Neg 13+ T=bflt,i8,i16,i32,i64
Neg 6-12 T=flt,i8,i16,i32,i64
NonZero 9+ T=b,f16,f32,i32,i64,u8
Not 1+ T=b
OneHot 11+ T1=i32,i64 T2=i32,i64 T3=f16,f32,i64
Or 7+ T=b T1=b
PRelu 7+ T=flt
Pad 13+ T=b,flt
Pad 2-12 T=flt
Pow 15+ T=bflt,i32,i64 T1=bflt,i32,i64
Pow 13-14 T=bflt,i32,i64 T1=flt,i32,i64
Pow 12 T=flt,i32,i64 T1=flt,i32,i64
Pow 7-11 T=flt
QuantizeLinear 21+ T1=f16,f32 T2=f8e4m3fn,f8e5m2,i4,i8,u4,u8
QuantizeLinear 19-20 T1=f16,f32 T2=f8e4m3fn,f8e5m2,i8,u8
QuantizeLinear 10-18 T1=f32 T2=i8,u8
RMSNormalization 23+ T=bflt V=bflt
RNN 7+ T=flt T1=i32
RandomNormal 1+ T=flt
RandomNormalLike 1+ T1=all,s T2=flt
RandomUniform 1+ T=flt
RandomUniformLike 1+ T1=all,s T2=flt
Range 11+ T=f32,f64,i16,i32,i64
Reciprocal 6+ T=flt
ReduceL1 1+ T=flt,i32
ReduceL2 1+ T=flt,i32
ReduceLogSum 1+ T=flt
ReduceLogSumExp 1+ T=flt
ReduceMax 1+ T=flt,i32,i64
ReduceMean 1+ T=flt,i32
ReduceMin 1+ T=flt,i8,i32,i64,u8
ReduceProd 1+ T=flt,i32
ReduceSum 13+ T=bflt,i32,i64
ReduceSum 1-12 T=flt,i32,i64
ReduceSumSquare 1+ T=flt
Relu 13+ T=bflt
Relu 6-12 T=flt
Reshape 19+ T=all,f8
Reshape 5-18 T=all
Resize 11+ T1=flt,i32,u8
ReverseSequence 10+ T=all
RoiAlign 10+ T1=f32,f64 T2=i64
RotaryEmbedding 23+ M=i64 T=bf16,f16,f32
Round 11+ T=flt
Scan 9+ V=all
ScatterElements 11+ T=all Tind=i32,i64
ScatterND 11+ T=all
Selu 6+ T=flt
SequenceAt 11+ S=* I=i32,i64 T=all
SequenceConstruct 11+ S=* T=all
SequenceEmpty 11+ S=*
SequenceErase 11+ S=* I=i32,i64
SequenceInsert 11+ S=* I=i32,i64
SequenceLength 11+ S=* I=i64
Shape 19+ T=all,f8 T1=i64
Shape 1-18 T=all T1=i64
Shrink 9+ T=flt,i8,i16,i32,i64,u8,u16,u32,u64
Sigmoid 13+ T=bflt
Sigmoid 6-12 T=flt
Sign 13+ T=num
SimplifiedLayerNormalization 1+ T=bflt U=f32,f64 V=bflt
Sin 7+ T=flt
Size 1+ T=all,s T1=i64
Slice 10+ T=all Tind=i32,i64
Softmax 13+ T=bflt
Softmax 1-12 T=flt
Softplus 1+ T=flt
Softsign 1+ T=flt
SpaceToDepth 1+ T=flt
Split 2+ T=all
Sqrt 13+ T=bflt
Sqrt 6-12 T=flt
Squeeze 1+ T=all
Sub 14+ T=num
Sub 13 T=bflt,i32,i64,u32,u64
Sub 7-12 T=flt,i32,i64,u32,u64
Sum 6+ T=bflt
Tanh 13+ T=bflt
Tanh 6-12 T=flt
TensorScatter 24+ T=all
ThresholdedRelu 1+ T=flt
Tile 13+ T=bflt,i32,i64 T1=i64
Tile 6-12 T=flt,i32,i64 T1=i64
TopK 1+ I=i64 T=flt,i32,i64
Transpose 1+ T=all
Trilu 14+ T=all
Unsqueeze 1+ T=all
Where 16+ B=b T=bflt,i32,i64,u8
Where 9-15 B=b T=flt,i32,i64,u8
Xor 7+ T=b T1=b
"""
"""The CUDA execution provider's kernels (see the module docstring for the source and format)."""

CUDA_CONTRIB_KERNELS = """
Attention 1+ T=bf16,f16,f32
BeamSearch 1+ T=f16,f32
BiasAdd 1+ T=f16,f32
BiasDropout 1+ T=bflt T1=bflt T2=b
BiasGelu 1+ T=bflt
BiasSoftmax 1+ T=flt
BiasSplitGelu 1+ T=f16,f32
BitmaskBiasDropout 1+ T=bflt T1=bflt T2=b T3=u32
BitmaskDropout 1+ T=bflt T1=bflt T2=b T3=u32
ComplexMul 1+ T=f16,f32
ComplexMulConj 1+ T=f16,f32
ConvTransposeWithDynamicPads 1+ T=f32
DecoderAttention 1+ T=f16,f32
DecoderMaskedMultiHeadAttention 1+ QK=f16,f32 T=f16,f32
DecoderMaskedSelfAttention 1+ T=f16,f32
DequantizeLinear 1+ T1=i8,u8 T2=f16
DequantizeWithOrder 1+ F=f16,f32 Q=i8 S=f32
DynamicTimeWarping 1+ F=f32 I=i32
EmbedLayerNormalization 1+ T=f16,f32
FastGelu 1+ T=bflt
FusedConv 1+ T=f32
FusedMatMul 1+ T=bflt
GatedRelativePositionBias 1+ T=f16,f32
GatherBlockQuantized 1+ T1=i4,u4,u8 T2=bf16,f16,f32 Tind=i32,i64
Gelu 1+ T=bflt
GemmFloat8 1+ TA=bf16,f16,f32,f8e4m3fn,f8e5m2 TB=bf16,f16,f32,f8e4m3fn,f8e5m2 TR=bf16,f16,f32,f8e4m3fn,f8e5m2 TS=f32
GemmaRotaryEmbedding 1+ T=f16 U=f32
GreedySearch 1+ T=f16,f32
GridSample 1+ T1=f32 T2=f32
GroupNorm 1+ T=f16,f32
GroupQueryAttention 1+ M=i32 T=bf16,f16 T_CACHE=bf16,f16,f8e4m3fn,i8 T_KV_SCALE=f32
Inverse 1+ T=flt
Irfft 1+ T=flt
LongformerAttention 1+ T=f16,f32
MatMulBnb4 1+ T1=bf16,f16,f32 T2=u8
MatMulNBits 1+ T1=bf16,f16,f32 T2=u8 T3=bf16,f16,f32,u8
MoE 1+ T=bf16,f16,f32
MultiHeadAttention 1+ QK=bf16,f16,f32 T=bf16,f16,f32
NGramRepeatBlock 1+ T=f32 Tid=i64
NhwcConv 1+ T=f16,f32
PackedAttention 1+ T=f16,f32
PackedMultiHeadAttention 1+ T=f16,f32
PagedAttention 1+ S=i32 T=bf16,f16
QAttention 1+ T1=i8 T2=i8 T3=f16,f32 T4=i32
QMoE 1+ T=bf16,f16 T1=u8 T2=bf16,f16
QOrderedAttention 1+ G=i32 Q=i8 S=f32
QOrderedGelu 1+ Q=i8 S=f32
QOrderedLayerNormalization 1+ F=f16,f32 Q=i8 S=f32
QOrderedLongformerAttention 1+ F=f16 G=i32 Q=i8 S=f32
QOrderedMatMul 1+ Q=i8 S=f32
QuantizeLinear 1+ T1=f16 T2=i8,u8
QuantizeWithOrder 1+ F=f16,f32 Q=i8 S=f32
QuickGelu 1+ T=bflt
RelativePositionBias 1+ T=f16,f32
RemovePadding 1+ T=f16,f32
RestorePadding 1+ T=f16,f32
Rfft 1+ T=flt
RotaryEmbedding 1+ M=i64 T=bf16,f16,f32
Sampling 1+ T=f16,f32
SkipGroupNorm 1+ T=f16,f32
SkipLayerNormalization 1+ T=bf16,f16,f32
SkipSimplifiedLayerNormalization 1+ T=bf16,f16,f32
SparseAttention 1+ M=i32 T=bf16,f16
TransposeMatMul 1+ T=bflt
Trilu 1+ T=all
UnfoldTensor 1+ T=all,s
WhisperBeamSearch 1+ T=f16,f32
"""
"""The CUDA execution provider's ``com.microsoft`` kernels (same source and format)."""


@dataclass(frozen=True)
class Kernel:
    """One registration: the opset range and the types each constraint takes (None: any)."""

    first: int
    last: int | None
    types: Mapping[str, frozenset[int] | None]


def _types(text: str) -> frozenset[int] | None:
    if text == "*":
        return None
    names: list[str] = []
    for part in text.split(","):
        names += TYPE_GROUPS[part].split() if part in TYPE_GROUPS else [part]
    return frozenset(TYPE_NAMES[n] for n in names)


_TEXTS = {(CUDA, ""): CUDA_KERNELS, (CUDA, MS): CUDA_CONTRIB_KERNELS}


@functools.cache
def table(provider: str = CUDA, domain: str = "") -> dict[str, tuple[Kernel, ...]]:
    """The parsed kernel table of ``provider`` (only the CUDA EP's is held) for ``domain``
    (``""``: ai.onnx, or ``"com.microsoft"``): op -> its kernels."""
    if provider not in PROVIDERS:
        raise KeyError(f"no kernel table for {provider!r}; known: {', '.join(PROVIDERS)}")
    kernels: dict[str, list[Kernel]] = {}
    for line in _TEXTS.get((provider, "" if domain == "ai.onnx" else domain), "").strip().splitlines():
        op, versions, *constraints = line.split()
        first, _, rest = versions.partition("-")
        last: int | None
        if versions.endswith("+"):
            since, last = int(versions[:-1]), None
        else:
            since, last = int(first), int(rest or first)
        types = {c.partition("=")[0]: _types(c.partition("=")[2]) for c in constraints}
        kernels.setdefault(op, []).append(Kernel(since, last, types))
    return {op: tuple(k) for op, k in kernels.items()}


def kernel_for(op_type: str, since_version: int, provider: str = CUDA, domain: str = "") -> Kernel | None:
    """The registration of ``op_type`` whose opset range holds the schema version ``since_version``."""
    for kernel in table(provider, domain).get(op_type, ()):
        if kernel.first <= since_version and (kernel.last is None or since_version <= kernel.last):
            return kernel
    return None


@dataclass(frozen=True)
class Placement:
    """A node the provider has no kernel for, and why."""

    node: str
    op_type: str
    reason: str

    def __str__(self) -> str:
        return f"{self.op_type} {self.node!r}: {self.reason}"


_SKIPPED = {"Constant"}  # onnxruntime makes Constant nodes initializers: they run nowhere
INLINED = {"CastLike": "Cast"}
"""Function ops that onnxruntime's CPU EP has no kernel for either: onnxruntime inlines their
body, whose op (at the same constraint names) is then placed."""


def _element_types(model: ModelProto) -> dict[str, int]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:  # a graph shape inference refuses: use the types the model states
        inferred = model
    g = inferred.graph
    types = {t.name: t.data_type for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        if vi.type.HasField("tensor_type") and vi.type.tensor_type.elem_type:
            types.setdefault(vi.name, vi.type.tensor_type.elem_type)
    versions = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    for node in g.node:
        if node.op_type == "Constant" and node.attribute and node.attribute[0].name == "value":
            types.setdefault(node.output[0], node.attribute[0].t.data_type)
        elif any(o and o not in types for o in node.output):  # after an op onnx's inference does not know
            _propagate(node, versions.get("" if node.domain == "ai.onnx" else node.domain, 1), types)
    return types


def _propagate(node: onnx.NodeProto, version: int, types: dict[str, int]) -> None:
    """The element types of ``node``'s outputs from its inputs' (by the type constraints they
    share in its schema), for an op onnx's shape inference does not know."""
    if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
        to = next((a.i for a in node.attribute if a.name == "to"), 0)
        if to:
            types.setdefault(node.output[0], to)
        return
    schema = signature(node.op_type, version, node.domain)
    if schema is None:
        return
    bound: dict[str, int] = {}
    for (_, type_str, _), name in zip(schema.inputs, node.input):
        if name in types:
            bound.setdefault(type_str, types[name])
    for (_, type_str, _), name in zip(schema.outputs, node.output):
        found = bound.get(type_str) or _FIXED.get(type_str)
        if name and found:
            types.setdefault(name, found)


_FIXED = {f"tensor({TensorProto.DataType.Name(t).lower()})": t for t in TYPE_NAMES.values()}  # fixed-type params


def _name(element_type: int) -> str:
    return TensorProto.DataType.Name(element_type).lower()


@dataclass(frozen=True)
class Signature:
    """An op's schema as the check reads it: its version, and each input's and output's name,
    type constraint (or fixed type) and whether it is variadic."""

    since_version: int
    inputs: tuple[tuple[str, str, bool], ...]
    outputs: tuple[tuple[str, str, bool], ...]


def _params(params, variadic) -> tuple[tuple[str, str, bool], ...]:
    return tuple((p.name, str(getattr(p, "type_str", None) or getattr(p, "typeStr", "")), p.option == variadic)
                 for p in params)


@functools.cache
def _onnxruntime_schemas() -> dict[tuple[str, str], tuple[Signature, ...]]:
    """onnxruntime's own schemas (``com.microsoft``...) by (domain, op), oldest first; empty
    where the build does not expose them."""
    try:
        from onnxruntime.capi import onnxruntime_pybind11_state as ort_c
        schemas = ort_c.get_all_operator_schema()
    except Exception:  # noqa: BLE001 - a minimal build: the contrib ops' types are not checked
        return {}
    found: dict[tuple[str, str], list[Signature]] = {}
    for schema in schemas:
        if schema.domain in ("", "ai.onnx"):
            continue
        variadic = type(schema.inputs[0].option).Variadic if schema.inputs else None
        found.setdefault((schema.domain, schema.name), []).append(
            Signature(schema.since_version, _params(schema.inputs, variadic), _params(schema.outputs, variadic)))
    return {k: tuple(sorted(v, key=lambda s: s.since_version)) for k, v in found.items()}


def signature(op_type: str, version: int, domain: str = "") -> Signature | None:
    """The schema of ``op_type`` at opset ``version`` of ``domain`` (onnx's for ai.onnx,
    onnxruntime's for its own domains), or None where it is unknown."""
    if domain in ("", "ai.onnx"):
        try:
            schema = onnx.defs.get_schema(op_type, version, "")
        except onnx.defs.SchemaError:
            return None
        variadic = onnx.defs.OpSchema.FormalParameterOption.Variadic
        return Signature(schema.since_version, _params(schema.inputs, variadic), _params(schema.outputs, variadic))
    known = [s for s in _onnxruntime_schemas().get((domain, op_type), ()) if s.since_version <= version]
    return known[-1] if known else None


def _check_node(node: onnx.NodeProto, version: int, types: Mapping[str, int], provider: str) -> str | None:
    """Why ``provider`` has no kernel for ``node`` at opset ``version`` of its domain (None: it has one)."""
    domain = "" if node.domain == "ai.onnx" else node.domain
    schema = signature(node.op_type, version, domain)
    op = INLINED.get(node.op_type, node.op_type) if not domain else node.op_type
    placed = schema if op == node.op_type else signature(op, version, domain)
    since = placed.since_version if placed is not None else version
    kernel = kernel_for(op, since, provider, domain)
    if kernel is None:
        known = sorted(f"{k.first}{'+' if k.last is None else f'-{k.last}'}"
                       for k in table(provider, domain).get(op, ()))
        where = f" (kernels for opsets {', '.join(known)})" if known else ""
        return f"no {provider} kernel for {node.op_type} at opset {since}{where}"
    if schema is None:
        return None
    for params, names in ((schema.inputs, list(node.input)), (schema.outputs, list(node.output))):
        for index, (param, type_str, variadic) in enumerate(params):
            allowed = kernel.types.get(type_str, ...)
            if allowed is ... or allowed is None:
                continue  # a fixed type (the schema's), or any
            for name in (names[index:] if variadic else names[index:index + 1]):
                found = types.get(name)
                if name and found and found not in allowed:
                    return (f"no {provider} kernel for {node.op_type} with {param} of type {_name(found)} "
                            f"({type_str} takes {', '.join(sorted(_name(t) for t in allowed))})")
    return None


def cpu_nodes(model: ModelProto, provider: str = CUDA) -> list[Placement]:
    """The main-graph nodes of ``model`` that ``provider`` has no kernel for, at the model's
    opsets and the nodes' element types: onnxruntime runs them on the CPU. Nodes of a domain
    the table does not hold (other than ``ai.onnx`` and ``com.microsoft``) are listed too.

    Args:
        model: a model onnxruntime would run (prepared: no training-domain node).
        provider: the execution provider (only ``CUDAExecutionProvider``'s table is held).

    Returns:
        One :class:`Placement` per such node, in graph order.
    """
    versions = {("" if o.domain == "ai.onnx" else o.domain): o.version for o in model.opset_import}
    types = _element_types(model)
    found = []
    for node in model.graph.node:
        domain = "" if node.domain == "ai.onnx" else node.domain
        if node.op_type in _SKIPPED and not domain:
            continue
        if (provider, domain) not in _TEXTS:
            found.append(Placement(node.name, node.op_type, f"domain {node.domain!r}: no {provider} kernel known"))
            continue
        reason = _check_node(node, versions.get(domain, 1), types, provider)
        if reason:
            found.append(Placement(node.name, node.op_type, reason))
    return found


@dataclass(frozen=True)
class HostTable:
    """A Concat or Split whose pieces differ in size along its axis: what the CUDA EP uploads per run."""

    node: str
    op_type: str
    pieces: int
    axis_length: int

    @property
    def bytes(self) -> int:
        """The int64 table of one entry per element of the axis, plus the per-piece sizes,
        offsets and pointers (three int64 arrays as long as the pieces)."""
        return 8 * (self.axis_length + 3 * self.pieces)


def _shapes(model: ModelProto) -> dict[str, tuple[int, ...]]:
    try:
        inferred = onnx.shape_inference.infer_shapes(model, strict_mode=False)
    except Exception:
        inferred = model
    g = inferred.graph
    shapes = {t.name: tuple(t.dims) for t in g.initializer}
    for vi in (*g.input, *g.value_info, *g.output):
        dims = vi.type.tensor_type.shape.dim
        if vi.type.tensor_type.HasField("shape") and all(d.HasField("dim_value") for d in dims):
            shapes.setdefault(vi.name, tuple(d.dim_value for d in dims))
    return shapes


def host_tables(model: ModelProto, above: int = 0) -> list[HostTable]:
    """The Concat and Split nodes of the main graph whose pieces differ in size along the axis
    (static shapes only), with more than ``above`` pieces: the CUDA EP fills and uploads an int64
    table as long as that axis on every run (at most 32 pieces: by value with onnxruntime PR #32119)."""
    shapes = _shapes(model)
    found = []
    for node in model.graph.node:
        if node.op_type not in ("Concat", "Split") or node.domain not in ("", "ai.onnx"):
            continue
        pieces = [n for n in (node.input if node.op_type == "Concat" else node.output) if n]
        dims = [shape for p in pieces if (shape := shapes.get(p)) is not None]
        if len(pieces) <= above or len(dims) != len(pieces):
            continue
        axis = next((a.i for a in node.attribute if a.name == "axis"), 0)
        rank = len(dims[0])
        axis = axis + rank if axis < 0 else axis
        lengths = [d[axis] for d in dims]
        if len(set(lengths)) > 1:
            found.append(HostTable(node.name, node.op_type, len(pieces), int(np.sum(lengths))))
    return found


def summary(placements: Iterable[Placement]) -> str:
    """One line per op and reason, with how many nodes."""
    counts: dict[str, int] = {}
    for p in placements:
        counts[f"{p.op_type}: {p.reason}"] = counts.get(f"{p.op_type}: {p.reason}", 0) + 1
    return "\n".join(f"{n} x {text}" for text, n in sorted(counts.items()))
