"""prepare(): what it rewrites, what it leaves alone, and the errors for invalid graphs."""

import numpy as np
import onnx
import pytest
from model_factory import DOMAIN, optimizer_model
from onnx import TensorProto
from onnx import helper as h

import onnx_training_ops as ot
from onnx_training_ops.passes.encode_exact_attributes import EXACT_ATTRIBUTE, decode_attributes
from onnx_training_ops.passes.fit_runtime import runtime_limits


def domain_nodes(model):
    """The optimizer nodes: in the training domain (PyOp path) or in ai.onnx.contrib (native path)."""
    return [n for n in model.graph.node if n.domain in (DOMAIN, "ai.onnx.contrib")]


def test_multi_tensor_node_is_split_per_tensor():
    prepared = ot.prepare(optimizer_model("Adam", n=3), kernels="pyop")  # native nodes stay whole
    nodes = domain_nodes(prepared)
    assert len(nodes) == 3
    assert list(nodes[1].input) == ["R", "T", "X1", "G1", "V1", "H1"]
    assert list(nodes[1].output) == ["X1_new", "V1_new", "H1_new"]


@pytest.mark.parametrize("kernels", ["pyop", "native"])
def test_defaults_are_filled_from_the_schema(kernels):
    node = domain_nodes(ot.prepare(optimizer_model("Adagrad"), kernels=kernels))[0]
    attrs = {a.name: h.get_attribute_value(a) for a in node.attribute}
    assert attrs["decay_factor"] == 0.0
    assert attrs["epsilon"] == pytest.approx(1e-6)
    assert attrs["norm_coefficient"] == 0.0


def test_exact_attributes_hold_the_float32_values():
    model = optimizer_model("Adam", attributes=dict(alpha=0.123456789))
    node = domain_nodes(ot.prepare(model, kernels="pyop"))[0]  # the PyOp path's attribute
    exact = decode_attributes(next(a.s.decode() for a in node.attribute if a.name == EXACT_ATTRIBUTE))
    assert exact["alpha"] == float(np.float32(0.123456789))
    assert exact["alpha"] != 0.123457
    assert exact["node"] == "opt"


def test_ir_version_and_opset_fit_onnxruntime():
    model = optimizer_model("Adam", opsets=[h.make_opsetid("", onnx.defs.onnx_opset_version()),
                                            h.make_opsetid(DOMAIN, 1)])
    assert model.ir_version == onnx.IR_VERSION
    prepared = ot.prepare(model)
    max_ir, max_opset = runtime_limits()
    assert prepared.ir_version <= max_ir
    assert {o.domain: o.version for o in prepared.opset_import}[""] <= max_opset
    ot.InferenceSession(prepared)  # loads


@pytest.mark.parametrize("kernels,domain", [("pyop", DOMAIN), ("native", "ai.onnx.contrib")])
def test_missing_domain_import_is_added(kernels, domain):
    model = optimizer_model("Momentum", opsets=[h.make_opsetid("", 17)])
    prepared = ot.prepare(model, kernels=kernels)
    assert {o.domain: o.version for o in prepared.opset_import}[domain] == 1


def test_prepare_is_idempotent_and_takes_paths_and_bytes(tmp_path):
    model = optimizer_model("Adam", n=2)
    once = ot.prepare(model)
    assert ot.prepare(once) == once
    path = tmp_path / "m.onnx"
    onnx.save(model, path)
    assert ot.prepare(path) == once
    assert ot.prepare(str(path)) == once
    assert ot.prepare(model.SerializeToString()) == once


def test_prepare_does_not_modify_its_argument():
    model = optimizer_model("Adam", n=2)
    before = model.SerializeToString()
    ot.prepare(model)
    assert model.SerializeToString() == before


def test_other_domains_are_untouched():
    model = optimizer_model("Momentum")
    extra = h.make_node("Relu", ["X0_new"], ["relu"], name="relu")
    custom = h.make_node("Foo", ["relu"], ["foo"], name="foo", domain="com.example", bar=1.25)
    model.graph.node.extend([extra, custom])
    prepared = ot.prepare(model)
    assert prepared.graph.node[-2] == extra
    assert prepared.graph.node[-1] == custom


