"""Faults and rough edges (issue 9): Ctrl-C, errors owned by the run that raised them, one
session shared by threads, damaged checkpoints, bad learning rates, big-endian feeds."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import numpy as np
import onnx
import pytest
from model_factory import optimizer_model

from onnx_training_ops import Adam, InferenceSession, TrainingOpError, TrainingSession, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.runtime.plugin import MAX_RECORDS, take_kernel_errors
from onnx_training_ops.storage import checkpoint

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _training_model():
    return build_training_model(make_mlp((16, 32, 4), seed=7), "cross_entropy", Adam(lr=5e-3))


def _batch(seed=0):
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((8, 16)).astype(np.float32),
            "labels": rng.integers(0, 4, 8).astype(np.int64)}


# ------------------------------------------------------------------ Ctrl-C
CHILD = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    import onnx_training_ops as ot
    from model_factory import optimizer_model
    from onnx_training_ops.demo import make_mlp
    kind = sys.argv[1]
    if kind == "graph":
        model = optimizer_model("Adam", shapes=[[1_000_000]])
        session = ot.InferenceSession(model)
        feed = {{"R": np.array(0.1, np.float32), "T": np.array(0, np.int64)}}
        feed.update({{k: np.ones(1_000_000, np.float32) for k in ("X0", "G0", "V0", "H0")}})
        def work():
            session.run(None, feed)
        def check():
            out = session.run(None, feed)[0]
            assert np.isfinite(out).all()
    else:
        training = ot.build_training_model(make_mlp((256, 1024, 4), seed=1), "cross_entropy",
                                           ot.Adam(lr=1e-3))
        session = ot.TrainingSession(training, fast=(kind == "fast"))
        rng = np.random.default_rng(0)
        batch = {{"input": rng.standard_normal((64, 256)).astype(np.float32),
                 "labels": rng.integers(0, 4, 64).astype(np.int64)}}
        done = [0]
        def work():
            session.step(batch)
            done[0] += 1
        def check():
            state = session.state_dict()
            t = int(next(v for k, v in state.items() if k.endswith("optimizer.T")))
            # a Ctrl-C landing while the state is written lets that step complete (and count)
            assert done[0] <= t <= done[0] + 3, (t, done[0])
            assert all(np.isfinite(v).all() for v in state.values())
            work()
    import signal
    # Python's own Ctrl-C handler, whatever the child inherited: a shell's background job starts
    # with SIGINT ignored (the test then hung, Ctrl-C never arriving, when make test ran in one)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    work()  # the first call compiles what it needs (numba, cold cache): before any Ctrl-C is sent
    print("ready", flush=True)
    interrupts = 0
    while interrupts < 3:
        try:
            work()
        except KeyboardInterrupt:
            interrupts += 1
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent may still be sending
    check()
    print("interrupted", interrupts, flush=True)
""")


@pytest.mark.parametrize("kind", ["graph", "plugin", "fast"])
def test_ctrl_c_raises_keyboard_interrupt_and_the_session_stays_usable(kind):
    script = CHILD.format(tests=os.path.join(ROOT, "tests"))
    proc = subprocess.Popen([sys.executable, "-c", script, kind], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, cwd=ROOT)
    assert proc.stdout.readline().strip() == "ready"
    try:
        deadline = time.monotonic() + 120  # Ctrl-C until the child has taken three and ended
        while proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.15)
            proc.send_signal(signal.SIGINT)
        out, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, (proc.returncode, err[-2000:])
    assert "interrupted 3" in out


# ------------------------------------------------------------------ errors belong to their run
def _failing_feed():
    """X has 3 elements, G 4: the kernel cannot broadcast them (declared shapes are dynamic)."""
    feed = {"R": np.array(0.1, np.float32), "T": np.array(0, np.int64), "X0": np.ones(3, np.float32),
            "G0": np.ones(4, np.float32), "V0": np.ones(3, np.float32),
            "H0": np.ones(3, np.float32)}
    good = dict(feed, G0=np.ones(3, np.float32))
    return optimizer_model("Adam", shapes=[None]), feed, good


