"""The Gradient expansion pass: conformance cases, semantics, subgraphs, training_info, errors."""

from __future__ import annotations

import glob
import os

import numpy as np
import onnx
import pytest
from gradient_utils import DOMAIN, gradient_model, run_expanded, runnable, session
from onnx import TensorProto, helper, numpy_helper

from benchmarks.overhead import deep_mlp_gradient_model
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.passes.expand_gradient import expand_gradient, expand_gradients_in_graph

SIMPLE = os.path.join(os.path.dirname(onnx.__file__), "backend", "test", "data", "simple")


def _gradient_nodes(graph: onnx.GraphProto) -> int:
    count = sum(n.op_type == "Gradient" for n in graph.node)
    for n in graph.node:
        for a in n.attribute:
            if a.type == onnx.AttributeProto.GRAPH:
                count += _gradient_nodes(a.g)
    return count


# ----------------------------------------------------------------------------- conformance
@pytest.mark.parametrize("case", ["test_gradient_of_add", "test_gradient_of_add_and_mul"])
def test_onnx_conformance_case(case):
    folder = os.path.join(SIMPLE, case)
    model = onnx.load(os.path.join(folder, "model.onnx"))
    data = os.path.join(folder, "test_data_set_0")
    inputs = [numpy_helper.to_array(onnx.load_tensor(p))
              for p in sorted(glob.glob(os.path.join(data, "input_*.pb")))]
    expected = [numpy_helper.to_array(onnx.load_tensor(p))
                for p in sorted(glob.glob(os.path.join(data, "output_*.pb")))]
    expanded = runnable(model)
    assert _gradient_nodes(expanded.graph) == 0
    onnx.checker.check_model(expanded, full_check=True)
    got = session(expanded).run(None, {v.name: a for v, a in zip(model.graph.input, inputs)})
    assert len(got) == len(expected)
    for g, e in zip(got, expected):
        np.testing.assert_allclose(g, e, rtol=1e-6)
        assert g.dtype == e.dtype


def test_input_model_untouched_and_new_model_returned():
    model = gradient_model([helper.make_node("Mul", ["a", "a"], ["y"])],
                           {"a": np.ones(3)}, "y", ["a"])
    before = model.SerializeToString()
    out = expand_gradient(model)
    assert model.SerializeToString() == before
    assert out is not model and _gradient_nodes(out.graph) == 0


