"""The native kernels (onnx_training_ops.runtime.native): layout, path selection, results, errors.

Every result test runs the same models through both kernel paths, forced with
``prepare(..., kernels=...)``, and wants the reference kernels' outputs bit for bit (both
paths run the fused kernels' arithmetic, which matches numpy operation by operation).
"""

from __future__ import annotations

import ctypes
import logging
import os
import subprocess
import sys

import numpy as np
import onnxruntime as ort
import pytest
from hypothesis import given
from hypothesis import strategies as st
from model_factory import optimizer_model, single_node_model
from test_kernels_property import SESSION, VARIANT_IDS, VARIANTS, cases

import onnx_training_ops as ot
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.passes.target_native import NATIVE_OP_TYPES
from onnx_training_ops.runtime import custom_op, native, options
from onnx_training_ops.schema import DOMAIN

PATHS = ("native", "pyop")
pytestmark = pytest.mark.skipif(not native.availability()[0], reason=f"native kernels: {native.availability()[1]}")


# ---------------------------------------------------------------- layout and start-up checks


def test_custom_op_struct_layout_matches_the_c_api():
    # uint32_t version, padding, then 25 function pointers in the header's order
    assert native.OrtCustomOp.version.offset == 0
    assert native.OrtCustomOp.CreateKernel.offset == 8
    assert native.OrtCustomOp.KernelCompute.offset == 8 + 7 * 8
    assert native.OrtCustomOp.CreateKernelV2.offset == 8 + 16 * 8
    assert native.OrtCustomOp.KernelComputeV2.offset == 8 + 17 * 8
    assert native.OrtCustomOp.ReleaseAliasMap.offset == 8 + 24 * 8
    assert ctypes.sizeof(native.OrtCustomOp) == 8 + 25 * 8
    assert custom_op.OP_VERSION <= native._api_version()


def test_api_table_checked_on_the_live_pointer():
    ot.InferenceSession(optimizer_model("Adam"), kernels="native")
    assert custom_op._checked_apis  # the CreateStatus/GetErrorCode/GetErrorMessage round trip passed


def test_native_ops_land_in_the_contrib_domain():
    prepared = ot.prepare(optimizer_model("Adam", n=3), kernels="native")
    nodes = list(prepared.graph.node)
    assert [(n.domain, n.op_type) for n in nodes] == [("ai.onnx.contrib", "TrainingAdam")]  # one node, 3 tensors
    assert len(nodes[0].input) == 2 + 4 * 3 and len(nodes[0].output) == 3 * 3
    assert "exact_attributes" not in {a.name for a in nodes[0].attribute}
    assert any(o.domain == "ai.onnx.contrib" for o in prepared.opset_import)
    # distinct from the PyOps' names: the extensions library loops forever on a clash
    assert not set(NATIVE_OP_TYPES.values()) & {"Adam", "Momentum", "Adagrad"}


def test_pyop_path_is_unchanged():
    prepared = ot.prepare(optimizer_model("Adam", n=3), kernels="pyop")
    assert [(n.domain, n.op_type) for n in prepared.graph.node] == [(DOMAIN, "Adam")] * 3


def test_environment_variable_forces_a_path(monkeypatch):
    monkeypatch.setenv(options.KERNELS_ENV, "pyop")
    assert ot.prepare(optimizer_model("Adagrad")).graph.node[0].domain == DOMAIN
    monkeypatch.setenv(options.KERNELS_ENV, "native")
    assert ot.prepare(optimizer_model("Adagrad")).graph.node[0].domain == "ai.onnx.contrib"
    assert ot.prepare(optimizer_model("Adagrad"), kernels="pyop").graph.node[0].domain == DOMAIN  # argument wins
    monkeypatch.setenv(options.KERNELS_ENV, "fast")
    with pytest.raises(TrainingOpError, match="'native', 'pyop' or 'auto'"):
        ot.prepare(optimizer_model("Adagrad"))


def test_unavailable_native_falls_back_with_one_log_line(monkeypatch, caplog):
    monkeypatch.setattr(native, "_availability", (False, "simulated mismatch"))
    monkeypatch.setattr(options, "_announced", set())
    monkeypatch.delenv(options.KERNELS_ENV, raising=False)
    with caplog.at_level(logging.INFO, logger="onnx_training_ops.runtime.options"):
        for _ in range(2):
            assert ot.prepare(optimizer_model("Adam")).graph.node[0].domain == DOMAIN
    lines = [r.getMessage() for r in caplog.records]
    assert lines == ["onnx_training_ops: optimizer kernels: pyop (native unavailable: simulated mismatch)"]
    with pytest.raises(TrainingOpError, match="simulated mismatch"):
        ot.prepare(optimizer_model("Adam"), kernels="native")


# ---------------------------------------------------------------- results