def test_kernel_errors_belong_to_the_thread_and_run_that_raised_them():
    model, bad, good = _failing_feed()
    outcomes = {"bad_raised": 0, "good_raised": 0}
    lock = threading.Lock()

    def worker(feed, key, n=60):
        session = InferenceSession(model)
        for _ in range(n):
            try:
                session.run(None, feed)
            except TrainingOpError:
                with lock:
                    outcomes[key] += 1

    threads = [threading.Thread(target=worker, args=(bad, "bad_raised")),
               threading.Thread(target=worker, args=(good, "good_raised"))]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert outcomes == {"bad_raised": 60, "good_raised": 0}


def test_plain_onnxruntime_sessions_report_through_take_kernel_errors_and_never_pile_up():
    import onnxruntime as ort

    from onnx_training_ops import prepare, session_options
    model, bad, good = _failing_feed()
    # PyOp path: a failing kernel returns NaN (a plain session raises nothing); the native
    # kernels return an OrtStatus instead, which a plain session raises (tests/test_native.py)
    session = ort.InferenceSession(prepare(model, kernels="pyop").SerializeToString(), session_options(),
                                   providers=["CPUExecutionProvider"])
    take_kernel_errors()
    out = session.run(None, bad)[0]
    assert np.isnan(out).all()
    errors = take_kernel_errors()
    assert len(errors) == 1 and "node 'opt'" in str(errors[0])
    for _ in range(3 * MAX_RECORDS):
        session.run(None, bad)
    assert len(take_kernel_errors()) == MAX_RECORDS
    session.run(None, good)
    assert take_kernel_errors() == []


