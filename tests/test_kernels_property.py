"""Property tests of the optimizers (Adam, Momentum standard/nesterov, Adagrad) against independent oracles.

Four checks, each over float32/float64, T == 0 and T > 0, 1..4 tensors per node with
per-tensor shapes from () to rank 4, numpy broadcasting of G/V/H to X's shape, R of
shape [] or [1] in either float dtype, and drawn attribute values:

1. the reference kernels (``onnx_training_ops.kernels``) vs ``onnx.reference.ReferenceEvaluator``
   running the same single node (ONNX's own implementation). Its quirks, allowed for there:
   multi-tensor Adam casts outputs to float32 (we compare values at float32 precision and
   assert that our outputs keep the input dtype); it holds float attributes as np.float32
   scalars, so ``1 - alpha`` etc. are computed in float32 even for float64 tensors (its
   V_new can be off by ~2.5e-8 relative, e.g. alpha=0.1); R of shape [1] turns a scalar X
   into shape (1,);
2. the reference kernels vs a float64 transcription of the spec's pseudo code written
   here, straight from the schema doc strings;
3. the plugin path (a single-node model through ``onnx_training_ops.InferenceSession``)
   vs the reference kernels;
4. attribute exactness: many-digit attributes give the result of their exact float32
   value, bit for bit (the PyOp bridge alone would hand Python 6-digit text);

plus an acceptance test: one 3-tensor Adam node at onnx's default IR version through
the session vs the pseudo code in float64.

Tolerance. Differences between two correct implementations come only from rounding,
and X_new = X - step can cancel to ~0, so a plain relative tolerance on X_new would be
meaningless. The transcription therefore carries, beside each float64 value, a
rigorous bound ``err`` of the rounding error that evaluating the pseudo code in the
tensors' dtype can make (tensor math in the dtype, scalar math such as the bias
correction in float64; first-order terms plus the cross terms, underflow included).
Two implementations agree when ``|a - b| <= 2 * err + rtol * |b|`` with rtol 1e-6 for
float32 and 1e-12 for float64: ``err`` is the "atol scaled to the magnitude" (about a
few ulps of |X| and of |step| where nothing cancels), so a wrong formula, a dropped
term, a wrong attribute value or scalar math done in float32 (e.g. 1 - beta**T) fails.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np
import onnx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays
from model_factory import DOMAIN, INPUT_GROUPS, OUTPUT_GROUPS, layout, single_node_model
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator

import onnx_training_ops
from onnx_training_ops import kernels

F32, F64 = np.dtype(np.float32), np.dtype(np.float64)
RTOL = {F32: 1e-6, F64: 1e-12}
UNIT_ROUNDOFF = {F32: 2.0**-24, F64: 2.0**-53}
TINY = {F32: float(np.finfo(np.float32).smallest_subnormal), F64: float(np.finfo(np.float64).smallest_subnormal)}

# (op_type, Momentum mode or None): the four optimizer variants.
VARIANTS = [("Adam", None), ("Momentum", "standard"), ("Momentum", "nesterov"), ("Adagrad", None)]
VARIANT_IDS = ["adam", "momentum-standard", "momentum-nesterov", "adagrad"]
KERNELS = {"Adam": kernels.adam, "Momentum": kernels.momentum, "Adagrad": kernels.adagrad}

_HEALTH = [HealthCheck.too_slow, HealthCheck.data_too_large]
CHEAP = settings(max_examples=60, deadline=None, suppress_health_check=_HEALTH)  # no model
SESSION = settings(max_examples=30, deadline=None, suppress_health_check=_HEALTH)  # one session per example
EXACT = settings(max_examples=15, deadline=None, suppress_health_check=_HEALTH)


def schema_defaults(op_type: str) -> dict:
    """The schema's attribute defaults, as onnx.defs states them (float32 values, as a model holds them)."""
    schema = onnx.defs.get_schema(op_type, 1, DOMAIN)
    out = {}
    for name, attr in schema.attributes.items():
        if not attr.required:
            value = helper.get_attribute_value(attr.default_value)
            out[name] = value.decode() if isinstance(value, bytes) else value
    return out


