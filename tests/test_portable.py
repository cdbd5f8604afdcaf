"""The portable form (issue 10, part 3): ``prepare(model, portable=True)`` lowers every optimizer
node to standard ONNX ops, so the model runs in any onnxruntime and in onnx.reference.

The lowering writes the spec's formulas a second time (as graph ops): every test here holds it
against the reference kernels (``onnx_training_ops.kernels``), the oracle.
"""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_factory import DOMAIN, optimizer_model, single_node_model
from onnx import TensorProto, helper
from onnx.reference import ReferenceEvaluator
from test_kernels_property import SESSION, VARIANT_IDS, VARIANTS, assert_within, cases, check_own_outputs, spec_outputs

import onnx_training_ops as ot
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.passes import PORTABLE_PASSES
from onnx_training_ops.runtime.pipeline import prepare
from onnx_training_ops.walk import model_graphs

ATTRIBUTES = {  # every attribute away from its default
    "Adam": dict(alpha=0.8, beta=0.95, epsilon=1e-3, norm_coefficient=0.02, norm_coefficient_post=0.01),
    "Momentum": dict(alpha=0.9, beta=0.3, mode="standard", norm_coefficient=0.01),
    "Nesterov": dict(alpha=0.9, beta=0.3, mode="nesterov", norm_coefficient=0.01),
    "Adagrad": dict(decay_factor=0.1, epsilon=1e-3, norm_coefficient=0.02),
}


def f32_attributes(attributes: dict) -> dict:
    """The attributes as a model holds them (float32), as the kernels take them."""
    return {k: float(np.float32(v)) if isinstance(v, float) else v for k, v in attributes.items()}


def portable_session(model) -> ort.InferenceSession:
    """A plain onnxruntime session: no custom-op library, no plugin."""
    return ort.InferenceSession(prepare(model, portable=True).SerializeToString(), providers=["CPUExecutionProvider"])


def feeds_for(model, dtype, t, r_dtype=np.float32, seed=0):
    rng = np.random.default_rng(seed)
    feeds = {}
    for value in model.graph.input[2:]:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = np.asarray(np.abs(rng.standard_normal(shape)) + (0.1 if value.name[0] == "H" else 0.0),
                                       dtype)
    feeds["R"] = np.array(0.05, r_dtype)
    feeds["T"] = np.array(t, np.int64)
    return feeds


def kernel_outputs(op_type, model, feeds, attributes):
    kernel = ot.kernels.REFERENCE_KERNELS[op_type]
    return kernel(feeds["R"], feeds["T"], *[feeds[i.name] for i in model.graph.input[2:]],
                  **f32_attributes(attributes))


def test_no_node_of_the_domain_is_left_and_the_domain_is_not_imported():
    for name, attributes in ATTRIBUTES.items():
        op_type = "Momentum" if name == "Nesterov" else name
        groups = [[np.ones(shape, np.float32)] * len(ot.schema.OPTIMIZERS[op_type].tensor_inputs)
                  for shape in ((3, 2), (4,), ())]
        model, _, _ = single_node_model(op_type, np.float32(0.1), np.int64(1), groups, attributes)
        portable = prepare(model, portable=True)
        assert all(n.domain in ("", "ai.onnx") for g in model_graphs(portable) for n in g.node)
        assert DOMAIN not in {o.domain for o in portable.opset_import}
        onnx.checker.check_model(portable, full_check=True)