def test_model_without_gradient_is_copied_unchanged():
    graph = helper.make_graph([helper.make_node("Relu", ["x"], ["y"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
    model = helper.make_model(graph)
    assert expand_gradient(model).SerializeToString() == model.SerializeToString()


# ----------------------------------------------------------------------------- semantics
def _mlp_nodes():
    return [helper.make_node("MatMul", ["x", "W"], ["h"]),
            helper.make_node("Tanh", ["h"], ["t"]),
            helper.make_node("Mul", ["t", "Z"], ["y"])]


def test_non_scalar_y_is_gradient_of_sum():
    rng = np.random.default_rng(0)
    feeds = {"x": rng.normal(size=(3, 4)), "W": rng.normal(size=(4, 2)), "Z": rng.normal(size=(2,))}
    got = run_expanded(gradient_model(_mlp_nodes(), feeds, "y", ["W"], ["Z"],
                                      grad_inputs=["W", "Z"]), feeds)
    t = np.tanh(feeds["x"] @ feeds["W"])
    expected = feeds["x"].T @ ((1 - t * t) * feeds["Z"])
    np.testing.assert_allclose(got["d_W"], expected, rtol=1e-12)


def test_gradient_at_substituted_inputs_reevaluates_forward():
    """Spec example: Gradient(xs=["H","Z"], y="Y") fed H_1, Z_1 differentiates at those values."""
    rng = np.random.default_rng(1)
    nodes = [helper.make_node("Exp", ["x"], ["H"]),
             helper.make_node("MatMul", ["H", "Z"], ["P"]),
             helper.make_node("Sigmoid", ["P"], ["Y"])]
    x, z = rng.normal(size=(2, 3)), rng.normal(size=(3, 4))
    h1, z1 = rng.normal(size=(5, 3)), rng.normal(size=(3, 4))  # another batch size too
    grad = helper.make_node("Gradient", ["H_1", "Z_1"], ["dH", "dZ"], name="g", domain=DOMAIN,
                            xs=["H", "Z"], y="Y")
    graph = helper.make_graph(
        nodes + [grad], "g",
        [helper.make_tensor_value_info(n, TensorProto.DOUBLE, a.shape)
         for n, a in [("x", x), ("Z", z), ("H_1", h1), ("Z_1", z1)]],
        [helper.make_tensor_value_info(n, TensorProto.DOUBLE, None) for n in ("Y", "dH", "dZ")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(DOMAIN, 1)])
    expanded = runnable(model)
    names = {o for n in expanded.graph.node for o in n.output}
    assert any(n.startswith("g/grad/fwd/") for n in names)
    dH, dZ = session(expanded).run(["dH", "dZ"], {"x": x, "Z": z, "H_1": h1, "Z_1": z1})
    s = 1 / (1 + np.exp(-(h1 @ z1)))
    ds = s * (1 - s)
    np.testing.assert_allclose(dH, ds @ z1.T, rtol=1e-12)
    np.testing.assert_allclose(dZ, h1.T @ ds, rtol=1e-12)


def test_gradient_wrt_intermediate_value_reuses_forward():
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Exp", ["x"], ["H"]), helper.make_node("Mul", ["H", "H"], ["y"])]
    feeds = {"x": rng.normal(size=(4,))}
    model = gradient_model(nodes, feeds, "y", ["H"])
    expanded = runnable(model)
    assert not any("fwd/" in o for n in expanded.graph.node for o in n.output)
    got = session(expanded).run(["d_H"], feeds)[0]
    np.testing.assert_allclose(got, 2 * np.exp(feeds["x"]), rtol=1e-12)


def test_empty_output_name_skips_that_gradient():
    rng = np.random.default_rng(3)
    feeds = {"a": rng.normal(size=(3,)), "b": rng.normal(size=(3,))}
    model = gradient_model([helper.make_node("Mul", ["a", "b"], ["y"])], feeds, "y", ["a", "b"])
    grad = model.graph.node[-1]
    grad.output[0] = ""
    del model.graph.output[1]
    expanded = runnable(model)
    assert not any(o == "d_a" for n in expanded.graph.node for o in n.output)
    np.testing.assert_allclose(session(expanded).run(["d_b"], feeds)[0], feeds["a"])


def test_y_equal_to_an_xs_and_unused_xs():
    rng = np.random.default_rng(4)
    feeds = {"a": rng.normal(size=(2, 3)), "b": rng.normal(size=(3,))}
    model = gradient_model([helper.make_node("Identity", ["b"], ["c"])], feeds, "a", ["a", "b"])
    got = run_expanded(model, feeds)
    np.testing.assert_array_equal(got["d_a"], np.ones((2, 3)))
    np.testing.assert_array_equal(got["d_b"], np.zeros(3))  # y does not depend on b


def test_integer_and_shape_paths_are_constants():
    rng = np.random.default_rng(5)
    nodes = [helper.make_node("Shape", ["x"], ["s"]),
             helper.make_node("Cast", ["x"], ["xi"], to=TensorProto.INT64),
             helper.make_node("Cast", ["xi"], ["xf"], to=TensorProto.DOUBLE),
             helper.make_node("Reshape", ["x", "s"], ["r"]),
             helper.make_node("Mul", ["r", "xf"], ["y"])]
    feeds = {"x": rng.uniform(1, 3, size=(2, 3))}
    got = run_expanded(gradient_model(nodes, feeds, "y", ["x"]), feeds)
    np.testing.assert_allclose(got["d_x"], np.trunc(feeds["x"]))


def test_zs_are_not_differentiated_but_feed_the_computation():
    rng = np.random.default_rng(6)
    feeds = {"w": rng.normal(size=(3,)), "z": rng.normal(size=(3,))}
    nodes = [helper.make_node("Mul", ["w", "z"], ["p"]), helper.make_node("Exp", ["p"], ["y"])]
    got = run_expanded(gradient_model(nodes, feeds, "y", ["w"], ["z"]), feeds)
    np.testing.assert_allclose(got["d_w"], feeds["z"] * np.exp(feeds["w"] * feeds["z"]))


def test_second_order_gradient():
    """d/dx of (d sum(x^3) / dx) = 6x, the second Gradient differentiating the first."""
    rng = np.random.default_rng(7)
    x = rng.normal(size=(4,))
    nodes = [helper.make_node("Mul", ["x", "x"], ["x2"]), helper.make_node("Mul", ["x2", "x"], ["y"]),
             helper.make_node("Gradient", ["x"], ["dy_dx"], name="g1", domain=DOMAIN,
                              xs=["x"], y="y"),
             helper.make_node("Gradient", ["x"], ["d2y"], name="g2", domain=DOMAIN,
                              xs=["x"], y="dy_dx")]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4])],
                              [helper.make_tensor_value_info(n, TensorProto.DOUBLE, None)
                               for n in ("dy_dx", "d2y")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(DOMAIN, 1)])
    d1, d2 = session(runnable(model)).run(None, {"x": x})
    np.testing.assert_allclose(d1, 3 * x * x, rtol=1e-12)
    np.testing.assert_allclose(d2, 6 * x, rtol=1e-12)