# ---------------------------------------------------------------------------------------------
# The pseudo code of the doc strings in float64, with a bound of the rounding error.
# ---------------------------------------------------------------------------------------------


@dataclass
class Tracked:
    """A float64 value (array or scalar) and a bound of the error of computing it in finite precision."""

    v: np.ndarray
    e: np.ndarray = field(default_factory=lambda: np.float64(0.0))


class Arith:
    """Arithmetic on Tracked values; each result is rounded with unit roundoff ``u`` (plus underflow ``tiny``)."""

    def __init__(self, u: float, tiny: float):
        self.u, self.tiny = u, tiny

    def _round(self, v, e) -> Tracked:
        v = np.asarray(v, np.float64)
        e = np.asarray(e, np.float64)
        return Tracked(v, e + self.u * (np.abs(v) + e) + self.tiny)

    def const(self, c) -> Tracked:
        """A Python float meeting the arrays: rounded into their dtype (exact values stay exact)."""
        return self._round(c.v, c.e) if isinstance(c, Tracked) else Tracked(np.float64(c))

    def add(self, a: Tracked, b: Tracked) -> Tracked:
        return self._round(a.v + b.v, a.e + b.e)

    def sub(self, a: Tracked, b: Tracked) -> Tracked:
        return self._round(a.v - b.v, a.e + b.e)

    def mul(self, a: Tracked, b: Tracked) -> Tracked:
        return self._round(a.v * b.v, np.abs(a.v) * b.e + np.abs(b.v) * a.e + a.e * b.e)

    def div(self, a: Tracked, b: Tracked) -> Tracked:
        v = a.v / b.v
        den = np.abs(b.v) - b.e
        with np.errstate(divide="ignore", invalid="ignore"):
            e = np.where(den > 0, (a.e + np.abs(v) * b.e) / np.where(den > 0, den, 1.0), np.inf)
        return self._round(v, e)

    def sqrt(self, a: Tracked) -> Tracked:
        s = np.sqrt(a.v)
        with np.errstate(divide="ignore", invalid="ignore"):
            first_order = np.where(s > 0, a.e / (2 * np.where(s > 0, s, 1.0)), np.inf)
        return self._round(s, np.minimum(first_order, np.sqrt(a.e)))  # |sqrt(a+d) - sqrt(a)| <= sqrt|d|

    def pow(self, base: float, t: int) -> Tracked:
        v = base**t  # libm pow, within 1 ulp
        return Tracked(np.float64(v), np.float64(2 * self.u * abs(v) + self.tiny))


def _ops(dtype):
    dtype = np.dtype(dtype)
    tensor = Arith(UNIT_ROUNDOFF[dtype], TINY[dtype])
    scalar = Arith(UNIT_ROUNDOFF[F64], TINY[F64])  # scalar math (R_adjusted, r) in float64
    return tensor, scalar


def _exact(a) -> Tracked:
    return Tracked(np.asarray(a, np.float64))


def spec_adam(r: float, t: int, x, g, v, h, dtype, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post,
              coefficient_dtype=F64):
    """Adam's pseudo code (one tensor); returns [X_final, V_new, H_new] as Tracked.

    ``coefficient_dtype``: the precision of ``1 - attribute`` (float64 here; float32 in the
    ReferenceEvaluator, which holds attributes as np.float32 scalars).
    """
    A, S = _ops(dtype)
    C = _ops(coefficient_dtype)[0]
    X, G, V, H = map(_exact, (x, g, v, h))
    one = _exact(1.0)
    # G_regularized = norm_coefficient * X + G
    g_reg = A.add(A.mul(_exact(norm_coefficient), X), G)
    # V_new = alpha * V + (1 - alpha) * G_regularized
    v_new = A.add(A.mul(_exact(alpha), V), A.mul(A.const(C.sub(one, _exact(alpha))), g_reg))
    # H_new = beta * H + (1 - beta) * G_regularized * G_regularized
    h_new = A.add(A.mul(_exact(beta), H), A.mul(A.const(C.sub(one, _exact(beta))), A.mul(g_reg, g_reg)))
    # H_sqrt = Sqrt(H_new) + epsilon
    h_sqrt = A.add(A.sqrt(h_new), _exact(epsilon))
    # R_adjusted = T > 0 ? R * Sqrt(1 - beta**T) / (1 - alpha**T) : R
    if t > 0:
        r_adj = S.div(S.mul(_exact(r), S.sqrt(S.sub(one, S.pow(beta, t)))), S.sub(one, S.pow(alpha, t)))
    else:
        r_adj = _exact(r)
    # X_new = X - R_adjusted * V_new / H_sqrt
    x_new = A.sub(X, A.div(A.mul(A.const(r_adj), v_new), h_sqrt))
    # X_final = (1 - norm_coefficient_post) * X_new
    x_final = A.mul(A.const(C.sub(one, _exact(norm_coefficient_post))), x_new)
    return [x_final, v_new, h_new]