@pytest.mark.parametrize("kernels", ["pyop", "native"])
def test_empty_output_names_get_fresh_names(kernels):
    model = optimizer_model("Adam", n=2)
    node = model.graph.node[0]
    node.output[2] = ""  # V0_new unused
    del model.graph.output[2]
    prepared = ot.prepare(model, kernels=kernels)
    outputs = [o for n in domain_nodes(prepared) for o in n.output]
    assert all(outputs) and len(set(outputs)) == 6
    session = ot.InferenceSession(model, kernels=kernels)
    feeds = {i.name: np.ones([d.dim_value for d in i.type.tensor_type.shape.dim], np.float32)
             for i in model.graph.input}
    feeds["T"] = np.array(0, np.int64)
    assert len(session.run(None, feeds)) == 5


def test_nodes_inside_if_branches_are_prepared_and_run():
    inner = optimizer_model("Momentum", attributes=dict(alpha=0.5, beta=1.0, mode="nesterov", norm_coefficient=0.0))
    then_graph = h.make_graph(list(inner.graph.node), "then", [],
                              [h.make_tensor_value_info("X0_new", TensorProto.FLOAT, None)])
    else_graph = h.make_graph([h.make_node("Identity", ["X0"], ["X_same"])], "else", [],
                              [h.make_tensor_value_info("X_same", TensorProto.FLOAT, None)])
    cond = h.make_tensor_value_info("cond", TensorProto.BOOL, [])
    node = h.make_node("If", ["cond"], ["Y"], then_branch=then_graph, else_branch=else_graph)
    graph = h.make_graph([node], "g", [cond, *inner.graph.input],
                         [h.make_tensor_value_info("Y", TensorProto.FLOAT, None)])
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)])
    session = ot.InferenceSession(model)
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(3, np.int64), "X0": np.ones(3, np.float32),
             "G0": np.full(3, 2, np.float32), "V0": np.ones(3, np.float32), "cond": np.array(True)}
    expected = ot.kernels.momentum(feeds["R"], feeds["T"], feeds["X0"], feeds["G0"], feeds["V0"],
                                   alpha=0.5, beta=1.0, mode="nesterov", norm_coefficient=0.0)[0]
    np.testing.assert_array_equal(session.run(None, feeds)[0], expected)
    bad = onnx.ModelProto()
    bad.CopyFrom(model)
    then_branch = next(a.g for a in bad.graph.node[0].attribute if a.name == "then_branch")
    next(a for a in then_branch.node[0].attribute if a.name == "mode").s = b"heavy-ball"
    with pytest.raises(ot.TrainingOpError, match="mode"):
        ot.prepare(bad)


# --- invalid graphs: one test per class of error, each message names the node ---------------


@pytest.mark.parametrize(
    "model, pattern",
    [
        (optimizer_model("Adam", n=1, n_outputs=2), r"Adam node 'opt'.*expected 3 outputs.*found 2"),
        (optimizer_model("Momentum", n=2, n_outputs=5), r"Momentum node 'opt'.*expected 4 outputs.*found 5"),
    ],
    ids=["adam-outputs", "momentum-outputs"],
)
def test_wrong_output_count(model, pattern):
    with pytest.raises(ot.TrainingOpError, match=pattern):
        ot.prepare(model)


def test_wrong_input_count():
    model = optimizer_model("Adam", n=1)
    model.graph.node[0].input.append("X0")
    with pytest.raises(ot.TrainingOpError, match=r"Adam node 'opt'.*expected 2 \+ 4\*N inputs.*found 7"):
        ot.prepare(model)


@pytest.mark.parametrize(
    "kwargs, pattern",
    [
        (dict(r_shape=(2,)), r"Adam node 'opt'.*'R'.*float or double scalar.*found float of shape \[2\]"),
        (dict(r_type=TensorProto.INT64), r"'R'.*found int64"),
        (dict(r_shape=(1, 1)), r"'R'.*shape \[\] or \[1\].*\[1, 1\]"),
        (dict(t_type=TensorProto.INT32), r"Adam node 'opt'.*'T'.*int64 scalar.*found int32"),
        (dict(t_shape=(3,)), r"'T'.*found int64 of shape \[3\]"),
    ],
    ids=["R-shape", "R-int", "R-rank2", "T-int32", "T-shape"],
)
def test_r_and_t_must_be_scalars(kwargs, pattern):
    with pytest.raises(ot.TrainingOpError, match=pattern):
        ot.prepare(optimizer_model("Adam", **kwargs))


def test_r_and_t_of_shape_one_are_accepted():
    ot.prepare(optimizer_model("Adagrad", r_shape=(1,), t_shape=(1,)))


def test_dtypes_within_a_tensor_group_must_agree():
    model = optimizer_model("Adam", n=2, types={"V1": TensorProto.DOUBLE})
    with pytest.raises(ot.TrainingOpError,
                       match=r"Adam node 'opt'.*tensor 1 must share one dtype.*V1 \('V1'\) is double"):
        ot.prepare(model)


