"""Models past protobuf's 2 GB and the memory a session holds (issue 21): external data end
to end, one copy of each tensor, no optimizer node in the fast path's onnxruntime graph.

Large models are made cheaply: ``ONNX_TRAINING_OPS_LARGE_MODEL_BYTES`` (the size past which a
model's tensors leave the protobuf message) is lowered, so an MLP of a few hundred KB takes
the path a multi-GB model takes.
"""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_training_ops import Adam, AdamW, TrainingOpError, TrainingSession, build_training_model, prepare
from onnx_training_ops.autodiff.native_ops import ALL as NATIVE_GRAD_OPS
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.storage import LargeModel, checkpoint, data_files, load_model, save_model
from onnx_training_ops.storage.tensors import is_constant_fill, location

SIZES = (64, 256, 4)  # W0 64 KB, W1 4 KB: big next to a 32 KB threshold


@pytest.fixture
def large(monkeypatch):
    monkeypatch.setenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", str(32 * 1024))


def _batch(seed=0, n=16):
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((n, SIZES[0])).astype(np.float32),
            "labels": rng.integers(0, SIZES[-1], n).astype(np.int64)}


def _exported(tmp_path, external: bool) -> str:
    path = str(tmp_path / "mlp.onnx")
    onnx.save(make_mlp(SIZES), path, save_as_external_data=external, location="mlp.onnx.data",
              size_threshold=1024)
    return path


def _losses(session, steps=3):
    return [float(session.step(_batch(i))["loss"]) for i in range(steps)]


@pytest.mark.parametrize("optimizer", [Adam(lr=1e-2), AdamW(lr=1e-2, weight_decay=0.1)],
                         ids=["adam", "adamw"])
def test_fast_path_graph_holds_no_optimizer_node(optimizer):
    """AdamW's decay Mul in front of the Adam node is folded into the in-place update; the
    node itself must leave the graph onnxruntime runs (it used to stay, computing and
    allocating X, V and H anew every step for nothing)."""
    session = TrainingSession(build_training_model(make_mlp((8, 16, 4)), "cross_entropy", optimizer))
    session.step({"input": np.ones((4, 8), np.float32), "labels": np.arange(4)})
    for program in session._programs.steps:
        ran = program.session.prepared_model.graph
        optimizers = [n.op_type for n in ran.node if n.domain and n.op_type not in NATIVE_GRAD_OPS]
        assert not optimizers, "an optimizer node is still in the graph"
        assert not program.uses_plugin
        assert not [o.name for o in ran.output if o.name.endswith(".new") and o.name != "optimizer.T.new"]


@pytest.mark.parametrize("external", [True, False], ids=["external_data", "inline"])
def test_a_large_file_opens_memory_mapped(tmp_path, large, external):
    """Its big tensors stay in the file (external data, or the .onnx itself), mapped, not read."""
    path = _exported(tmp_path, external)
    opened = load_model(path, large=True)
    assert isinstance(opened, LargeModel)
    want = {t.name: onnx.numpy_helper.to_array(t) for t in make_mlp(SIZES).graph.initializer}
    for tensor in opened.model_proto.graph.initializer:
        array = opened.array(tensor)
        assert np.array_equal(array, want[tensor.name])
        if array.nbytes >= 1024:
            assert isinstance(array, np.memmap) and location(tensor).startswith("#")
    assert opened.model_proto.ByteSize() < 4096  # the message is the graph only


def test_build_gives_a_large_model_whose_optimizer_state_takes_no_memory(tmp_path, large):
    training = build_training_model(_exported(tmp_path, True), "cross_entropy", AdamW(lr=1e-2))
    assert isinstance(training, LargeModel)
    algorithm = training.model_proto.training_info[0].algorithm
    moments = [t for t in algorithm.initializer if t.name.endswith((".V", ".H"))]
    assert len(moments) == 8 and all(is_constant_fill(training.array(t)) for t in moments if location(t))
    assert training.model_proto.ByteSize() < 16 * 1024


def test_large_and_inline_paths_train_bit_identically(tmp_path, large, monkeypatch):
    """The same model trained from a large file (memory-mapped weights, detached state) and
    as a small in-memory ModelProto: the same losses and weights, bit for bit, on the fast
    path and the full graph."""
    big = TrainingSession(build_training_model(_exported(tmp_path, True), "cross_entropy", AdamW(lr=1e-2)))
    full = TrainingSession(build_training_model(_exported(tmp_path, True), "cross_entropy", AdamW(lr=1e-2)),
                           fast=False)
    monkeypatch.delenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES")
    small = TrainingSession(build_training_model(make_mlp(SIZES), "cross_entropy", AdamW(lr=1e-2)))
    assert _losses(big) == _losses(small) == _losses(full)
    for name in small.state_names:
        assert np.array_equal(big.state_dict()[name], small.state_dict()[name]), name