def spec_momentum(r: float, t: int, x, g, v, dtype, alpha, beta, mode, norm_coefficient, coefficient_dtype=F64):
    """Momentum's pseudo code, standard or Nesterov (one tensor); returns [X_new, V_new]."""
    A, _ = _ops(dtype)
    X, G, V = map(_exact, (x, g, v))
    # G_regularized = norm_coefficient * X + G
    g_reg = A.add(A.mul(_exact(norm_coefficient), X), G)
    # beta_adjusted = T > 0 ? beta : 1
    beta_adjusted = _exact(beta if t > 0 else 1.0)
    # V_new = alpha * V + beta_adjusted * G_regularized
    v_new = A.add(A.mul(_exact(alpha), V), A.mul(beta_adjusted, g_reg))
    R = A.const(_exact(r))
    if mode == "standard":
        # X_new = X - R * V_new
        x_new = A.sub(X, A.mul(R, v_new))
    else:
        # X_new = X - R * (G_regularized + alpha * V_new)
        x_new = A.sub(X, A.mul(R, A.add(g_reg, A.mul(_exact(alpha), v_new))))
    return [x_new, v_new]


def spec_adagrad(r: float, t: int, x, g, h, dtype, decay_factor, epsilon, norm_coefficient, coefficient_dtype=F64):
    """Adagrad's pseudo code (one tensor); returns [X_new, H_new]."""
    A, S = _ops(dtype)
    X, G, H = map(_exact, (x, g, h))
    # r = R / (1 + T * decay_factor)
    rate = S.div(_exact(r), S.add(_exact(1.0), S.mul(_exact(float(t)), _exact(decay_factor))))
    # G_regularized = norm_coefficient * X + G
    g_reg = A.add(A.mul(_exact(norm_coefficient), X), G)
    # H_new = H + G_regularized * G_regularized
    h_new = A.add(H, A.mul(g_reg, g_reg))
    # H_adaptive = Sqrt(H_new) + epsilon
    h_adaptive = A.add(A.sqrt(h_new), _exact(epsilon))
    # X_new = X - r * G_regularized / H_adaptive
    x_new = A.sub(X, A.div(A.mul(A.const(rate), g_reg), h_adaptive))
    return [x_new, h_new]


SPECS = {"Adam": spec_adam, "Momentum": spec_momentum, "Adagrad": spec_adagrad}


def spec_outputs(case, coefficient_dtype=F64) -> list[Tracked]:
    """The pseudo code applied to each tensor independently; outputs in op order (all X_new, all V_new, ...)."""
    r = float(np.asarray(case.r).reshape(()))
    t = int(np.asarray(case.t).reshape(()))
    per_tensor = [
        SPECS[case.op_type](r, t, *group, case.dtype, **case.full_attributes, coefficient_dtype=coefficient_dtype)
        for group in case.groups
    ]
    return [out for outs in zip(*per_tensor) for out in outs]