@pytest.mark.parametrize("kernels", PATHS)
@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
@SESSION
@given(data=st.data())
def test_session_matches_reference_kernel_bitwise(kernels, op_type, mode, data):
    case = data.draw(cases(op_type, mode, max_tensors=3))
    model, feed, outputs = single_node_model(op_type, case.r, case.t, case.groups, case.attributes)
    before = {k: np.copy(v) for k, v in feed.items()}
    got = ot.InferenceSession(model, kernels=kernels).run(outputs, feed)
    for name, o, e in zip(outputs, got, case.kernel()):
        assert o.dtype == e.dtype and o.shape == e.shape, name
        np.testing.assert_array_equal(o, e, err_msg=f"{kernels} {name}")
    for k, v in feed.items():  # the caller's feeds are never written
        np.testing.assert_array_equal(v, before[k], err_msg=k)


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
def test_large_tensors_split_over_the_thread_pool(op_type, mode, dtype):
    n = 3 * native.CHUNK + 17  # parallel path, ragged last chunk
    rng = np.random.default_rng(3)
    groups = [tuple(rng.random(shape).astype(dtype) for _ in range(4 if op_type == "Adam" else 3))
              for shape in [(n,), (5, 7)]]
    # float32-exact values: the node holds float32 attributes
    attributes = dict(alpha=0.5, beta=0.25, mode=mode, norm_coefficient=0.0625) if op_type == "Momentum" else {}
    r, t = np.array(0.01, dtype), np.array(7, np.int64)
    model, feed, outputs = single_node_model(op_type, r, t, groups, attributes)
    so = ort.SessionOptions()
    so.intra_op_num_threads = 2
    got = ot.InferenceSession(model, so, kernels="native").run(outputs, feed)
    expected = ot.kernels.REFERENCE_KERNELS[op_type](r, t, *[g[j] for j in range(len(groups[0])) for g in groups],
                                                      **attributes)
    for name, o, e in zip(outputs, got, expected):
        np.testing.assert_array_equal(o, e, err_msg=name)


@pytest.mark.parametrize("n", [16, 200_000])
@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
def test_iobinding_same_value_in_and_out_updates_in_place(op_type, mode, n):
    """The documented way to update state in place: bind one OrtValue as input and output."""
    attributes = dict(alpha=0.5, beta=0.25, mode=mode, norm_coefficient=0.0625) if op_type == "Momentum" else None
    sess = ot.InferenceSession(optimizer_model(op_type, shapes=[[n]], attributes=attributes), kernels="native")
    groups = {"Adam": "XGVH", "Momentum": "XGV", "Adagrad": "XGH"}[op_type]
    rng = np.random.default_rng(0)
    state = {k: rng.random(n, dtype=np.float32) for k in groups}
    r, t = np.array(0.1, np.float32), np.array(2, np.int64)
    expected = ot.kernels.REFERENCE_KERNELS[op_type](r, t, *state.values(), **(attributes or {}))
    values = {k: ort.OrtValue.ortvalue_from_numpy(a) for k, a in state.items()}
    binding = sess.io_binding()
    binding.bind_cpu_input("R", r)
    binding.bind_cpu_input("T", t)
    for k, v in values.items():
        binding.bind_ortvalue_input(f"{k}0", v)
    updated = [k for k in groups if k != "G"]
    for k in updated:
        binding.bind_ortvalue_output(f"{k}0_new", values[k])
    sess.run_with_iobinding(binding)
    for k, e in zip(updated, expected):
        np.testing.assert_array_equal(state[k], e, err_msg=k)  # the numpy arrays behind the OrtValues


@pytest.mark.parametrize("kernels", PATHS)
def test_conformance_passes_on_each_path(kernels, monkeypatch):
    from onnx_training_ops.conformance import run_conformance

    monkeypatch.setenv(options.KERNELS_ENV, kernels)
    results = run_conformance()
    assert [r.name for r in results if not r.passed] == []
    assert len(results) == 9


# ---------------------------------------------------------------- errors


def _feeds(op_type="Adam", n=3, dtype=np.float32):
    groups = {"Adam": "XGVH", "Momentum": "XGV", "Adagrad": "XGH"}[op_type]
    return {"R": np.array(0.1, np.float32), "T": np.array(1, np.int64),
            **{f"{g}0": np.ones(n, dtype) for g in groups}}


