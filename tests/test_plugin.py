"""The onnxruntime-extensions bridge: dtypes, the invocation hook, coexistence with other PyOps."""

import numpy as np
import onnxruntime as ort
import pytest
from model_factory import optimizer_model
from onnx import TensorProto
from onnx import helper as h
from onnxruntime_extensions import PyCustomOpDef, onnx_op

import onnx_training_ops as ot
from onnx_training_ops.passes.encode_exact_attributes import EXACT_ATTRIBUTE, encode_attributes
from onnx_training_ops.runtime import plugin


@onnx_op(op_type="test.onnx_training_ops::ShoutStrings", inputs=[PyCustomOpDef.dt_string],
         outputs=[PyCustomOpDef.dt_string])
def shout_strings(texts):
    return np.array([t.upper() + "!" for t in texts.reshape(-1)], dtype=object).reshape(texts.shape)


def test_a_string_output_pyop_of_someone_else_still_works():
    node = h.make_node("ShoutStrings", ["s"], ["t"], domain="test.onnx_training_ops")
    graph = h.make_graph(
        [node], "g", [h.make_tensor_value_info("s", TensorProto.STRING, [2])],
        [h.make_tensor_value_info("t", TensorProto.STRING, [2])]
    )
    model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("test.onnx_training_ops", 1)])
    model.ir_version = 10
    session = ort.InferenceSession(model.SerializeToString(), ot.session_options(), providers=["CPUExecutionProvider"])
    (out,) = session.run(None, {"s": np.array(["ab", "cd"], dtype=object)})
    assert list(out) == ["AB!", "CD!"]


def _feeds(model, dtype, r_dtype, t=3):
    rng = np.random.default_rng(0)
    feeds = {}
    for value in model.graph.input:
        shape = [d.dim_value for d in value.type.tensor_type.shape.dim]
        feeds[value.name] = np.abs(rng.standard_normal(shape)).astype(dtype)
    feeds["R"] = np.array(0.01, r_dtype)
    feeds["T"] = np.array(t, np.int64)
    return feeds


@pytest.mark.parametrize("x_type, x_dtype", [(TensorProto.FLOAT, np.float32), (TensorProto.DOUBLE, np.float64)])
@pytest.mark.parametrize("r_type, r_dtype", [(TensorProto.FLOAT, np.float32), (TensorProto.DOUBLE, np.float64)])
@pytest.mark.parametrize("op_type", ["Adam", "Momentum", "Adagrad"])
def test_every_dtype_pair_runs_and_keeps_the_parameter_dtype(op_type, x_type, x_dtype, r_type, r_dtype):
    model = optimizer_model(op_type, n=2, shapes=[[4, 3], [5]], elem_type=x_type, r_type=r_type)
    feeds = _feeds(model, x_dtype, r_dtype)
    outputs = ot.InferenceSession(model).run(None, feeds)
    f32 = lambda v: float(np.float32(v))  # a model holds attributes as float32
    attrs = dict(alpha=f32(0.9), beta=f32(0.1), mode="standard", norm_coefficient=0.0) if op_type == "Momentum" else {}
    kernel = ot.kernels.REFERENCE_KERNELS[op_type]
    expected = kernel(feeds["R"], feeds["T"], *[feeds[i.name] for i in model.graph.input[2:]], **attrs)
    for got, want in zip(outputs, expected):
        assert got.dtype == x_dtype
        np.testing.assert_allclose(got, want, rtol=1e-6 if x_dtype == np.float32 else 1e-13)


def test_hook_hands_back_arrays_not_lists():
    plugin.register()
    opdef_id = next(iter(plugin._registered_ids))
    from onnxruntime_extensions._ocos import Opdef

    opdef = Opdef._odlist[opdef_id]
    n_in = len(opdef._nativedef.input_types)
    dtype = np.float32 if opdef._nativedef.input_types[2] == PyCustomOpDef.dt_float else np.float64
    feed = [np.array(0.1, dtype), np.array(0, np.int64)] + [np.ones(5, dtype) for _ in range(n_in - 2)]
    op_type = opdef.op_type.split("::")[1]
    attrs = {"alpha": 0.9, "beta": 0.5, "mode": "standard", "norm_coefficient": 0.0} if op_type == "Momentum" else {}
    text = encode_attributes({**ot.schema.OPTIMIZERS[op_type].defaults, **attrs, "node": "n"})
    result = plugin._hook(opdef_id, feed, {EXACT_ATTRIBUTE: text})
    assert result[0] == opdef_id
    assert all(isinstance(r, np.ndarray) for r in result[2::2])


def test_register_is_idempotent():
    before = set(plugin._registered_ids)
    plugin.register()
    assert plugin._registered_ids == before
    assert len(before) == 3 * 4  # three ops, {float, double} for R and for X


def test_session_options_can_extend_given_options():
    so = ort.SessionOptions()
    so.intra_op_num_threads = 1
    assert ot.session_options(so) is so


def test_options_registered_twice_still_create_sessions():
    so = ot.session_options()
    assert ot.session_options(so) is so
    for _ in range(2):  # InferenceSession registers again on the same options
        ot.InferenceSession(optimizer_model("Adam"), sess_options=so)


def test_registration_from_many_threads_at_once_registers_each_kernel_once():
    """Sessions opened in several threads at once: the PyOp kernels are registered once, complete,
    before any of them runs (a second registration of an op makes onnxruntime refuse every
    session: "Conflicting with a registered kernel"). In a fresh process: registration is once
    per process."""
    import subprocess
    import sys

    code = (
        "import threading\n"
        "from onnx_training_ops.runtime import plugin\n"
        "from onnx_training_ops.schema import OPTIMIZERS\n"
        "barrier = threading.Barrier(8)\n"
        "def go():\n"
        "    barrier.wait()\n"
        "    plugin.register()\n"
        "threads = [threading.Thread(target=go) for _ in range(8)]\n"
        "[t.start() for t in threads]\n"
        "[t.join() for t in threads]\n"
        "assert len(plugin._registered_ids) == 4 * len(OPTIMIZERS), len(plugin._registered_ids)\n"
        "print('once')\n"
    )
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0 and run.stdout.strip() == "once", run.stderr[-2000:]