def assert_within(actual, expected_value, bound: Tracked, dtype, what: str) -> None:
    """``|actual - expected| <= 2 * err + rtol * |expected|`` (+ the dtype's smallest subnormal), elementwise,
    ``err`` from the pseudo code's bound."""
    a = np.asarray(actual, np.float64)
    b = np.asarray(expected_value, np.float64)
    assert a.shape == b.shape, f"{what}: shape {a.shape} != {b.shape}"
    dtype = np.dtype(dtype)
    allowed = 2 * np.broadcast_to(bound.e, b.shape) + RTOL[dtype] * np.abs(b) + TINY[dtype]
    diff = np.abs(a - b)
    bad = ~(diff <= allowed)  # NaN fails too
    if bad.any():
        i = np.unravel_index(np.argmax(np.where(bad, diff - allowed, -np.inf)), b.shape) if b.ndim else ()
        raise AssertionError(
            f"{what}: {int(bad.sum())} of {b.size} elements differ beyond tolerance; e.g. at {i}: "
            f"actual {a[i]!r}, expected {b[i]!r}, |diff| {diff[i]!r} > allowed {allowed[i]!r}"
        )


# ---------------------------------------------------------------------------------------------
# Strategies
# ---------------------------------------------------------------------------------------------

dtypes = st.sampled_from([F32, F64])
counts = st.one_of(st.just(0), st.integers(1, 1000))  # T == 0 and T > 0
x_shapes = st.lists(st.integers(1, 3), min_size=0, max_size=4).map(tuple)  # () .. rank 4


def f32s(lo, hi, **kw):
    """Float32-representable floats: the values an ONNX FLOAT attribute can hold."""
    return st.floats(float(np.float32(lo)), float(np.float32(hi)), width=32, allow_subnormal=False, **kw)


def as_f32(*values):
    return [float(np.float32(v)) for v in values]


open_unit = st.one_of(
    st.sampled_from(as_f32(0.5, 0.9, 0.99, 0.999)), f32s(0.0, 1.0, exclude_min=True, exclude_max=True)
)
epsilons = st.one_of(st.sampled_from(as_f32(1e-6, 1e-8, 1e-2)), f32s(1e-8, 0.1))
norm_coefficients = st.one_of(st.just(0.0), f32s(0.0, 1.0))
post_coefficients = st.one_of(st.just(0.0), f32s(0.0, 1.0, exclude_max=True))
decay_factors = st.one_of(st.just(0.0), f32s(0.0, 10.0))


@st.composite
def broadcast_shapes_to(draw, shape):
    """A shape that numpy-broadcasts to ``shape`` (a suffix of it, some dims set to 1)."""
    k = draw(st.integers(0, len(shape)))
    tail = shape[len(shape) - k :]
    return tuple(1 if draw(st.booleans()) else d for d in tail)


def elements(dtype, nonnegative=False):
    """Tensor entries in [-10, 10] (or [0, 10]): 0 or of magnitude >= 1e-4, representable in ``dtype``."""
    width = 32 if dtype == F32 else 64
    lo = 0.0 if nonnegative else -10.0
    return st.floats(lo, 10.0, width=width, allow_subnormal=False).map(lambda v: 0.0 if abs(v) < 1e-4 else v)


@dataclass
class Case:
    op_type: str
    dtype: np.dtype
    r: np.ndarray
    t: np.ndarray
    groups: list  # per tensor: (X, G, V[, H])
    attributes: dict  # as on the node (some defaults may be left out)
    full_attributes: dict  # with the schema's defaults filled in

    @property
    def tensors(self) -> list[np.ndarray]:
        return layout(self.op_type, self.groups)[1]

    def kernel(self, attributes=None):
        """The reference kernel on this case (with the node's attributes unless others are given)."""
        attributes = self.attributes if attributes is None else attributes
        return KERNELS[self.op_type](self.r, self.t, *self.tensors, **attributes)


@st.composite
def attribute_sets(draw, op_type, mode):
    if op_type == "Adam":
        drawn = dict(
            alpha=draw(open_unit), beta=draw(open_unit), epsilon=draw(epsilons),
            norm_coefficient=draw(norm_coefficients), norm_coefficient_post=draw(post_coefficients),
        )
    elif op_type == "Adagrad":
        drawn = dict(decay_factor=draw(decay_factors), epsilon=draw(epsilons), norm_coefficient=draw(norm_coefficients))
    else:  # every Momentum attribute is required
        return dict(alpha=draw(open_unit), beta=draw(open_unit), mode=mode, norm_coefficient=draw(norm_coefficients))
    # Leave some out: the node then means the schema's default.
    keep = draw(st.sets(st.sampled_from(sorted(drawn)), max_size=len(drawn)).map(set) | st.just(set(drawn)))
    return {k: v for k, v in drawn.items() if k in keep}