@pytest.mark.parametrize("t", [0, 5])
@pytest.mark.parametrize("dtype, elem", [(np.float32, TensorProto.FLOAT), (np.float64, TensorProto.DOUBLE)])
@pytest.mark.parametrize("name", sorted(ATTRIBUTES))
def test_multi_tensor_nodes_equal_the_reference_kernels_in_onnxruntime_and_onnx_reference(name, dtype, elem, t):
    op_type = "Momentum" if name == "Nesterov" else name
    model = optimizer_model(op_type, n=3, shapes=[[4, 3], [5], []], elem_type=elem, attributes=ATTRIBUTES[name])
    feeds = feeds_for(model, dtype, t)
    want = kernel_outputs(op_type, model, feeds, ATTRIBUTES[name])
    portable = prepare(model, portable=True)
    got_ort = ort.InferenceSession(portable.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    got_ref = ReferenceEvaluator(portable).run(None, feeds)
    for got in (got_ort, got_ref):
        for g, w in zip(got, want):
            assert g.dtype == w.dtype and g.shape == w.shape
            if t == 0:  # no pow: the same operations in the same order, bit for bit
                np.testing.assert_array_equal(g, w)
            else:  # libm's pow may differ by an ulp in float64 before the rate is rounded
                np.testing.assert_allclose(g, w, rtol=4 * np.finfo(dtype).eps, atol=4 * np.finfo(dtype).eps)


@pytest.mark.parametrize("r_dtype", [np.float32, np.float64])
def test_mixed_r_and_x_dtypes_scalar_shapes_and_broadcasting(r_dtype):
    x = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    groups = [(x, np.full(4, 0.3, np.float32), np.full((1, 4), 0.1, np.float32), np.full((), 0.2, np.float32)),
              (np.float32(1.5) * np.ones((), np.float32),) * 3 + (np.ones((), np.float32),)]
    r = np.array([0.1], r_dtype)  # shape [1]
    t = np.array([7], np.int64)
    model, feed, outputs = single_node_model("Adam", r, t, groups, ATTRIBUTES["Adam"])
    got = portable_session(model).run(outputs, feed)
    want = ot.kernels.adam(r, t, *[a for a in feed.values()][2:], **f32_attributes(ATTRIBUTES["Adam"]))
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=4e-7, atol=1e-7)


@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
@SESSION
@given(data=st.data())
def test_portable_form_matches_the_reference_kernel(op_type, mode, data):
    """Shapes () to rank 4 with broadcasting, float32/float64 (R in either), T == 0 and T > 0,
    1..3 tensors per node, drawn attributes (some left to their defaults)."""
    case = data.draw(cases(op_type, mode, max_tensors=3))
    model, feed, outputs = single_node_model(op_type, case.r, case.t, case.groups, case.attributes)
    portable = prepare(model, portable=True)
    got = ort.InferenceSession(portable.SerializeToString(), providers=["CPUExecutionProvider"]).run(outputs, feed)
    check_own_outputs(case, got)
    expected = case.kernel()
    for name, o, e, bound in zip(outputs, got, expected, spec_outputs(case)):
        assert_within(o, e, bound, case.dtype, f"{name} (portable form vs reference kernel)")
    if data.draw(st.booleans(), label="also onnx.reference"):
        with np.errstate(all="ignore"):
            evaluated = ReferenceEvaluator(portable).run(outputs, feed)
        check_own_outputs(case, evaluated)
        for name, o, e, bound in zip(outputs, evaluated, expected, spec_outputs(case)):
            assert_within(o, e, bound, case.dtype, f"{name} (portable form in onnx.reference vs reference kernel)")


CHILD = """
import json, sys
import numpy as np
import onnx
import onnxruntime as ort
from onnx.reference import ReferenceEvaluator

data = np.load(sys.argv[2])
model = onnx.load(sys.argv[1])
n_feeds = int(data["n_feeds"])
feeds = {str(data[f"feed_name_{i}"]): data[f"feed_{i}"] for i in range(n_feeds)}
n_out = int(data["n_outputs"])
worst = {}
for engine in ("onnxruntime", "onnx.reference"):
    if engine == "onnxruntime":
        got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, feeds)
    else:
        got = ReferenceEvaluator(model).run(None, feeds)
    for k in range(n_out):
        want, allowed = data[f"want_{k}"], data[f"allowed_{k}"]
        assert got[k].dtype == want.dtype and got[k].shape == want.shape, (engine, k, got[k].dtype, got[k].shape)
        excess = np.max(np.abs(got[k].astype(np.float64) - want) - allowed, initial=-np.inf)
        assert excess <= 0, (engine, k, excess)
        worst[engine] = max(worst.get(engine, 0.0), float(np.max(np.abs(got[k].astype(np.float64) - want), initial=0)))
absent = [m for m in ("onnxruntime_extensions", "onnx_training_ops") if m in sys.modules]
assert not absent, absent
print(json.dumps({"ok": True, "worst": worst, "modules_absent": True}))
"""