def test_dynamic_batch_dimension():
    rng = np.random.default_rng(8)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"]),
             helper.make_node("Add", ["h", "b"], ["z"]),
             helper.make_node("Relu", ["z"], ["r"]),
             helper.make_node("ReduceMean", ["r"], ["y"], keepdims=0)]
    W, b = rng.normal(size=(4, 3)), rng.normal(size=(3,))
    model = gradient_model(nodes, {"x": np.zeros((1, 4))}, "y", ["W", "b"],
                           initializers={"W": W, "b": b}, dynamic=True)
    sess = session(runnable(model))
    for batch in (1, 5):
        x = rng.normal(size=(batch, 4))
        dW, db = sess.run(["d_W", "d_b"], {"x": x})
        mask = (x @ W + b > 0) / (batch * 3)
        np.testing.assert_allclose(dW, x.T @ mask, rtol=1e-12)
        np.testing.assert_allclose(db, mask.sum(0), rtol=1e-12)


def test_unknown_rank_inputs_use_runtime_broadcast_reduction():
    """No shape at all on the inputs: the broadcast axes are found at run time."""
    nodes = [helper.make_node("Mul", ["a", "b"], ["m"]), helper.make_node("Div", ["m", "b"], ["q"]),
             helper.make_node("Add", ["q", "a"], ["y"])]  # y = 2a broadcast against b
    grad = helper.make_node("Gradient", ["a", "b"], ["da", "db"], name="g", domain=DOMAIN,
                            xs=["a", "b"], y="y")
    graph = helper.make_graph(
        nodes + [grad], "g", [helper.make_tensor_value_info(n, TensorProto.DOUBLE, None)
                              for n in ("a", "b")],
        [helper.make_tensor_value_info(n, TensorProto.DOUBLE, None) for n in ("da", "db")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(DOMAIN, 1)])
    sess = session(runnable(model))
    rng = np.random.default_rng(15)
    for sa, sb in [((2, 3), (3,)), ((3,), (2, 1, 3)), ((2, 1), (1, 4)), ((), (2, 2))]:
        a, b = rng.uniform(0.5, 1.5, sa), rng.uniform(0.5, 1.5, sb)
        da, db = sess.run(None, {"a": a, "b": b})
        out = np.broadcast_shapes(sa, sb)
        assert da.shape == sa and db.shape == sb
        np.testing.assert_allclose(da, np.full(sa, 2.0 * np.prod(out) / max(np.prod(sa), 1)))
        np.testing.assert_allclose(db, 0.0, atol=1e-12)


def test_emitted_names_are_prefixed_and_unique():
    rng = np.random.default_rng(9)
    feeds = {"x": rng.normal(size=(2, 3))}
    nodes = [helper.make_node("Tanh", ["x"], ["t"]), helper.make_node("Mul", ["t", "t"], ["y"])]
    model = gradient_model(nodes, feeds, "y", ["x"], name="step")
    # a second Gradient node with the same name
    g2 = helper.make_node("Gradient", ["x"], ["d2"], name="step", domain=DOMAIN, xs=["x"], y="t")
    model.graph.node.append(g2)
    model.graph.output.append(onnx.ValueInfoProto(name="d2"))
    expanded = runnable(model)
    original = {o for n in model.graph.node for o in n.output}
    outputs = [o for n in expanded.graph.node for o in n.output]
    assert len(outputs) == len(set(outputs))
    new = [o for o in outputs if o not in original]
    assert new and all(o.startswith(("step/grad/", "step_2/grad/")) for o in new)
    assert any(o.startswith("step_2/grad/") for o in new)
    got = session(expanded).run(["d_x", "d2"], feeds)
    t = np.tanh(feeds["x"])
    np.testing.assert_allclose(got[0], 2 * t * (1 - t * t), rtol=1e-12)
    np.testing.assert_allclose(got[1], 1 - t * t, rtol=1e-12)