def test_checkpoint_with_external_data_resumes_bit_exact(tmp_path, large):
    session = TrainingSession(build_training_model(_exported(tmp_path, True), "cross_entropy", Adam(lr=1e-2)))
    _losses(session, 2)
    path = str(tmp_path / "ckpt" / "checkpoint.onnx")
    session.save(path)
    files = data_files(path)
    assert len(files) == 1 and os.path.getsize(path) < 16 * 1024
    # X, V and H once each: the data file is their bytes, page-aligned, nothing twice
    tensors = sum(v.nbytes for v in session.state_dict().values() if v.nbytes >= 1024)
    assert tensors <= os.path.getsize(files[0]) < tensors + 4096 * 7
    resumed = TrainingSession(path)
    assert _losses(resumed, 2) == _losses(session, 2)
    for name, value in session.state_dict().items():
        assert np.array_equal(resumed.state_dict()[name], value), name
    session.save(path)  # a new version replaces the old data file
    assert len(data_files(path)) == 1 and data_files(path) != files


def test_damaged_external_data_is_named(tmp_path, large):
    session = TrainingSession(build_training_model(_exported(tmp_path, True), "cross_entropy", Adam(lr=1e-2)))
    session.step(_batch())
    path = str(tmp_path / "checkpoint.onnx")
    session.save(path)
    data = data_files(path)[0]
    with open(data, "r+b") as f:  # one byte of the first tensor, W0
        f.seek(100)
        byte = f.read(1)
        f.seek(100)
        f.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(TrainingOpError, match="tensor 'W0' does not match its checksum"):
        TrainingSession(path)
    os.truncate(data, 1000)
    with pytest.raises(TrainingOpError, match="truncated"):
        TrainingSession(path)


