"""Pass (portable form): lower every Adam, Momentum and Adagrad node to standard ONNX ops.

After ``expand_gradient`` and this pass a model holds no node of ai.onnx.preview.training,
so it runs in any onnxruntime build (C, C++, C#, Java, JavaScript...) with nothing
registered, and in ``onnx.reference.ReferenceEvaluator``.

The graph computes what the reference kernels (:mod:`onnx_training_ops.kernels`) compute,
in the same operation order, so float32 results agree to the last bit except where libm's
``pow`` differs between processes:

* scalars — R, T, the bias correction ``R·sqrt(1-beta^T)/(1-alpha^T)`` for T > 0, Momentum's
  ``beta`` (1 on the first step), Adagrad's ``R/(1+T·decay_factor)`` — in float64 (as the
  kernels' Python floats), then one Cast to the tensors' dtype;
* attribute constants (``alpha``, ``1-alpha``, ...) are folded here, in float64 from the
  float32 values the model holds and then rounded to the tensors' dtype, as numpy does with
  a Python float times a float32 array;
* tensor math in the tensors' dtype, one elementwise op per step of the pseudo code, with
  numpy broadcasting (onnx's multidirectional broadcasting is the same rule).

Identities are not emitted: ``(1 - norm_coefficient_post) * X`` when it is 0 (exact), Adagrad's
``R / (1 + T·0)`` (exact) and ``norm_coefficient * X + G`` when ``norm_coefficient`` is 0 and G has
X's static shape (equal to the spec for every finite X; an infinite or NaN X would make the
spec's ``0·X`` NaN and poison V/H, which the portable form does not reproduce).

Each tensor's chain is a line of elementwise ops whose intermediates have one consumer, so
onnxruntime's allocation planner reuses their buffers in place; scalar subgraphs over
constants fold at session creation; the per-node scalars are shared by its tensors.
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import GraphProto, ModelProto, TensorProto, helper

from ..errors import TrainingOpError, node_label
from ..kernels.momentum import check_mode
from ..schema import DOMAIN, OPTIMIZERS
from ._graph import ValueType, all_names, concatenated, unique_name, value_types
from ..walk import all_graphs, model_graphs
from .encode_exact_attributes import node_attributes

FLOAT_TYPES = {TensorProto.FLOAT: np.float32, TensorProto.DOUBLE: np.float64}
MIN_OPSET = 9  # Where (and Greater on double)
DEFAULT_OPSET = 13  # imported when the model imports no ai.onnx opset (the conformance cases)
CASTLIKE_OPSET = 15  # for X of unknown dtype


class _Emitter:
    """Emits the ops of one graph's lowered nodes: fresh names, shared constants."""

    def __init__(self, taken: set[str], opset: int) -> None:
        self.taken = taken
        self.opset = opset
        self.nodes: list[onnx.NodeProto] = []
        self._constants: dict[tuple, str] = {}

    def name(self, base: str) -> str:
        return unique_name(self.taken, base)

    def op(self, op_type: str, inputs: list[str], base: str, **attrs) -> str:
        out = self.name(base)
        self.nodes.append(helper.make_node(op_type, inputs, [out], name=self.name(f"{base}/{op_type}"), **attrs))
        return out

    def const(self, value: float, elem_type: int, base: str) -> str:
        key = (elem_type, float(value) if elem_type != TensorProto.INT64 else int(value), base)
        if key not in self._constants:
            name = self.name(base)
            if elem_type == TensorProto.INT64:
                tensor = helper.make_tensor(name, elem_type, [0], [])  # an empty shape: Reshape to []
            else:
                tensor = onnx.numpy_helper.from_array(np.array(value, FLOAT_TYPES[elem_type]), name)
            self.nodes.append(helper.make_node("Constant", [], [name], name=self.name(f"{name}/Constant"),
                                               value=tensor))
            self._constants[key] = name
        return self._constants[key]