# ----------------------------------------------------------------------------- subgraphs
def _body_with_gradient(out: str) -> onnx.GraphProto:
    """A branch computing d sum(x*x*w)/dx = 2 x w with x, w from the outer scope."""
    nodes = [helper.make_node("Mul", ["x", "x"], ["sq"]), helper.make_node("Mul", ["sq", "w"], ["s"]),
             helper.make_node("Gradient", ["x"], [out], name="inner", domain=DOMAIN,
                              xs=["x"], y="s")]
    return helper.make_graph(nodes, "branch", [],
                             [helper.make_tensor_value_info(out, TensorProto.DOUBLE, None)])


def test_gradient_inside_if_and_loop_bodies():
    rng = np.random.default_rng(10)
    x, w = rng.normal(size=(3,)), rng.normal(size=(3,))
    else_branch = helper.make_graph([helper.make_node("Neg", ["x"], ["e"])], "else", [],
                                    [helper.make_tensor_value_info("e", TensorProto.DOUBLE, None)])
    if_node = helper.make_node("If", ["c"], ["r"], then_branch=_body_with_gradient("dx"),
                               else_branch=else_branch)
    # Loop: v <- v + d sum(v*v)/dv = 3 v, two trips
    body_nodes = [helper.make_node("Mul", ["v", "v"], ["vv"]),
                  helper.make_node("Gradient", ["v"], ["dv"], name="loopgrad", domain=DOMAIN,
                                   xs=["v"], y="vv"),
                  helper.make_node("Add", ["v", "dv"], ["v_out"]),
                  helper.make_node("Identity", ["cond"], ["cond_out"])]
    body = helper.make_graph(body_nodes, "body", [
        helper.make_tensor_value_info("i", TensorProto.INT64, []),
        helper.make_tensor_value_info("cond", TensorProto.BOOL, []),
        helper.make_tensor_value_info("v", TensorProto.DOUBLE, [3])],
        [helper.make_tensor_value_info("cond_out", TensorProto.BOOL, []),
         helper.make_tensor_value_info("v_out", TensorProto.DOUBLE, [3])])
    loop = helper.make_node("Loop", ["trips", "", "x"], ["v_final"], body=body)
    graph = helper.make_graph(
        [if_node, loop], "g",
        [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [3]),
         helper.make_tensor_value_info("c", TensorProto.BOOL, [])],
        [helper.make_tensor_value_info("r", TensorProto.DOUBLE, None),
         helper.make_tensor_value_info("v_final", TensorProto.DOUBLE, None)],
        initializer=[numpy_helper.from_array(w, "w"), numpy_helper.from_array(np.int64(2), "trips")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(DOMAIN, 1)])
    expanded = runnable(model)
    assert _gradient_nodes(expanded.graph) == 0
    r, v = session(expanded).run(None, {"x": x, "c": np.asarray(True)})
    np.testing.assert_allclose(r, 2 * x * w, rtol=1e-12)
    np.testing.assert_allclose(v, 9 * x, rtol=1e-12)


def test_gradient_inside_scan_body():
    rng = np.random.default_rng(14)
    x = rng.normal(size=(4, 3))
    body = helper.make_graph(
        [helper.make_node("Mul", ["e", "e"], ["sq"]),
         helper.make_node("Gradient", ["e"], ["de"], name="scangrad", domain=DOMAIN,
                          xs=["e"], y="sq")],
        "body", [helper.make_tensor_value_info("e", TensorProto.DOUBLE, [3])],
        [helper.make_tensor_value_info("de", TensorProto.DOUBLE, [3])])
    scan = helper.make_node("Scan", ["x"], ["out"], body=body, num_scan_inputs=1)
    graph = helper.make_graph([scan], "g", [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 3])],
                              [helper.make_tensor_value_info("out", TensorProto.DOUBLE, None)])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18),
                                                    helper.make_opsetid(DOMAIN, 1)])
    expanded = runnable(model)
    assert _gradient_nodes(expanded.graph) == 0
    np.testing.assert_allclose(session(expanded).run(None, {"x": x})[0], 2 * x, rtol=1e-12)