@st.composite
def cases(draw, op_type, mode=None, max_tensors=4):
    dtype = draw(dtypes)
    r_dtype = draw(dtypes)  # may differ from X's dtype
    r_value = draw(f32s(1e-4, 2.0) if r_dtype == F32 else st.floats(1e-4, 2.0))
    r = np.full(draw(st.sampled_from([(), (1,)])), r_value, r_dtype)
    t = np.full(draw(st.sampled_from([(), (1,)])), draw(counts), np.int64)
    groups = []
    for _ in range(draw(st.integers(1, max_tensors))):
        x_shape = draw(x_shapes)
        broadcast = draw(st.booleans())
        group = []
        for role in INPUT_GROUPS[op_type]:
            shape = draw(broadcast_shapes_to(x_shape)) if broadcast and role != "X" else x_shape
            group.append(draw(arrays(dtype, shape, elements=elements(dtype, nonnegative=role == "H"))))
        groups.append(tuple(group))
    attributes = draw(attribute_sets(op_type, mode))
    return Case(op_type, dtype, r, t, groups, attributes, {**schema_defaults(op_type), **attributes})


def check_own_outputs(case, outputs) -> None:
    """Our outputs: one per output in op order, each of X's dtype and X's (the broadcast) shape."""
    n = len(case.groups)
    assert len(outputs) == n * len(OUTPUT_GROUPS[case.op_type])
    for k, out in enumerate(outputs):
        x = case.groups[k % n][0]
        assert np.asarray(out).dtype == case.dtype, f"output {k}: dtype {np.asarray(out).dtype} != {case.dtype}"
        assert np.shape(out) == x.shape, f"output {k}: shape {np.shape(out)} != X's {x.shape}"


# ---------------------------------------------------------------------------------------------
# 1. Reference kernels vs onnx.reference.ReferenceEvaluator
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
@CHEAP
@given(data=st.data())
def test_reference_kernel_matches_onnx_reference_evaluator(op_type, mode, data):
    case = data.draw(cases(op_type, mode))
    model, feed, outputs = single_node_model(op_type, case.r, case.t, case.groups, case.attributes)
    with np.errstate(all="ignore"):
        expected = ReferenceEvaluator(model).run(None, feed)
    ours = case.kernel()
    check_own_outputs(case, ours)  # also where the evaluator casts multi-tensor Adam to float32
    # The evaluator holds attributes as np.float32 scalars, so it computes 1 - alpha etc. in float32.
    bounds = spec_outputs(case, coefficient_dtype=F32)
    for name, o, e, bound in zip(outputs, ours, expected, bounds):
        e = np.asarray(e)
        # Evaluator quirk: R of shape [1] broadcasts a scalar X to shape (1,).
        assert e.shape == np.shape(o) or (np.shape(o) == () and e.shape == (1,)), (name, e.shape, np.shape(o))
        # Evaluator quirk: multi-tensor Adam casts its outputs to float32; compare to float32 precision then.
        precision = F32 if e.dtype == F32 else case.dtype
        assert_within(o, e.reshape(np.shape(o)), bound, precision, f"{name} (vs ReferenceEvaluator)")


# ---------------------------------------------------------------------------------------------
# 2. Reference kernels vs the pseudo code in float64
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
@CHEAP
@given(data=st.data())
def test_reference_kernel_matches_float64_pseudo_code(op_type, mode, data):
    case = data.draw(cases(op_type, mode))
    ours = case.kernel()
    check_own_outputs(case, ours)
    _, _, outputs = layout(op_type, case.groups)
    for name, o, spec in zip(outputs, ours, spec_outputs(case)):
        assert_within(o, np.broadcast_to(spec.v, np.shape(o)), spec, case.dtype, f"{name} (vs pseudo code)")