class _Scalars:
    """The per-node scalars: R and T as float64 scalars, and their use in one tensor dtype."""

    def __init__(self, e: _Emitter, node: onnx.NodeProto, types: dict[str, ValueType], base: str) -> None:
        self.e, self.base = e, base
        self.r = e.op("Cast", [self._scalar(node.input[0], types)], f"{base}/R_f64", to=TensorProto.DOUBLE)
        self.t = e.op("Cast", [self._scalar(node.input[1], types)], f"{base}/T_f64", to=TensorProto.DOUBLE)
        self._positive: str | None = None
        self._in: dict[tuple[str, int | str], str] = {}

    def _scalar(self, name: str, types: dict[str, ValueType]) -> str:
        vt = types.get(name)
        if vt is not None and vt.shape == ():
            return name
        empty = self.e.const(0, TensorProto.INT64, "portable/scalar_shape")
        return self.e.op("Reshape", [name, empty], f"{self.base}/{name}_scalar")

    def f64(self, value: float, what: str) -> str:
        return self.e.const(value, TensorProto.DOUBLE, f"portable/{what}_f64")

    def positive(self) -> str:
        """T > 0 (the spec's first step has T = 0)."""
        if self._positive is None:
            self._positive = self.e.op("Greater", [self.t, self.f64(0.0, "zero")], f"{self.base}/T_positive")
        return self._positive

    def as_dtype(self, value: str, dtype: int | str, what: str) -> str:
        """A float64 scalar in the tensors' dtype (``dtype`` an elem type, or a value to CastLike)."""
        key = (value, dtype)
        if key not in self._in:
            if isinstance(dtype, str):
                self._in[key] = self.e.op("CastLike", [value, dtype], f"{self.base}/{what}")
            else:
                self._in[key] = self.e.op("Cast", [value], f"{self.base}/{what}", to=dtype)
        return self._in[key]


def _constant(e: _Emitter, value: float, dtype: int | str, what: str, base: str) -> str:
    """``value`` (a Python float, as the kernels hold it) in the tensors' dtype."""
    if isinstance(dtype, str):  # dtype unknown: CastLike a float64 constant to X
        return e.op("CastLike", [e.const(value, TensorProto.DOUBLE, f"portable/{what}_f64"), dtype], f"{base}/{what}")
    return e.const(value, dtype, f"portable/{what}_{_suffix(dtype)}")


def _scaled(e: _Emitter, x: str, c: float, dtype, what: str, base: str) -> str:
    """``x * c`` for a computed constant ``c`` (``1 - attribute``), in the tensors' dtype.

    onnxruntime's NoopElimination drops ``Mul(x, c)`` when ``static_cast<float>(c) == 1``,
    also for a double ``c`` (1 - 6e-10 is 1 in float32): for float64 tensors such a ``c`` is
    applied as ``(x * 2) * (c / 2)``, the same rounded value (doubling and halving are exact;
    only |x| > 8.9e307 would overflow), which the rule leaves alone."""
    if dtype == TensorProto.DOUBLE and c != 1.0 and float(np.float32(c)) == 1.0:
        doubled = e.op("Mul", [x, e.const(2.0, dtype, "portable/two_f64")], f"{base}_doubled")
        return e.op("Mul", [doubled, _constant(e, c / 2, dtype, f"half_{what}", base)], base)
    return e.op("Mul", [x, _constant(e, c, dtype, what, base)], base)


def _suffix(dtype: int | str) -> str:
    """A name suffix for the tensors' dtype: f32, f64, or like_X when it is not known."""
    if isinstance(dtype, str):
        return f"like_{dtype}"
    return "f32" if dtype == TensorProto.FLOAT else "f64"


def _regularized(e, x, g, nc: float, dtype, same_shape: bool, base: str) -> str:
    """``norm_coefficient * X + G`` (just G when the coefficient is 0 and G is X-shaped)."""
    if nc == 0.0 and same_shape:
        return g
    scaled = e.op("Mul", [x, _constant(e, nc, dtype, "norm_coefficient", base)], f"{base}/nc_x")
    return e.op("Add", [scaled, g], f"{base}/G_regularized")