def test_a_crash_mid_save_leaves_the_previous_checkpoint(tmp_path, large, monkeypatch):
    """Before the message is replaced (the commit) the old version is whole; the orphan data
    file of the failed save goes with the next save."""
    session = TrainingSession(build_training_model(_exported(tmp_path, True), "cross_entropy", Adam(lr=1e-2)))
    path = str(tmp_path / "checkpoint.onnx")
    session.save(path)
    before = TrainingSession(path).state_dict()
    session.step(_batch())
    from onnx_training_ops.storage import save as save_module

    commit = save_module.atomic_write

    def crash(path, data, **kwargs):  # the data file is written, the message never replaced
        if callable(data):
            return commit(path, data, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(save_module, "atomic_write", crash)
    with pytest.raises(KeyboardInterrupt):
        session.save(path)
    assert len(data_files(path)) == 2  # the old one and the orphan
    after_crash = TrainingSession(path).state_dict()
    assert all(np.array_equal(after_crash[k], v) for k, v in before.items())
    monkeypatch.setattr(save_module, "atomic_write", commit)
    session.save(path)
    assert len(data_files(path)) == 1
    assert all(np.array_equal(TrainingSession(path).state_dict()[k], v) for k, v in session.state_dict().items())


_WRITER = """
import sys
from onnx_training_ops import TrainingSession
session = TrainingSession(sys.argv[1])
print("ready", flush=True)
while True:
    session.save(sys.argv[2])
"""


def test_a_writer_killed_at_random_never_leaves_a_torn_checkpoint(tmp_path, large):
    """A process saving in a loop, killed: the checkpoint loads and is one of the versions."""
    source = str(tmp_path / "source.onnx")
    session = TrainingSession(build_training_model(_exported(tmp_path, True), "cross_entropy", Adam(lr=1e-2)))
    session.step(_batch())
    session.save(source)
    target = str(tmp_path / "target.onnx")
    env = {**os.environ, "ONNX_TRAINING_OPS_LARGE_MODEL_BYTES": str(32 * 1024)}
    for delay in (0.05, 0.2):
        proc = subprocess.Popen([sys.executable, "-c", _WRITER, source, target], env=env,
                                stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "ready"
        try:
            proc.wait(timeout=delay)
        except subprocess.TimeoutExpired:
            proc.kill()
        proc.wait()
        if os.path.exists(target):
            loaded = TrainingSession(target).state_dict()
            assert all(np.array_equal(loaded[k], v) for k, v in session.state_dict().items())


def test_export_with_external_data_runs_in_plain_onnxruntime(tmp_path, large):
    session = TrainingSession(build_training_model(_exported(tmp_path, True), "cross_entropy", Adam(lr=1e-2)))
    _losses(session, 2)
    path = str(tmp_path / "out" / "inference.onnx")
    exported = session.export_inference_model(path)
    assert isinstance(exported, LargeModel) and data_files(path)
    x = _batch(5)["input"]
    plain = ort.InferenceSession(path, providers=["CPUExecutionProvider"])
    assert np.array_equal(plain.run(None, {"input": x})[0], session.run(None, {"input": x})[0])


def test_prepare_and_the_cli_keep_tensors_out_of_the_message(tmp_path, large):
    training = build_training_model(_exported(tmp_path, True), "cross_entropy", Adam(lr=1e-2))
    prepared = prepare(training)
    assert isinstance(prepared, LargeModel) and prepared.model_proto.ByteSize() < 32 * 1024
    source = str(tmp_path / "training.onnx")
    save_model(training, source)
    out = str(tmp_path / "prepared.onnx")
    env = {**os.environ, "ONNX_TRAINING_OPS_LARGE_MODEL_BYTES": str(32 * 1024)}
    subprocess.run([sys.executable, "-m", "onnx_training_ops", "prepare", source, out], check=True, env=env,
                   capture_output=True)
    assert data_files(out) and os.path.getsize(out) < 32 * 1024


def test_frozen_weights_get_no_optimizer_state_and_stay_mapped(tmp_path, large):
    """Only W1, b1 train: W0 (frozen) has no V, H or gradient, and reaches onnxruntime as the
    memory map of the file (no copy)."""
    training = build_training_model(_exported(tmp_path, True), "cross_entropy", Adam(lr=1e-2),
                                    trainable=["W1", "b1"])
    session = TrainingSession(training)
    session.step(_batch())
    assert sorted(session.state_names) == sorted(["W1", "b1", "W1.V", "b1.V", "W1.H", "b1.H", "optimizer.T"])
    outputs = {o.name for p in session._programs.steps for o in p.session.prepared_model.graph.output}
    assert not [o for o in outputs if o.startswith("W0")]
    assert isinstance(session._store.model.array(next(t for t in session._store.model.model_proto.graph.initializer
                                                  if t.name == "W0")), np.memmap)
    ran = session._programs.steps[0].session.prepared_model.graph  # bound as an input: onnxruntime copies initializers
    assert "W0" in {i.name for i in ran.input} and "W0" not in {t.name for t in ran.initializer}


def test_a_checkpoint_of_a_small_model_stays_one_file(tmp_path):
    session = TrainingSession(build_training_model(make_mlp(SIZES), "cross_entropy", Adam(lr=1e-2)))
    path = str(tmp_path / "checkpoint.onnx")
    session.save(path)
    assert not data_files(path) and isinstance(session.training_model(), onnx.ModelProto)
    checkpoint.verify(onnx.load(path), path)


def test_gradients_are_written_into_the_kernels_buffers_from_the_first_step():
    """No step allocates gradients: onnxruntime writes them into the flat G buffer of the
    fused kernel from the first run on."""
    session = TrainingSession(build_training_model(make_mlp((8, 16, 4)), "cross_entropy", Adam(lr=1e-2)))
    program = session._programs.steps[0]
    buffers = {name: view.__array_interface__["data"][0] for name, view in program.prebound.items()}
    assert sorted(buffers) == ["W0.grad", "W1.grad", "b0.grad", "b1.grad"]
    session.step({"input": np.ones((4, 8), np.float32), "labels": np.arange(4)})
    outputs = program.io._iobinding.get_outputs()
    names = program.analysis.returned + program.analysis.fixed_outputs
    for name, address in buffers.items():
        assert outputs[names.index(name)].data_ptr() == address


def test_a_gradient_that_only_broadcasts_to_its_parameter_still_trains():
    """A hand-written Adam whose G is [2] for X [3, 2]: the preallocated [3, 2] buffer is
    refused on the first run and given back; the step matches the full graph."""
    from onnx import TensorProto, helper

    names = ["R", "T", "X1", "X2", "G1", "G2", "V1", "V2", "H1", "H2"]
    adam = helper.make_node("Adam", names, ["X1n", "X2n", "V1n", "V2n", "H1n", "H2n"],
                            domain="ai.onnx.preview.training")
    vi = lambda n, s: helper.make_tensor_value_info(n, TensorProto.FLOAT, s)  # noqa: E731
    inputs = [vi("R", []), helper.make_tensor_value_info("T", TensorProto.INT64, []), vi("g", [2])]
    inputs += [vi(n, [3, 2]) for n in ["X1", "X2", "V1", "V2", "H1", "H2"]]
    graph = helper.make_graph([helper.make_node("Relu", ["g"], ["G1"]), helper.make_node("Neg", ["g"], ["G2"]),
                               adam], "g", inputs, [vi(o, [3, 2]) for o in adam.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.preview.training", 1)])
    init = {n: np.full((3, 2), 0.5, np.float32) for n in ["X1", "X2"]}
    init |= {n: np.zeros((3, 2), np.float32) for n in ["V1", "V2", "H1", "H2"]}
    feedback = {"X1n": "X1", "X2n": "X2", "V1n": "V1", "V2n": "V2", "H1n": "H1", "H2n": "H2"}
    feed = {"g": np.array([1.0, 2.0], np.float32), "R": np.array(0.1, np.float32), "T": np.array(1, np.int64)}
    fast = TrainingSession.from_graph(model, feedback, initial_state=init)
    full = TrainingSession.from_graph(model, feedback, initial_state=init, fast=False)
    for _ in range(2):
        fast.step(feed)
        full.step(feed)
    assert fast.fast_path_nodes and not fast._programs.steps[0].prebound
    for name in init:
        assert np.array_equal(fast.state_dict()[name], full.state_dict()[name]), name


def test_a_transposed_frozen_weight_is_one_copy(tmp_path, large):
    """torch's Linear is MatMul(x, Transpose(W)): prepare folds the transpose of a frozen,
    memory-mapped weight into one transposed array (onnxruntime would keep both)."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    w = rng.standard_normal((32, 300)).astype(np.float32)  # [out, in], 38 KB
    graph = helper.make_graph(
        [helper.make_node("Transpose", ["W"], ["Wt"], perm=[1, 0]), helper.make_node("MatMul", ["x", "Wt"], ["y"])],
        "linear", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2, 300])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [2, 32])], [numpy_helper.from_array(w, "W")])
    path = str(tmp_path / "linear.onnx")
    onnx.save(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]), path,
              save_as_external_data=True, location="linear.onnx.data")
    prepared = prepare(path)
    assert [n.op_type for n in prepared.model_proto.graph.node] == ["MatMul"]
    (key, array), = prepared.large_initializers.items()
    assert array.shape == (300, 32) and np.array_equal(array, w.T) and not isinstance(array, np.memmap)
    x = rng.standard_normal((2, 300)).astype(np.float32)
    from onnx_training_ops import InferenceSession

    np.testing.assert_allclose(InferenceSession(path).run(None, {"x": x})[0], x @ w.T, rtol=1e-5, atol=1e-5)


def test_sessions_share_one_arena_unless_options_say_otherwise():
    from onnx_training_ops.training.options.options import SHARED_ARENA_CONFIG, fresh_options, shared_arena

    assert shared_arena() and shared_arena()  # registered once; asking again is harmless
    (key, value), = SHARED_ARENA_CONFIG.items()
    assert fresh_options(None, {}).get_session_config_entry(key) == value
    large = fresh_options(None, {}, large=True)  # a large model's sessions too (no fresh pages a step)
    assert large.enable_cpu_mem_arena and large.get_session_config_entry(key) == value
    # the caller's options left at onnxruntime's defaults get the shared arena too (issue 29); what
    # they set rules: the entry itself, or no arena at all
    assert fresh_options(ort.SessionOptions(), {}).get_session_config_entry(key) == value
    mine = ort.SessionOptions()
    mine.add_session_config_entry(key, "0")
    assert fresh_options(mine, {}).get_session_config_entry(key) == "0"
    no_arena = ort.SessionOptions()
    no_arena.enable_cpu_mem_arena = False
    with pytest.raises(RuntimeError, match="does not have configuration"):  # not set
        fresh_options(no_arena, {}).get_session_config_entry(key)
    # sessions on the shared arena train as one on its own arena does
    model = build_training_model(make_mlp(SIZES), "cross_entropy", AdamW(lr=1e-2, weight_decay=0.01))
    shared, first, own = TrainingSession(model), TrainingSession(model), TrainingSession(model, sess_options=mine)
    assert _losses(shared) == _losses(own) == _losses(first)