# ---------------------------------------------------------------------------------------------
# 3. The plugin path: a single-node model through onnx_training_ops.InferenceSession
# ---------------------------------------------------------------------------------------------


def run_session(model, feed, outputs):
    session = onnx_training_ops.InferenceSession(model)
    return session.run(outputs, feed)


@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
@SESSION
@given(data=st.data())
def test_plugin_session_matches_reference_kernel(op_type, mode, data):
    case = data.draw(cases(op_type, mode))
    model, feed, outputs = single_node_model(op_type, case.r, case.t, case.groups, case.attributes)
    assert model.ir_version == onnx.IR_VERSION  # as onnx.helper writes it; prepare() must fit it
    got = run_session(model, feed, outputs)
    check_own_outputs(case, got)
    expected = case.kernel()
    for name, o, e, bound in zip(outputs, got, expected, spec_outputs(case)):
        assert_within(o, e, bound, case.dtype, f"{name} (session vs reference kernel)")


@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
@pytest.mark.parametrize("t", [0, 3])
def test_named_broadcast_cases_all_three_ways(op_type, mode, dtype, t):
    """Fixed broadcasting cases, always run: G (1, k) against X (m, k), V of shape (k,), a scalar H,
    and a scalar X with [1]-shaped R and T; checks 1-3 on each."""
    rng = np.random.default_rng(11)
    shapes = {"X": (3, 4), "G": (1, 4), "V": (4,), "H": ()}
    group = tuple(
        np.asarray(np.abs(rng.standard_normal(shapes[k])) if k == "H" else rng.standard_normal(shapes[k]), dtype)
        for k in INPUT_GROUPS[op_type]
    )
    scalar_group = tuple(np.asarray(0.5 + i, dtype) for i in range(len(INPUT_GROUPS[op_type])))
    attributes = {"Adam": dict(alpha=0.8, beta=0.95, epsilon=1e-3, norm_coefficient=0.05, norm_coefficient_post=0.01),
                  "Momentum": dict(alpha=0.7, beta=0.3, mode=mode, norm_coefficient=0.05),
                  "Adagrad": dict(decay_factor=0.1, epsilon=1e-3, norm_coefficient=0.05)}[op_type]
    attributes = _float32_values(attributes)
    other = F64 if dtype == F32 else F32
    case = Case(op_type, dtype, np.array([0.05], other), np.array([t], np.int64), [group, scalar_group],
                attributes, {**schema_defaults(op_type), **attributes})
    model, feed, outputs = single_node_model(op_type, case.r, case.t, case.groups, case.attributes)
    ours = case.kernel()
    check_own_outputs(case, ours)
    specs = spec_outputs(case)
    evaluated = ReferenceEvaluator(model).run(None, feed)
    ev_bounds = spec_outputs(case, coefficient_dtype=F32)
    got = run_session(model, feed, outputs)
    check_own_outputs(case, got)
    for name, o, s, e, eb, g in zip(outputs, ours, specs, evaluated, ev_bounds, got):
        assert_within(o, np.broadcast_to(s.v, np.shape(o)), s, dtype, f"{name} (vs pseudo code)")
        e = np.asarray(e)
        assert_within(o, e.reshape(np.shape(o)), eb, F32 if e.dtype == F32 else dtype, f"{name} (vs evaluator)")
        assert_within(g, o, s, dtype, f"{name} (session vs reference kernel)")


# ---------------------------------------------------------------------------------------------
# 4. Attribute exactness: the model's float32 value, not the bridge's 6-digit text
# ---------------------------------------------------------------------------------------------

MANY_DIGITS = {
    "Adam": dict(alpha=0.123456789, beta=0.987654321, epsilon=1.23456789e-3, norm_coefficient=0.0123456789,
                 norm_coefficient_post=0.00123456789),
    "Momentum": dict(alpha=0.123456789, beta=0.987654321, norm_coefficient=0.0123456789),
    "Adagrad": dict(decay_factor=0.123456789, epsilon=1.23456789e-3, norm_coefficient=0.0123456789),
}


def _float32_values(attributes):
    return {k: (float(np.float32(v)) if isinstance(v, float) else v) for k, v in attributes.items()}