def _rate_adam(s: _Scalars, a: dict) -> str:
    """The float64 rate the tensors share: R, bias-corrected when T > 0 (kernels.adam.adam_rate)."""
    e = s.e
    t1 = e.op("Max", [s.t, s.f64(1.0, "one")], f"{s.base}/T_at_least_1")  # no 0/0 on the T = 0 branch
    beta_t = e.op("Pow", [s.f64(a["beta"], "beta"), t1], f"{s.base}/beta_pow_T")
    alpha_t = e.op("Pow", [s.f64(a["alpha"], "alpha"), t1], f"{s.base}/alpha_pow_T")
    root = e.op("Sqrt", [e.op("Sub", [s.f64(1.0, "one"), beta_t], f"{s.base}/one_minus_beta_pow_T")],
                f"{s.base}/sqrt_one_minus_beta_pow_T")
    scaled = e.op("Mul", [s.r, root], f"{s.base}/R_sqrt")
    adjusted = e.op("Div", [scaled, e.op("Sub", [s.f64(1.0, "one"), alpha_t], f"{s.base}/one_minus_alpha_pow_T")],
                    f"{s.base}/R_adjusted")
    return e.op("Where", [s.positive(), adjusted, s.r], f"{s.base}/rate")


def _rate_adagrad(s: _Scalars, a: dict) -> str:
    if a["decay_factor"] == 0.0:
        return s.r  # R / (1 + T*0) == R exactly
    e = s.e
    decayed = e.op("Mul", [s.t, s.f64(a["decay_factor"], "decay_factor")], f"{s.base}/T_decay")
    return e.op("Div", [s.r, e.op("Add", [s.f64(1.0, "one"), decayed], f"{s.base}/one_plus_T_decay")],
                f"{s.base}/rate")