def test_gradient_in_training_info_algorithm():
    """The algorithm graph differentiates the loss wrt a main-graph initializer."""
    rng = np.random.default_rng(11)
    W = rng.normal(size=(3, 2))
    main = helper.make_graph([helper.make_node("MatMul", ["x", "W"], ["p"])], "main",
                             [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 3])],
                             [helper.make_tensor_value_info("p", TensorProto.DOUBLE, [4, 2])],
                             initializer=[numpy_helper.from_array(W, "W")])
    alg_nodes = [helper.make_node("MatMul", ["x", "W"], ["p2"]),
                 helper.make_node("Mul", ["p2", "p2"], ["sq"]),
                 helper.make_node("ReduceSum", ["sq"], ["loss"], keepdims=0),
                 helper.make_node("Gradient", ["W"], ["dW"], name="grad", domain=DOMAIN,
                                  xs=["W"], y="loss"),
                 helper.make_node("Sub", ["W", "dW"], ["W_new"])]
    alg = helper.make_graph(alg_nodes, "algorithm",
                            [helper.make_tensor_value_info("x", TensorProto.DOUBLE, [4, 3])],
                            [helper.make_tensor_value_info("W_new", TensorProto.DOUBLE, [3, 2])])
    model = helper.make_model(main, opset_imports=[helper.make_opsetid("", 18),
                                                   helper.make_opsetid(DOMAIN, 1)])
    info = model.training_info.add()
    info.algorithm.CopyFrom(alg)
    info.update_binding.add(key="W", value="W_new")
    expanded = expand_gradient(model)
    assert _gradient_nodes(expanded.training_info[0].algorithm) == 0
    assert expanded.graph.SerializeToString() == model.graph.SerializeToString()
    # run the algorithm graph on its own (W as an initializer)
    g = onnx.GraphProto()
    g.CopyFrom(expanded.training_info[0].algorithm)
    g.initializer.extend(model.graph.initializer)
    runnable_alg = helper.make_model(g, opset_imports=[helper.make_opsetid("", 18)])
    runnable_alg.ir_version = 10
    x = rng.normal(size=(4, 3))
    (w_new,) = session(runnable_alg).run(None, {"x": x})
    np.testing.assert_allclose(w_new, W - 2 * x.T @ (x @ W), rtol=1e-12)


def test_expand_gradients_in_graph_directly():
    rng = np.random.default_rng(12)
    feeds = {"a": rng.normal(size=(2, 3)), "b": rng.normal(size=(3,))}
    model = gradient_model([helper.make_node("Mul", ["a", "b"], ["y"])], feeds, "y", ["a", "b"])
    for vi in (None, {v.name: v for v in model.graph.input}):
        graph = expand_gradients_in_graph(model.graph, 18, vi)
        assert _gradient_nodes(graph) == 0
        m = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
        m.ir_version = 10
        da, db = session(m).run(["d_a", "d_b"], feeds)
        np.testing.assert_allclose(da, np.broadcast_to(feeds["b"], (2, 3)))
        np.testing.assert_allclose(db, feeds["a"].sum(0))


# ----------------------------------------------------------------------------- errors
def _error(model) -> str:
    with pytest.raises(TrainingOpError) as info:
        expand_gradient(model)
    return str(info.value)


def test_error_y_not_reachable():
    feeds = {"a": np.ones(2), "b": np.ones(2)}
    model = gradient_model([helper.make_node("Exp", ["b"], ["y"])], feeds, "y", ["a"])
    msg = _error(model)
    assert "Gradient node 'grad'" in msg and "not reachable" in msg and "'y'" in msg


def test_error_xs_computed_from_other_xs():
    feeds = {"W": np.ones(2)}
    nodes = [helper.make_node("Exp", ["W"], ["H"]), helper.make_node("Mul", ["H", "W"], ["y"])]
    msg = _error(gradient_model(nodes, feeds, "y", ["H", "W"]))
    assert "Gradient node 'grad'" in msg and "'H'" in msg and "['W']" in msg
    assert "independent" in msg


def test_error_zs_computed_from_xs():
    feeds = {"W": np.ones(2)}
    nodes = [helper.make_node("Exp", ["W"], ["H"]), helper.make_node("Mul", ["H", "W"], ["y"])]
    msg = _error(gradient_model(nodes, feeds, "y", ["W"], zs=["H"]))
    assert "Gradient node 'grad'" in msg and "zs 'H' is computed from ['W']" in msg