@pytest.mark.parametrize("name", sorted(ATTRIBUTES))
def test_a_process_that_never_imports_the_plugin_runs_the_portable_form(name, tmp_path):
    op_type = "Momentum" if name == "Nesterov" else name
    results = []
    for dtype, elem in [(np.float32, TensorProto.FLOAT), (np.float64, TensorProto.DOUBLE)]:
        for t in (0, 3):
            model = optimizer_model(op_type, n=2, shapes=[[6, 5], [7]], elem_type=elem, attributes=ATTRIBUTES[name])
            feeds = feeds_for(model, dtype, t)
            want = kernel_outputs(op_type, model, feeds, ATTRIBUTES[name])
            eps = np.finfo(dtype).eps
            arrays = {"n_feeds": len(feeds), "n_outputs": len(want)}
            for i, (k, v) in enumerate(feeds.items()):
                arrays[f"feed_name_{i}"], arrays[f"feed_{i}"] = np.array(k), v
            for k, w in enumerate(want):  # float32 (float64) rounding: a few ulps of the value
                arrays[f"want_{k}"] = w
                arrays[f"allowed_{k}"] = 4 * eps * (np.abs(w.astype(np.float64)) + 1.0)
            path = tmp_path / f"{name}_{elem}_{t}.onnx"
            onnx.save(prepare(model, portable=True), path)
            np.savez(tmp_path / f"{name}_{elem}_{t}.npz", **arrays)
            script = tmp_path / "child.py"
            script.write_text(textwrap.dedent(CHILD))
            done = subprocess.run([sys.executable, str(script), str(path), str(tmp_path / f"{name}_{elem}_{t}.npz")],
                                  cwd=tmp_path, capture_output=True, text=True, timeout=120)
            assert done.returncode == 0, done.stderr
            results.append(json.loads(done.stdout.strip().splitlines()[-1]))
    assert all(r["ok"] and r["modules_absent"] for r in results)


def test_prepare_portable_is_idempotent_and_leaves_the_input_untouched():
    model = optimizer_model("Adam", n=2)
    before = model.SerializeToString()
    once = prepare(model, portable=True)
    assert model.SerializeToString() == before
    assert prepare(once, portable=True).SerializeToString() == once.SerializeToString()
    # a model prepared for the plugin (split nodes, exact_attributes) lowers too
    assert not any(n.domain == DOMAIN for n in prepare(prepare(model), portable=True).graph.node)


def test_portable_passes_name_the_lowering():
    assert [name for name, _ in PORTABLE_PASSES][-2:] == ["lower_optimizers", "fit_runtime"]


def test_unused_outputs_cost_no_ops():
    full = prepare(optimizer_model("Adam", n=1), portable=True)
    model = optimizer_model("Adam", n=1)
    node = model.graph.node[0]
    node.output[1] = ""  # V_new and H_new unused: only X_new is wanted
    node.output[2] = ""
    del model.graph.output[1:]
    lowered = prepare(model, portable=True)
    assert len(lowered.graph.node) == len(full.graph.node)  # X_new needs V_new and H_new...
    node.output[0] = ""  # ...but with X_new unused the H_sqrt, step, X_new ops go
    node.output[1] = "V0_new"
    model.graph.output[0].name = "V0_new"
    assert len(prepare(model, portable=True).graph.node) < len(full.graph.node)


def test_errors_name_the_node_and_the_input():
    old = optimizer_model("Adam", opsets=[helper.make_opsetid("", 8), helper.make_opsetid(DOMAIN, 1)])
    with pytest.raises(TrainingOpError, match=r"Adam node 'opt'.*opset >= 9.*imports 8"):
        prepare(old, portable=True)
    mixed = optimizer_model("Adagrad", types={"G0": TensorProto.DOUBLE})
    with pytest.raises(TrainingOpError, match=r"Adagrad node 'opt'"):
        prepare(mixed, portable=True)


def test_a_node_inside_an_if_branch_is_lowered():
    inner = optimizer_model("Momentum", n=1, attributes=ATTRIBUTES["Nesterov"])
    body = helper.make_graph(list(inner.graph.node), "then", [], list(inner.graph.output))
    other = helper.make_graph([helper.make_node("Identity", ["X0"], ["X0_new"]),
                               helper.make_node("Identity", ["V0"], ["V0_new"])], "else", [],
                              list(inner.graph.output))
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    node = helper.make_node("If", ["cond"], ["X_out", "V_out"], then_branch=body, else_branch=other)
    graph = helper.make_graph([node], "g", list(inner.graph.input) + [cond],
                              [helper.make_tensor_value_info(o, TensorProto.FLOAT, None) for o in ("X_out", "V_out")])
    model = helper.make_model(graph, opset_imports=list(inner.opset_import))
    feeds = feeds_for(inner, np.float32, 2)
    got = portable_session(model).run(None, {**feeds, "cond": np.array(True)})
    want = kernel_outputs("Momentum", inner, feeds, ATTRIBUTES["Nesterov"])
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-6)