@pytest.mark.parametrize(
    "change,message",
    [
        ({"R": np.ones(2, np.float32)}, "input 'R' must be a float32/float64 scalar"),
        ({"T": np.ones((1, 1), np.int64)}, "input 'T' must be an int64 scalar"),
        ({"G0": np.ones(4, np.float32)}, "must broadcast to the shape of 'X'"),
        ({"X0": np.ones(1, np.float32)}, "must broadcast to the shape of 'X'"),
    ],
)
def test_errors_come_back_as_status_naming_the_node(change, message):
    model = optimizer_model("Adam", name="my_adam")
    for value in model.graph.input:  # any shape reaches the kernel
        value.type.tensor_type.ClearField("shape")
    sess = ot.InferenceSession(model, kernels="native")
    with pytest.raises(TrainingOpError, match=f"Adam node 'my_adam': .*{message}"):
        sess.run(None, {**_feeds(), **change})
    np.testing.assert_array_equal(sess.run(None, _feeds())[0].shape, (3,))  # the session still works


def test_invalid_mode_fails_session_creation_naming_the_node():
    model = ot.prepare(optimizer_model("Momentum", name="m"), kernels="native")
    for attribute in model.graph.node[0].attribute:
        if attribute.name == "mode":
            attribute.s = b"sideways"
    from onnx_training_ops.runtime.options import session_options

    with pytest.raises(Exception, match="Momentum node 'm': attribute 'mode' must be 'standard' or 'nesterov'"):
        ort.InferenceSession(model.SerializeToString(), session_options(), providers=["CPUExecutionProvider"])


def test_plain_onnxruntime_session_runs_a_prepared_model():
    model = ot.prepare(optimizer_model("Adagrad", n=2), kernels="native")
    sess = ort.InferenceSession(model.SerializeToString(), ot.session_options(), providers=["CPUExecutionProvider"])
    feeds = {"R": np.array(0.5, np.float32), "T": np.array(0, np.int64)}
    feeds.update({f"{g}{i}": np.full(3, 1.0 + i, np.float32) for g in "XGH" for i in range(2)})
    got = sess.run(None, feeds)
    expected = ot.kernels.adagrad(feeds["R"], feeds["T"], *[feeds[f"{g}{i}"] for g in "XGH" for i in range(2)])
    for o, e in zip(got, expected):
        np.testing.assert_array_equal(o, e)


def test_first_session_in_a_fresh_process_compiles_nothing_and_only_what_it_uses():
    """numba's disk cache serves the cfuncs: a new process loads them (compiling took ~15 s).
    Checked by numba's cache-hit counters, not a clock; the second process is the one that
    counts (the first may fill an empty cache). Only the kernels of the model's ops and dtypes
    are compiled or loaded: Adam's float32 loop, not its float64 one, Momentum's nor the
    backward kernels."""
    code = (
        "import numpy as np, onnx_training_ops as ot\n"
        "from model_factory import optimizer_model\n"
        "s = ot.InferenceSession(optimizer_model('Adam'), kernels='native')\n"
        "s.run(None, {'R': np.array(0.1, np.float32), 'T': np.array(1, np.int64),"
        " **{k + '0': np.ones(3, np.float32) for k in 'XGVH'}})\n"
        "from onnx_training_ops.kernels import _native_kernels as nk, _native_grad_kernels as gk, _ort_api\n"
        "used = (nk.adam_f32, nk.optimizer_compute, _ort_api.kernel_compute, _ort_api.kernel_destroy)\n"
        "unused = (nk.adam_f64, nk.momentum_f32, gk.im2col_compute, gk.cross_entropy_grad_compute)\n"
        "print([f.cache_hits for f in used], [f.compiled for f in unused])\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([os.getcwd(), os.path.dirname(__file__)])}
    for _ in range(2):
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, check=True)
    assert out.stdout.split("\n")[-2] == "[1, 1, 1, 1] [None, None, None, None]", out.stdout


@pytest.mark.parametrize("op_type,mode", VARIANTS, ids=VARIANT_IDS)
def test_shapes_read_through_the_older_api_too(op_type, mode, monkeypatch):
    """onnxruntime < 1.24 lacks GetTensorElementTypeAndShapeDataReference: the kernels then
    read shapes with GetTensorTypeAndShape (forced here)."""
    monkeypatch.setattr(custom_op, "USE_SHAPE_REFERENCE", False)
    rng = np.random.default_rng(5)
    k = 4 if op_type == "Adam" else 3
    groups = [tuple(rng.random((2, 3)) for _ in range(k)),
              (rng.random((4,)),) + tuple(rng.random(shape) for shape in [(1,), (4,), ()][:k - 1])]
    attributes = dict(alpha=0.5, beta=0.25, mode=mode, norm_coefficient=0.0) if op_type == "Momentum" else {}
    r, t = np.array(0.5), np.array(3, np.int64)
    model, feed, outputs = single_node_model(op_type, r, t, groups, attributes)
    got = ot.InferenceSession(model, kernels="native").run(outputs, feed)
    expected = ot.kernels.REFERENCE_KERNELS[op_type](r, t, *[g[j] for j in range(k) for g in groups], **attributes)
    for name, o, e in zip(outputs, got, expected):
        np.testing.assert_array_equal(o, e, err_msg=name)