@pytest.mark.parametrize("attr", ["y", "xs", "zs"])
def test_error_unknown_name(attr):
    feeds = {"a": np.ones(2), "b": np.ones(2)}
    model = gradient_model([helper.make_node("Mul", ["a", "b"], ["y"])], feeds, "y", ["a"],
                           zs=["b"])
    node = model.graph.node[-1]
    for a in node.attribute:
        if a.name == attr:
            if a.type == onnx.AttributeProto.STRING:
                a.s = b"nope"
            else:
                a.strings[0] = b"nope"
    msg = _error(model)
    assert "Gradient node 'grad'" in msg and f"{attr} ['nope'] not a value of the graph" in msg


def test_error_op_without_rule():
    feeds = {"x": np.eye(2)}
    nodes = [helper.make_node("Det", ["x"], ["e"], name="my_det"),
             helper.make_node("Relu", ["e"], ["y"])]
    msg = _error(gradient_model(nodes, feeds, "y", ["x"]))
    assert "Gradient node 'grad'" in msg and "Det" in msg and "'my_det'" in msg
    assert "Det x1 (first: 'my_det')" in msg and "supported_ops()" in msg


def test_error_lists_every_op_without_rule_at_once():
    """All rule-less ops on the path in one error (count, first node), not the first one
    met; a custom-domain op on the path is one of them, not a silent constant."""
    feeds = {"x": np.eye(2)}
    nodes = [helper.make_node("Det", ["x"], ["d"], name="det_a"),
             helper.make_node("Hardmax", ["x"], ["h"], name="hm_a"),
             helper.make_node("Hardmax", ["h"], ["h2"], name="hm_b"),
             helper.make_node("Custom", ["x"], ["c"], name="mine", domain="my.ops"),
             helper.make_node("Sum", ["d", "h2", "c", "x"], ["y"])]
    msg = _error(gradient_model(nodes, feeds, "y", ["x"]))
    assert "4 node(s) on the path from xs to y" in msg, msg
    for part in ("Hardmax x2 (first: 'hm_a')", "Det x1 (first: 'det_a')",
                 "my.ops::Custom x1 (first: 'mine')"):
        assert part in msg, msg


def test_error_hints_an_opset_that_avoids_the_op():
    feeds = {"x": np.ones((2, 3)), "s": np.ones(3)}
    nodes = [helper.make_node("RMSNormalization", ["x", "s"], ["y"], name="rms")]
    msg = _error(gradient_model(nodes, feeds, "y", ["x"], opset=23))
    assert "RMSNormalization x1 (first: 'rms')" in msg and "opset_version <= 22" in msg, msg


def test_error_wrong_input_count():
    feeds = {"a": np.ones(2), "b": np.ones(2)}
    model = gradient_model([helper.make_node("Mul", ["a", "b"], ["y"])], feeds, "y", ["a"],
                           zs=["b"], grad_inputs=["a"])
    msg = _error(model)
    assert "Gradient node 'grad'" in msg and "1 inputs" in msg and "1 + 1 = 2" in msg


@pytest.mark.parametrize("missing", ["y", "xs"])
def test_error_missing_attribute(missing):
    feeds = {"a": np.ones(2)}
    model = gradient_model([helper.make_node("Exp", ["a"], ["y"])], feeds, "y", ["a"])
    node = model.graph.node[-1]
    keep = [a for a in node.attribute if a.name != missing]
    del node.attribute[:]
    node.attribute.extend(keep)
    msg = _error(model)
    assert "Gradient node 'grad'" in msg and f"'{missing}'" in msg and "missing" in msg


def test_error_dropout_in_training_mode():
    feeds = {"x": np.ones(2), "mode": np.asarray(True)}
    nodes = [helper.make_node("Dropout", ["x", "", "mode"], ["y"], name="drop")]
    msg = _error(gradient_model(nodes, feeds, "y", ["x"]))
    assert "Gradient node 'grad'" in msg and "Dropout" in msg and "training mode" in msg


# ----------------------------------------------------------------------------- depth
def test_a_100_layer_mlp_expands_and_runs():
    """Its expansion time is measured by ``bench overhead`` (with the load), not here: a
    wall-clock bound fails on a loaded machine."""
    model = deep_mlp_gradient_model(layers=100, width=64)
    expanded = expand_gradient(model)
    expanded.ir_version = 10
    x = np.random.default_rng(13).normal(size=(8, 64)).astype(np.float32)
    grads = session(expanded).run(["d_W0", "d_b0", "d_W99"], {"x": x})
    assert grads[0].shape == (64, 64) and grads[2].shape == (64, 64)
    assert all(np.isfinite(g).all() for g in grads) and np.abs(grads[2]).max() > 0