@pytest.mark.parametrize("optimizer", [ot.Adam(lr=0.01, weight_decay=0.01),
                                       ot.Momentum(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
                                       ot.Adagrad(lr=0.05, lr_decay=0.1, weight_decay=0.01)],
                         ids=["adam", "nesterov", "adagrad"])
def test_a_training_model_trains_the_same_in_portable_form(optimizer):
    """The training_info algorithm (Gradient already expanded) lowered: TrainingSession runs it
    with nothing of this package's kernels, and takes the same steps as the plugin path."""
    from onnx import numpy_helper

    rng = np.random.default_rng(0)
    w = numpy_helper.from_array(rng.standard_normal((4, 3)).astype(np.float32), "W")
    b = numpy_helper.from_array(np.zeros(3, np.float32), "b")
    graph = helper.make_graph([helper.make_node("Gemm", ["x", "W", "b"], ["y"])], "linear",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3])], [w, b])
    inference = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    training = ot.build_training_model(inference, "mse", optimizer)
    portable = prepare(training, portable=True)
    assert all(n.domain in ("", "ai.onnx") for g in model_graphs(portable) for n in g.node)
    x = rng.standard_normal((8, 4)).astype(np.float32)
    target = rng.standard_normal((8, 3)).astype(np.float32)
    plugin = ot.TrainingSession(training, fast=False)
    lowered = [ot.TrainingSession(portable, fast=False), ot.TrainingSession(portable)]  # nothing to cut out
    for _ in range(3):
        a = plugin.step({"x": x, "target": target})
        for session in lowered:
            c = session.step({"x": x, "target": target})
            assert sorted(a) == sorted(c)
            for k in a:
                np.testing.assert_allclose(c[k], a[k], rtol=1e-6)
    want = plugin.state_dict()
    for session in lowered:
        got = session.state_dict()
        assert sorted(want) == sorted(got)
        for name in want:
            np.testing.assert_allclose(got[name], want[name], rtol=1e-6, atol=1e-7, err_msg=name)


def test_x_of_unknown_dtype_gets_castlike_constants():
    """X from an op without a schema (so no inferred type): the constants are CastLike'd to X."""
    from onnx.reference.op_run import OpRun

    class Passthrough(OpRun):
        op_domain = "test.custom"

        def _run(self, x):
            return (x,)

    model = optimizer_model("Adam", n=1, shapes=[[5]], attributes=ATTRIBUTES["Adam"],
                            opsets=[helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1),
                                    helper.make_opsetid("test.custom", 1)])
    feeds = feeds_for(model, np.float64, 4)
    want = kernel_outputs("Adam", model, feeds, ATTRIBUTES["Adam"])
    graph = model.graph
    for value in graph.input[2:]:
        graph.node.insert(0, helper.make_node("Passthrough", [value.name + "_raw"], [value.name], domain="test.custom"))
        feeds[value.name + "_raw"] = feeds.pop(value.name)
        value.name += "_raw"
        value.type.tensor_type.elem_type = TensorProto.DOUBLE
    lowered = prepare(model, portable=True)
    assert any(n.op_type == "CastLike" for n in lowered.graph.node)
    got = ReferenceEvaluator(lowered, new_ops=[Passthrough]).run(None, feeds)
    for g, w in zip(got, want):
        assert g.dtype == w.dtype
        np.testing.assert_allclose(g, w, rtol=1e-12)


@pytest.mark.parametrize("attributes", [dict(alpha=0.5, beta=6.2e-10),
                                        dict(alpha=1e-9, beta=0.5, norm_coefficient_post=1e-9)])
def test_float64_constants_that_round_to_one_in_float32_survive_onnxruntimes_optimizer(attributes):
    """onnxruntime's NoopElimination drops Mul(x, c) when float(c) == 1, also for double c:
    (1 - 6.2e-10) * G² became G² (found by the property test)."""
    groups = [(np.array(0.0), np.array(1.0), np.array(0.0), np.array(0.0)), (np.zeros((2, 2)),) * 4]
    model, feed, outputs = single_node_model("Adam", np.array(1.0, np.float32), np.array(3), groups, attributes)
    got = portable_session(model).run(outputs, feed)
    want = ot.kernels.adam(feed["R"], feed["T"], *list(feed.values())[2:], **f32_attributes(attributes))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