# ------------------------------------------------------------------ one session, many threads
def test_a_shared_training_session_loses_no_step_and_saves_no_torn_checkpoint(tmp_path):
    session = TrainingSession(_training_model())
    paths = []

    def stepper():
        for i in range(150):
            session.step(_batch(i))

    def saver():
        for i in range(8):
            path = tmp_path / f"c{i}.onnx"
            session.save(path)
            paths.append(path)

    threads = [threading.Thread(target=stepper), threading.Thread(target=stepper),
               threading.Thread(target=saver)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert int(session.state_dict()["optimizer.T"]) == 300
    for path in paths:
        resumed = TrainingSession(str(path))  # verifies the checksums
        state = resumed.state_dict()
        assert 0 <= int(state["optimizer.T"]) <= 300


# ------------------------------------------------------------------ checkpoints
def test_every_single_bit_flip_of_a_checkpoint_is_caught(tmp_path):
    session = TrainingSession(_training_model())
    session.step(_batch())
    path = tmp_path / "ckpt.onnx"
    session.save(path)
    data = path.read_bytes()
    rng = np.random.default_rng(0)
    for k, position in enumerate(rng.choice(len(data), 24, replace=False)):
        damaged = bytearray(data)
        damaged[position] ^= 1 << int(rng.integers(0, 8))
        target = tmp_path / f"flip{k}.onnx"
        target.write_bytes(bytes(damaged))
        with pytest.raises(TrainingOpError) as info:
            TrainingSession(str(target))
        assert str(target) in str(info.value) or "not an ONNX model" in str(info.value) \
            or "training_info" in str(info.value), str(info.value)


def test_a_damaged_tensor_is_named(tmp_path):
    session = TrainingSession(_training_model())
    model = session.training_model()
    tensor = next(t for t in model.graph.initializer if t.name == "W1")
    raw = bytearray(tensor.raw_data)
    raw[5] ^= 0x10
    tensor.raw_data = bytes(raw)
    path = tmp_path / "bad.onnx"
    path.write_bytes(model.SerializeToString())
    with pytest.raises(TrainingOpError, match=r"bad.onnx.*tensor 'W1' does not match its checksum"):
        TrainingSession(str(path))


def test_empty_and_garbage_files_get_a_clear_error(tmp_path):
    empty = tmp_path / "empty.onnx"
    empty.write_bytes(b"")
    with pytest.raises(TrainingOpError, match="empty.onnx.*is empty"):
        TrainingSession(str(empty))
    garbage = tmp_path / "garbage.onnx"
    garbage.write_bytes(b"\xff\xfe not a model \x00\x01" * 10)
    with pytest.raises(TrainingOpError, match="garbage.onnx"):
        TrainingSession(str(garbage))
    with pytest.raises(TrainingOpError, match="cannot read"):
        TrainingSession(str(tmp_path / "missing.onnx"))


def test_a_killed_saves_temporary_file_is_removed_by_the_next_save(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    stale = tmp_path / f".ckpt.onnx.{dead.pid}.abcd.tmp"
    stale.write_bytes(b"partial")
    alive = tmp_path / f".ckpt.onnx.{os.getppid()}.efgh.tmp"  # a live writer's file stays
    alive.write_bytes(b"partial")
    TrainingSession(_training_model()).save(tmp_path / "ckpt.onnx")
    assert not stale.exists() and alive.exists()
    assert (tmp_path / "ckpt.onnx").exists()


def test_checkpoints_without_checksums_still_load(tmp_path):
    model = TrainingSession(_training_model()).training_model()
    kept = [m for m in model.metadata_props if m.key != checkpoint.CHECKSUM_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    path = tmp_path / "old.onnx"
    onnx.save(model, path)
    TrainingSession(str(path)).step(_batch())


# ------------------------------------------------------------------ bad step arguments
@pytest.mark.parametrize("lr", [-1.0, "0.01", float("nan"), float("inf"), np.array([0.1, 0.2]),
                                True])
def test_step_lr_is_validated_and_the_state_is_untouched(lr):
    session = TrainingSession(_training_model())
    before = session.state_dict()
    with pytest.raises(TrainingOpError, match="lr must be"):
        session.step(_batch(), lr=lr)
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(value, before[name])


def test_step_with_a_list_says_feeds_must_be_a_mapping():
    session = TrainingSession(_training_model())
    with pytest.raises(TrainingOpError, match="feeds must be a mapping"):
        session.step([1, 2])


def test_big_endian_feeds_are_read_as_their_values():
    a, b = TrainingSession(_training_model()), TrainingSession(_training_model())
    batch = _batch()
    swapped = {"input": batch["input"].astype(">f4"), "labels": batch["labels"].astype(">i8")}
    assert a.step(batch)["loss"] == b.step(swapped)["loss"]
    model, _, good = _failing_feed()
    session = InferenceSession(model)
    want = session.run(None, good)
    got = session.run(None, {k: v.astype(v.dtype.newbyteorder(">")) for k, v in good.items()})
    for x, y in zip(want, got):
        np.testing.assert_array_equal(x, y)


# ------------------------------------------------------------------ fork safety
def _child_loss(model_bytes):
    session = TrainingSession(model_bytes)
    return float(session.step(_batch())["loss"])


@pytest.mark.parametrize("method", ["fork", "forkserver", "spawn"])
def test_process_pools_work_after_training(method):
    """The parallel fused kernels ran in the parent (GNU OpenMP would kill fork children)."""
    import multiprocessing

    model = build_training_model(make_mlp((256, 1024, 4), seed=1), "cross_entropy", Adam())
    session = TrainingSession(model)
    rng = np.random.default_rng(0)
    big = {"input": rng.standard_normal((64, 256)).astype(np.float32),
           "labels": rng.integers(0, 4, 64).astype(np.int64)}
    for _ in range(3):
        session.step(big)
    small = _training_model().SerializeToString()
    with multiprocessing.get_context(method).Pool(2) as pool:
        losses = pool.map_async(_child_loss, [small, small]).get(timeout=120)
    assert losses[0] == losses[1] and np.isfinite(losses[0])


# ------------------------------------------------------------------ valid models accepted
MODELS = os.path.join(ROOT, "models")


@pytest.mark.parametrize("name", sorted(f for f in os.listdir(MODELS) if f.endswith(".onnx")))
def test_prepare_handles_our_own_training_models(name):
    """The algorithm graph may read main-graph values (the IR concatenates the graphs); its
    optimizer nodes are split and carry exact attributes like the main graph's."""
    from onnx_training_ops import prepare
    from onnx_training_ops.autodiff.native_ops import ALL as NATIVE_GRAD_OPS
    from onnx_training_ops.passes.encode_exact_attributes import EXACT_ATTRIBUTE
    model = onnx.load(os.path.join(MODELS, name))
    native = prepare(model, kernels="native").training_info[0].algorithm
    optimizers = [n for n in native.node if n.op_type.startswith("Training") and n.op_type not in NATIVE_GRAD_OPS]
    assert [n.domain for n in optimizers] == ["ai.onnx.contrib"]
    prepared = prepare(model, kernels="pyop")
    algorithm = prepared.training_info[0].algorithm
    domain = [n for n in algorithm.node if n.domain == "ai.onnx.preview.training"]
    assert domain and all(n.op_type != "Gradient" for n in domain)
    assert all(len(n.input) in (5, 6) for n in domain)  # one tensor per node
    assert all(any(a.name == EXACT_ATTRIBUTE for a in n.attribute) for n in domain)
    onnx.checker.check_model(prepared)


def test_multi_tensor_optimizer_inside_an_if_branch_runs():
    from onnx import TensorProto, helper
    inner = optimizer_model("Momentum", n=2, shapes=[[3], [2]]).graph
    then_branch = helper.make_graph(list(inner.node), "then", [], list(inner.output))
    else_branch = helper.make_graph(
        [helper.make_node("Identity", [i.name], [o.name])
         for i, o in zip(list(inner.input)[2:4] + list(inner.input)[6:8], inner.output)],
        "else", [], list(inner.output))
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    graph = helper.make_graph(
        [helper.make_node("If", ["cond"], [o.name for o in inner.output],
                          then_branch=then_branch, else_branch=else_branch)],
        "g", [cond] + list(inner.input), list(inner.output))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.preview.training", 1)])
    rng = np.random.default_rng(0)
    feed = {"cond": np.array(True), "R": np.array(0.1, np.float32), "T": np.array(0, np.int64)}
    for i in list(inner.input)[2:]:
        shape = [3] if i.name.endswith("0") else [2]
        feed[i.name] = rng.standard_normal(shape).astype(np.float32)
    got = InferenceSession(model).run(None, feed)
    flat = InferenceSession(optimizer_model("Momentum", n=2, shapes=[[3], [2]])).run(
        None, {k: v for k, v in feed.items() if k != "cond"})
    for a, b in zip(got, flat):
        np.testing.assert_array_equal(a, b)


def test_algorithm_outputs_declared_without_shape_are_accepted():
    model = _training_model()
    for out in model.training_info[0].algorithm.output:
        out.type.tensor_type.ClearField("shape")
    session = TrainingSession(model)
    assert np.isfinite(session.step(_batch())["loss"])


# ------------------------------------------------------------------ our errors, not raw ones
def test_bad_labels_are_named_once(capfd):
    session = TrainingSession(_training_model())
    batch = _batch()
    with pytest.raises(TrainingOpError, match=r"feed 'labels' holds class 7, outside \[0, 4\)"):
        session.step(dict(batch, labels=np.full(8, 7, np.int64)))
    with pytest.raises(TrainingOpError, match="'labels' has 5 rows, input 'input' has 8"):
        session.step(dict(batch, labels=np.ones(5, np.int64)))
    session.step(dict(batch, labels=np.where(np.arange(8) < 2, -100, batch["labels"])))
    with pytest.raises(TrainingOpError, match=r"holds class -1, outside \[0, 4\) and not ignore_index -100"):
        session.step(dict(batch, labels=np.where(np.arange(8) == 3, -1, batch["labels"])))
    with pytest.raises(TrainingOpError, match=r"holds class 4, outside"):  # a strided view
        session.step(dict(batch, labels=np.full(16, 4, np.int64)[::2]))
    assert "onnxruntime" not in capfd.readouterr().err  # no second copy in the log


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.int8, np.uint8, ">i8"])
@pytest.mark.parametrize("ignore", [None, -100, 2])
def test_the_class_check_loop_agrees_with_numpy(dtype, ignore):
    from onnx_training_ops.training.inputs import checks

    rng = np.random.default_rng(0)
    for _ in range(200):
        labels = rng.integers(-3 if np.dtype(dtype).kind == "i" else 0, 7, rng.integers(1, 9)).astype(dtype)
        expected = bool(np.all(((labels >= 0) & (labels < 5)) | (labels == ignore if ignore is not None else False)))
        views = [labels, labels.reshape(1, -1), np.repeat(labels, 2)[::2]]
        for view in views:
            try:
                checks.check_classes("step", "labels", view, 5, ignore)
                ok = True
            except TrainingOpError as error:
                ok = False
                assert "outside [0, 5)" in str(error)
            assert ok == expected, (view, ignore)


def test_gradient_of_an_integer_tensor_is_refused():
    from onnx import TensorProto, helper

    from onnx_training_ops import prepare
    graph = helper.make_graph(
        [helper.make_node("Cast", ["i"], ["f"], to=TensorProto.FLOAT),
         helper.make_node("Gradient", ["i"], ["di"], domain="ai.onnx.preview.training",
                          xs=["i"], y="f", name="grad_of_int")],
        "g", [helper.make_tensor_value_info("i", TensorProto.INT64, [3])],
        [helper.make_tensor_value_info("di", TensorProto.FLOAT, [3])])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17),
                                                    helper.make_opsetid("ai.onnx.preview.training", 1)])
    with pytest.raises(TrainingOpError, match="'grad_of_int'.*xs 'i' is .*INT64.*floating-point"):
        prepare(model)