def _lower_node(e: _Emitter, node: onnx.NodeProto, types: dict[str, ValueType], label: str) -> None:
    spec = OPTIMIZERS[node.op_type]
    n = spec.n_tensors(len(node.input))
    if n is None:
        raise TrainingOpError(f"{label}: expected R, T and {spec.n_groups_in}*N tensors "
                              f"({', '.join(spec.tensor_inputs)} per tensor), found {len(node.input)} inputs")
    a = node_attributes(node)
    missing = [k for k in spec.all_attribute_names() if k not in a]
    if missing:
        raise TrainingOpError(f"{label}: attribute(s) {', '.join(missing)} missing (run fill_default_attributes first)")
    for k in spec.float_attributes:
        a[k] = float(np.float32(a[k]))  # what a model holds, as the kernels read it
    base = node.name or node.output[0] or node.op_type
    s = _Scalars(e, node, types, base)
    if node.op_type == "Adam":
        rate = _rate_adam(s, a)
    elif node.op_type == "Adagrad":
        rate = _rate_adagrad(s, a)
    else:
        try:
            nesterov = check_mode(a["mode"])
        except TrainingOpError as error:
            raise TrainingOpError(f"{label}: {str(error).removeprefix('Momentum: ')}") from None
        rate = s.r
        one_or_beta = e.op("Where", [s.positive(), s.f64(a["beta"], "beta"), s.f64(1.0, "one")],
                           f"{base}/beta_adjusted")

    finals: dict[str, str] = {}  # emitted value -> the node's output name
    for i in range(n):
        x, g, *state = [node.input[2 + j * n + i] for j in range(spec.n_groups_in)]
        outputs = [node.output[j * n + i] if j * n + i < len(node.output) else "" for j in range(spec.n_groups_out)]
        where = f"{label}: tensor {i}"
        dtype = _dtype(x, [x, g, *state], spec.tensor_inputs, types, e.opset, where)
        tb = f"{base}/{i}"
        k = lambda value, what: _constant(e, value, dtype, what, tb)  # noqa: E731
        xt, gt = types.get(x), types.get(g)
        same = (xt is not None and gt is not None and xt.shape is not None and xt.shape == gt.shape
                and all(d is not None for d in xt.shape))
        g_reg = _regularized(e, x, g, a["norm_coefficient"], dtype, same, tb)
        rate_x = s.as_dtype(rate, dtype, f"rate_{_suffix(dtype)}")
        if node.op_type == "Adam":
            v, h = state
            v_new = e.op("Add", [e.op("Mul", [v, k(a["alpha"], "alpha")], f"{tb}/alpha_V"),
                                 _scaled(e, g_reg, 1.0 - a["alpha"], dtype, "one_minus_alpha", f"{tb}/G_scaled")],
                         f"{tb}/V_new")
            g_sq = e.op("Mul", [g_reg, g_reg], f"{tb}/G_squared")
            h_new = e.op("Add", [e.op("Mul", [h, k(a["beta"], "beta")], f"{tb}/beta_H"),
                                 _scaled(e, g_sq, 1.0 - a["beta"], dtype, "one_minus_beta", f"{tb}/G_squared_scaled")],
                         f"{tb}/H_new")
            h_sqrt = e.op("Add", [e.op("Sqrt", [h_new], f"{tb}/H_sqrt0"), k(a["epsilon"], "epsilon")], f"{tb}/H_sqrt")
            step = e.op("Mul", [rate_x, e.op("Div", [v_new, h_sqrt], f"{tb}/V_over_H")], f"{tb}/step")
            x_new = e.op("Sub", [x, step], f"{tb}/X_new")
            if a["norm_coefficient_post"] != 0.0:
                x_new = _scaled(e, x_new, 1.0 - a["norm_coefficient_post"], dtype, "one_minus_norm_coefficient_post",
                                f"{tb}/X_final")
            values = [x_new, v_new, h_new]
        elif node.op_type == "Momentum":
            (v,) = state
            beta_x = s.as_dtype(one_or_beta, dtype, f"beta_{_suffix(dtype)}")
            v_new = e.op("Add", [e.op("Mul", [v, k(a["alpha"], "alpha")], f"{tb}/alpha_V"),
                                 e.op("Mul", [g_reg, beta_x], f"{tb}/beta_G")], f"{tb}/V_new")
            if nesterov:
                ahead = e.op("Add", [g_reg, e.op("Mul", [v_new, k(a["alpha"], "alpha")], f"{tb}/alpha_V_new")],
                             f"{tb}/G_ahead")
                x_new = e.op("Sub", [x, e.op("Mul", [rate_x, ahead], f"{tb}/step")], f"{tb}/X_new")
            else:
                x_new = e.op("Sub", [x, e.op("Mul", [rate_x, v_new], f"{tb}/step")], f"{tb}/X_new")
            values = [x_new, v_new]
        else:
            (h,) = state
            h_new = e.op("Add", [h, e.op("Mul", [g_reg, g_reg], f"{tb}/G_squared")], f"{tb}/H_new")
            h_sqrt = e.op("Add", [e.op("Sqrt", [h_new], f"{tb}/H_sqrt0"), k(a["epsilon"], "epsilon")], f"{tb}/H_sqrt")
            scaled = e.op("Mul", [rate_x, g_reg], f"{tb}/R_G")
            x_new = e.op("Sub", [x, e.op("Div", [scaled, h_sqrt], f"{tb}/step")], f"{tb}/X_new")
            values = [x_new, h_new]
        for value, out in zip(values, outputs):
            if out:
                finals[value] = out
    _rename(e.nodes, finals)


def _rename(nodes: list[onnx.NodeProto], names: dict[str, str]) -> None:
    for nd in nodes:
        for i, name in enumerate(nd.input):
            if name in names:
                nd.input[i] = names[name]
        for i, name in enumerate(nd.output):
            if name in names:
                nd.output[i] = names[name]