def test_integer_parameters_are_rejected():
    model = optimizer_model("Adagrad", elem_type=TensorProto.INT32)
    with pytest.raises(ot.TrainingOpError, match=r"Adagrad node 'opt'.*X0.*float or double, found int32"):
        ot.prepare(model)


def test_shapes_that_do_not_broadcast():
    model = optimizer_model("Adam", n=1, shapes=[[3, 4]])
    model.graph.input[3].type.tensor_type.shape.dim[1].dim_value = 5  # G0: [3, 5]
    with pytest.raises(ot.TrainingOpError,
                       match=r"Adam node 'opt'.*broadcast to the shape of X0 \[3, 4\].*G0 \[3, 5\]"):
        ot.prepare(model)


def test_gradient_broadcasting_to_x_is_accepted():
    model = optimizer_model("Adam", n=1, shapes=[[3, 4]])
    model.graph.input[3].type.tensor_type.shape.dim[0].dim_value = 1  # G0: [1, 4]
    ot.prepare(model)


@pytest.mark.parametrize("missing", ["alpha", "beta", "mode", "norm_coefficient"])
def test_momentum_requires_its_attributes(missing):
    attrs = dict(alpha=0.9, beta=0.1, mode="standard", norm_coefficient=0.0)
    del attrs[missing]
    with pytest.raises(ot.TrainingOpError, match=rf"Momentum node 'opt'.*missing required attribute.*'{missing}'"):
        ot.prepare(optimizer_model("Momentum", attributes=attrs))


def test_momentum_mode_must_be_standard_or_nesterov():
    attrs = dict(alpha=0.9, beta=0.1, mode="Nesterov", norm_coefficient=0.0)
    with pytest.raises(ot.TrainingOpError, match=r"Momentum node 'opt'.*'standard' or 'nesterov', found 'Nesterov'"):
        ot.prepare(optimizer_model("Momentum", attributes=attrs))


def test_unknown_attribute_and_wrong_attribute_type():
    with pytest.raises(ot.TrainingOpError, match=r"Adam node 'opt'.*unknown attribute 'gamma'"):
        ot.prepare(optimizer_model("Adam", attributes=dict(gamma=0.1)))
    with pytest.raises(ot.TrainingOpError, match=r"Adam node 'opt'.*'alpha' must be FLOAT, found INT"):
        ot.prepare(optimizer_model("Adam", attributes=dict(alpha=1)))


def test_unknown_op_of_the_domain():
    model = optimizer_model("Adam")
    model.graph.node[0].op_type = "AdamW"
    with pytest.raises(ot.TrainingOpError, match=r"AdamW node 'opt'.*unknown op of domain ai.onnx.preview.training"):
        ot.prepare(model)


def test_errors_are_value_errors():
    assert issubclass(ot.TrainingOpError, ValueError)


# The PyOp path's messages also say what was found; the native kernels' are fixed texts.
RUN_TIME_ERRORS = {
    "pyop": (r"Momentum node 'opt': input 'R'.*found float32 of shape \[2\]",
             r"Momentum node 'opt': tensor 0: shapes must broadcast"),
    "native": (r"Momentum node 'opt': input 'R' must be a float32/float64 scalar of shape \[\] or \[1\]",
               r"Momentum node 'opt': the shapes of G, V must broadcast to the shape of 'X'"),
}


@pytest.mark.parametrize("kernels", ["pyop", "native"])
def test_run_time_errors_name_the_node_and_do_not_crash(kernels):
    model = optimizer_model("Momentum", shapes=[None], r_shape=None)
    model.graph.input[0].type.tensor_type.ClearField("shape")
    session = ot.InferenceSession(model, kernels=kernels)
    feeds = {"R": np.array([0.1, 0.2], np.float32), "T": np.array(1, np.int64),
             "X0": np.ones(3, np.float32), "G0": np.ones(3, np.float32), "V0": np.ones(3, np.float32)}
    rate_error, shape_error = RUN_TIME_ERRORS[kernels]
    with pytest.raises(ot.TrainingOpError, match=rate_error):
        session.run(None, feeds)
    feeds["R"] = np.array(0.1, np.float32)
    feeds["G0"] = np.ones(4, np.float32)
    with pytest.raises(ot.TrainingOpError, match=shape_error):
        session.run(None, feeds)
    feeds["G0"] = np.ones(3, np.float32)
    np.testing.assert_allclose(session.run(None, feeds)[0], np.full(3, 0.9, np.float32))