def _six_digit_values(attributes):
    """What onnxruntime-extensions hands a PyOp for a float attribute: C++ stream text, 6 digits."""
    return {k: (float(f"{np.float32(v):g}") if isinstance(v, float) else v) for k, v in attributes.items()}


def _assert_bitwise(case, got, expected, outputs):
    check_own_outputs(case, got)
    for name, o, e in zip(outputs, got, expected):
        np.testing.assert_array_equal(np.asarray(o), np.asarray(e), err_msg=name, strict=True)


@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("t", [0, 7])
def test_many_digit_attributes_are_exact_float32(op_type, mode, t):
    """alpha=0.123456789 etc. on the node: the result of float32(0.123456789), bit for bit."""
    rng = np.random.default_rng(20240)
    dtype = F32
    shapes = [(3, 4), ()]
    groups = []
    for shape in shapes:
        group = [rng.standard_normal(shape).astype(dtype) for _ in INPUT_GROUPS[op_type]]
        if op_type != "Momentum":
            group[-1] = np.abs(group[-1])
        groups.append(tuple(np.asarray(a, dtype) for a in group))
    attributes = dict(MANY_DIGITS[op_type], **({"mode": mode} if mode else {}))
    r, tt = np.array(0.0123456789, np.float32), np.array(t, np.int64)
    model, feed, outputs = single_node_model(op_type, r, tt, groups, attributes)
    got = run_session(model, feed, outputs)
    case = Case(op_type, dtype, r, tt, groups, attributes, attributes)
    exact = case.kernel(_float32_values(attributes))
    _assert_bitwise(case, got, exact, outputs)
    # The check has teeth: the 6-digit values give a different result.
    rounded = case.kernel(_six_digit_values(attributes))
    assert any(not np.array_equal(np.asarray(a), np.asarray(b)) for a, b in zip(exact, rounded))


@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
@pytest.mark.parametrize("dtype", [F32, F64], ids=["float32", "float64"])
def test_many_digit_attributes_exact_on_large_tensors(op_type, mode, dtype):
    """The same on tensors large enough for the plugin's parallel fused kernels (> 16k elements)."""
    rng = np.random.default_rng(5)
    group = tuple(np.abs(rng.standard_normal((3, 9000))).astype(dtype) for _ in INPUT_GROUPS[op_type])
    attributes = dict(MANY_DIGITS[op_type], **({"mode": mode} if mode else {}))
    r, t = np.array(0.0123456789, dtype), np.array(7, np.int64)
    model, feed, outputs = single_node_model(op_type, r, t, [group], attributes)
    got = run_session(model, feed, outputs)
    case = Case(op_type, dtype, r, t, [group], attributes, attributes)
    _assert_bitwise(case, got, case.kernel(_float32_values(attributes)), outputs)


many_digit_unit = st.floats(0.001, 0.999).filter(lambda v: f"{np.float32(v):g}" != repr(float(np.float32(v))))


@st.composite
def many_digit_attributes(draw, op_type, mode):
    if op_type == "Adam":
        return dict(alpha=draw(many_digit_unit), beta=draw(many_digit_unit), epsilon=draw(st.floats(1e-8, 0.1)),
                    norm_coefficient=draw(st.floats(0.0, 1.0)), norm_coefficient_post=draw(st.floats(0.0, 0.999)))
    if op_type == "Adagrad":
        return dict(decay_factor=draw(st.floats(0.0, 10.0)), epsilon=draw(st.floats(1e-8, 0.1)),
                    norm_coefficient=draw(st.floats(0.0, 1.0)))
    return dict(alpha=draw(many_digit_unit), beta=draw(many_digit_unit), mode=mode,
                norm_coefficient=draw(st.floats(0.0, 1.0)))


@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
@EXACT
@given(data=st.data())
def test_drawn_attributes_reach_the_kernel_as_exact_float32(op_type, mode, data):
    """Arbitrary float64 attributes: the session computes with their float32 rounding, bit for bit."""
    case = data.draw(cases(op_type, mode, max_tensors=2))
    attributes = data.draw(many_digit_attributes(op_type, mode))
    model, feed, outputs = single_node_model(op_type, case.r, case.t, case.groups, attributes)
    got = run_session(model, feed, outputs)
    _assert_bitwise(case, got, case.kernel(_float32_values(attributes)), outputs)