def _dtype(x: str, group: list[str], roles, types: dict[str, ValueType], opset: int, where: str):
    """The group's element type (TensorProto enum), or X's name when it is not known statically."""
    known = {}
    for name, role in zip(group, roles):
        vt = types.get(name)
        if vt is None or not vt.elem_type:
            continue
        if vt.elem_type not in FLOAT_TYPES:
            raise TrainingOpError(f"{where}: input {role} ({name!r}) must be float32 or float64, found "
                                  f"{vt.dtype_name}")
        known[role] = vt.elem_type
    if len(set(known.values())) > 1:
        found = ", ".join(f"{r} {onnx.helper.tensor_dtype_to_np_dtype(t)}" for r, t in known.items())
        raise TrainingOpError(f"{where}: {', '.join(roles)} must share one dtype; found {found}")
    if known:
        return next(iter(known.values()))
    if opset >= CASTLIKE_OPSET:
        return x
    raise TrainingOpError(f"{where}: the element type of X ({x!r}) is not known statically and the model "
                          f"imports ai.onnx opset {opset} (< {CASTLIKE_OPSET}, no CastLike); add a value_info "
                          "for it or raise the opset")


def _prune(nodes: list[onnx.NodeProto], needed: set[str]) -> list[onnx.NodeProto]:
    """The emitted nodes some wanted output depends on (a node's unused outputs cost nothing)."""
    kept = []
    for nd in reversed(nodes):
        if any(o in needed for o in nd.output):
            kept.append(nd)
            needed.update(nd.input)
    return kept[::-1]


def _lower_graph(graph: GraphProto, types: dict[str, ValueType], taken: set[str], opset: int, where: str) -> None:
    new_nodes = []
    for node in graph.node:
        if node.domain != DOMAIN or node.op_type not in OPTIMIZERS:
            new_nodes.append(node)
            continue
        e = _Emitter(taken, opset)
        _lower_node(e, node, types, where + node_label(node))
        new_nodes.extend(_prune(e.nodes, {o for o in node.output if o}))
    del graph.node[:]
    graph.node.extend(new_nodes)


def _default_opset(model: ModelProto) -> int:
    """The ai.onnx opset, raised to what the lowered ops need when the model imports none."""
    imports = [o for o in model.opset_import if o.domain in ("", "ai.onnx")]
    if not imports:
        model.opset_import.append(helper.make_opsetid("", DEFAULT_OPSET))
        model.ir_version = max(model.ir_version, helper.find_min_ir_version_for(list(model.opset_import)))
        return DEFAULT_OPSET
    return imports[0].version


def types_by_graph(model: ModelProto) -> list[tuple[GraphProto, dict[str, ValueType], str]]:
    """(top-level graph, inferred types, label prefix): the main graph, then each training_info
    graph, the algorithm typed as the IR runs it (after the main graph)."""
    from .validate import _with_graph

    out = [(model.graph, value_types(model), "")]
    for i, info in enumerate(model.training_info):
        out.append((info.initialization, value_types(_with_graph(model, info.initialization)),
                    f"training_info[{i}].initialization: "))
        algorithm = concatenated(model.graph, info.algorithm)
        out.append((info.algorithm, value_types(_with_graph(model, algorithm)), f"training_info[{i}].algorithm: "))
    return out


def lower_optimizers(model: ModelProto) -> ModelProto:
    """Replace every Adam/Momentum/Adagrad node (every graph, subgraphs and training_info
    included) by standard ops; drop the training domain's import when no node of it is left
    (in place; returns ``model``). Expects ``fill_default_attributes`` to have run."""
    if not any(n.domain == DOMAIN for g in model_graphs(model) for n in g.node):
        return model
    opset = _default_opset(model)
    uses = [n for g in model_graphs(model) for n in g.node if n.domain == DOMAIN and n.op_type in OPTIMIZERS]
    if uses and opset < MIN_OPSET:
        raise TrainingOpError(f"{node_label(uses[0])}: the portable form needs ai.onnx opset >= {MIN_OPSET} "
                              f"(Where); the model imports {opset}: convert it with onnx.version_converter")
    taken: set[str] = set()
    for graph in model_graphs(model):
        taken |= all_names(graph)
    for top, types, where in types_by_graph(model):
        # bodies before the graphs that hold them: rewriting a node list copies its nodes
        for graph in reversed(list(all_graphs(top))):
            _lower_graph(graph, types, taken, opset, where)
    if not any(n.domain == DOMAIN for g in model_graphs(model) for n in g.node):
        kept = [o for o in model.opset_import if o.domain != DOMAIN]
        del model.opset_import[:]
        model.opset_import.extend(kept)
    return model