def test_adam_alpha_of_one_names_the_attribute():
    with pytest.raises(TrainingOpError, match="attribute 'alpha' must be < 1"):
        InferenceSession(optimizer_model("Adam", attributes={"alpha": 1.0}))


def test_a_state_tensor_whose_data_does_not_fit_its_shape_is_named():
    model = _training_model()
    tensor = next(t for t in model.graph.initializer if t.name == "W0")
    tensor.raw_data = tensor.raw_data[:-4]
    with pytest.raises(TrainingOpError, match="state variable 'W0'"):
        TrainingSession(model)


@pytest.mark.parametrize("mutate, match", [
    (lambda g: g.node.append(onnx.helper.make_node("Relu", ["nowhere"], ["r"], name="dangling")),
     "'dangling'.*'nowhere' is produced by no node"),
    (lambda g: g.node.append(onnx.helper.make_node("Relu", ["X0"], ["X0_new"], name="twice")),
     "'twice'.*'X0_new' is already produced"),
    (lambda g: g.node.insert(0, onnx.helper.make_node("Relu", ["late"], ["early"], name="first"))
     or g.node.append(onnx.helper.make_node("Relu", ["early"], ["late"], name="second")),
     "'first'.*'late' is produced only by a later node"),
])
def test_prepare_names_the_node_of_a_broken_graph(mutate, match):
    from onnx_training_ops import prepare
    model = optimizer_model("Adam")
    mutate(model.graph)
    with pytest.raises(TrainingOpError, match=match):
        prepare(model)


def test_an_unknown_version_of_the_domain_is_refused():
    from onnx_training_ops import prepare
    model = optimizer_model("Adam")
    for imp in model.opset_import:
        if imp.domain == "ai.onnx.preview.training":
            imp.version = 2
    with pytest.raises(TrainingOpError, match="version 2; only version 1 exists"):
        prepare(model)