# ---------------------------------------------------------------------------------------------
# 5. Acceptance: one 3-tensor Adam node, onnx.helper at the default IR version, through the session
# ---------------------------------------------------------------------------------------------


def _adam_pseudo_code_float64(r, t, x, g, v, h, alpha, beta, epsilon, norm_coefficient, norm_coefficient_post):
    x, g, v, h = (np.asarray(a, np.float64) for a in (x, g, v, h))
    g_regularized = norm_coefficient * x + g
    v_new = alpha * v + (1 - alpha) * g_regularized
    h_new = beta * h + (1 - beta) * g_regularized * g_regularized
    h_sqrt = np.sqrt(h_new) + epsilon
    r_adjusted = r * math.sqrt(1 - beta**t) / (1 - alpha**t) if t > 0 else r
    x_new = x - r_adjusted * v_new / h_sqrt
    x_final = (1 - norm_coefficient_post) * x_new
    return x_final, v_new, h_new


@pytest.mark.parametrize("dtype", [np.float32, np.float64], ids=["float32", "float64"])
@pytest.mark.parametrize("t", [0, 5])
def test_acceptance_three_tensor_adam_node(t, dtype):
    rng = np.random.default_rng(7)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    shapes = [(4, 3), (5,), (2, 3, 2)]
    xs = [rng.standard_normal(s).astype(dtype) for s in shapes]
    gs = [rng.standard_normal(s).astype(dtype) for s in shapes]
    vs = [(0.1 * rng.standard_normal(s)).astype(dtype) for s in shapes]
    hs = [(0.1 * rng.random(s)).astype(dtype) for s in shapes]
    attributes = dict(alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.01, norm_coefficient_post=0.001)
    names = {k: [f"{k}{i}" for i in range(3)] for k in ("X", "G", "V", "H", "X_new", "V_new", "H_new")}
    node = helper.make_node(
        "Adam", ["R", "T", *names["X"], *names["G"], *names["V"], *names["H"]],
        [*names["X_new"], *names["V_new"], *names["H_new"]], domain=DOMAIN, **attributes,
    )
    inputs = [helper.make_tensor_value_info("R", elem, []), helper.make_tensor_value_info("T", TensorProto.INT64, [])]
    inputs += [helper.make_tensor_value_info(names[k][i], elem, list(shapes[i])) for k in "XGVH" for i in range(3)]
    outputs = [helper.make_tensor_value_info(names[k][i], elem, list(shapes[i]))
               for k in ("X_new", "V_new", "H_new") for i in range(3)]
    model = helper.make_model(
        helper.make_graph([node], "adam3", inputs, outputs),
        opset_imports=[helper.make_opsetid("", onnx.defs.onnx_opset_version()), helper.make_opsetid(DOMAIN, 1)],
    )
    assert model.ir_version == onnx.IR_VERSION
    r = np.array(0.01, dtype)
    feed = {"R": r, "T": np.array(t, np.int64)}
    for k, values in zip("XGVH", (xs, gs, vs, hs)):
        feed.update(zip(names[k], values))
    got = onnx_training_ops.InferenceSession(model).run(None, feed)

    exact_attributes = _float32_values(attributes)  # the model holds float32 attributes
    per_tensor = [_adam_pseudo_code_float64(float(r), t, xs[i], gs[i], vs[i], hs[i], **exact_attributes)
                  for i in range(3)]
    expected = [out for outs in zip(*per_tensor) for out in outs]  # op order
    tol = 1e-6 if dtype == np.float32 else 1e-12
    for name, o, e in zip([o.name for o in outputs], got, expected):
        assert o.dtype == np.dtype(dtype) and o.shape == e.shape, (name, o.dtype, o.shape)
        rel = np.linalg.norm(o.astype(np.float64) - e) / np.linalg.norm(e)
        assert rel <= tol, f"{name}: norm-wise relative error {rel:.3g} > {tol:g}"
