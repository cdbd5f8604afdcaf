"""TrainingSession with its update in the graph (``device=`` or a device provider), run on the
CPU and checked against the host session: the state bit for bit (the returned loss within an
ulp: the host session may reduce it in another kernel) for every optimizer, clipping, groups,
schedules, sparse tables, accumulation, non-finite losses, checkpoints, exports and flat
parameters. ``device="cpu"`` keeps the state in host arrays; the device memory a GPU uses
(OrtValues allocated by onnxruntime, accumulators bound by address) runs here on the CPU too
(``memory="device"``, a private option). tests/test_gpu.py runs it on CUDA."""

from __future__ import annotations

import weakref

import numpy as np
import onnxruntime as ort
import pytest

import onnx_training_ops as ot
from onnx_training_ops import schedules
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.training.engine import checked_config
from onnx_training_ops.training.engine.memory import DeviceMemory, HostMemory
from onnx_training_ops.training.options.providers import placement
from tests.test_device_trainer import _batches as _trainer_batches
from tests.test_device_trainer import _model
from tests.test_sparse_updates import batches as sparse_batches
from tests.test_sparse_updates import emb_model


def _batches(n=4, seed=0, rows=12):
    return _trainer_batches(n, seed, rows)


def on_device(model, memory="host", *, on_nonfinite="raise", input_shapes=None, cuda_graph=None, in_place=None):
    """A ``device="cpu"`` session; ``memory="device"``: its state in onnxruntime-allocated
    OrtValues, as on a GPU."""
    config = checked_config(["CPUExecutionProvider"], None, on_nonfinite, None, None, None, "cpu", 0, input_shapes,
                            cuda_graph, in_place, memory)
    return ot.TrainingSession._opened(model, config)


MEMORIES = ["host", "device"]


def _assert_same_state(device, host):
    mine = device.state_dict()
    assert set(mine) == set(host.state_dict())
    for name, value in host.state_dict().items():
        np.testing.assert_array_equal(mine[name], value, err_msg=name)


OPTIMIZERS = [
    ot.Adam(lr=1e-2), ot.AdamW(lr=1e-2, weight_decay=0.1), ot.Adam(lr=1e-2, weight_decay=0.01),
    ot.Momentum(lr=0.05, momentum=0.9), ot.Momentum(lr=0.05, momentum=0.9, nesterov=True, weight_decay=0.01),
    ot.Adagrad(lr=0.1), ot.RMSProp(lr=1e-2, momentum=0.5), ot.OrtAdamW(lr=1e-2),
]


@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("optimizer", OPTIMIZERS, ids=lambda o: repr(o)[:40])
def test_every_optimizer_steps_bit_for_bit_with_the_state_on_the_device(optimizer, memory):
    model = _model(optimizer, clip_grad_norm=0.5)
    host, device = ot.TrainingSession(model), on_device(model, memory)
    assert isinstance(device._store.memory, HostMemory if memory == "host" else DeviceMemory)
    if memory == "device":
        assert all(isinstance(v, ort.OrtValue) for v in device._store.memory.values.values())
    for batch in _batches():
        expected, got = host.step(batch), device.step(batch)
        assert set(got) == set(expected)
        for name in expected:  # the loss's reduction may run in another kernel: its last bit may differ
            np.testing.assert_allclose(got[name], expected[name], rtol=1e-6, err_msg=name)
        _assert_same_state(device, host)  # the state bit for bit, step by step


def test_groups_schedules_and_lr_follow_the_host_session():
    model = _model(ot.AdamW(lr=1e-2, weight_decay=0.1), param_groups=[{"params": ["b*"], "lr": 0.05}])
    host, device = ot.TrainingSession(model), ot.TrainingSession(model, device="cpu")
    assert device.learning_rate_names == host.learning_rate_names and len(host.learning_rate_names) == 2
    for s in (host, device):
        s.set_lr_schedule(schedules.WarmupLinearLR(warmup_steps=2, total_steps=10))
    for i, batch in enumerate(_batches(5)):
        lr = 3e-3 if i == 3 else None
        assert device.learning_rates == host.learning_rates
        np.testing.assert_allclose(device.step(batch, lr=lr)["loss"], host.step(batch, lr=lr)["loss"], rtol=1e-6)
    assert device.lr_schedule_step == host.lr_schedule_step == 5
    _assert_same_state(device, host)


@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("mode", ["lazy", "sparse"])
def test_sparse_tables_update_on_the_device(mode, memory):
    model = ot.build_training_model(emb_model(), "mse", ot.Adam(lr=0.05), trainable=["E", "W"],
                                    sparse_updates={"E": mode})
    host, device = ot.TrainingSession(model), on_device(model, memory)
    for ids, target in sparse_batches()[:3]:
        feeds = {"ids": ids, "target": target}
        np.testing.assert_allclose(device.step(feeds)["loss"], host.step(feeds)["loss"], rtol=1e-6)
    _assert_same_state(device, host)


@pytest.mark.parametrize("memory", MEMORIES)
def test_accumulation_zero_grad_and_gradients(memory):
    model = _model(clip_grad_norm=0.5)
    host, device = ot.TrainingSession(model), on_device(model, memory)
    b = _batches(3)
    for s in (host, device):
        s.backward(b[0], scale=0.5)
        s.zero_grad()
        s.backward(b[1], scale=0.5)
        s.backward(b[2], scale=0.5)
    assert device.accumulated_batches == host.accumulated_batches == 2
    for name, value in host.gradients().items():
        np.testing.assert_array_equal(device.gradients()[name], value, err_msg=name)
    np.testing.assert_array_equal(device.optimizer_step()["grad_norm"], host.optimizer_step()["grad_norm"])
    assert device.accumulated_batches == 0 and all(not g.any() for g in device.gradients().values())
    _assert_same_state(device, host)
    flat = device._loop.accumulation.flat
    assert len(flat) == 1  # every accumulator a slice of one buffer per dtype, in either memory
    if memory == "host":  # host arrays: the live buffer, as the host session's
        device.backward(b[0])
        buffers, views = device.gradient_buffers(), dict(device.gradient_views())
        assert len(buffers) == 1 and all(np.shares_memory(v, buffers[0]) for v in views.values())
        buffers[0][...] = 0  # an all-reduce writes here: what optimizer_step applies
        assert not any(g.any() for g in device.gradients().values())
        device.zero_grad()
    else:
        with pytest.raises(TrainingOpError, match="live on the device.*gradients\\(\\).*gradient_tensors"):
            device.gradient_buffers()
    # in either memory: the live buffers as DLPack exporters, and where each gradient lies in them
    device.backward(b[1])
    exported, expected = device.gradient_tensors(), device.gradients()
    assert all(isinstance(t, np.ndarray if memory == "host" else ort.OrtValue) for t in exported)
    views = [np.from_dlpack(t) for t in exported]  # no copy: the same memory
    assert [v.ctypes.data for v in views] == [t.ctypes.data if memory == "host" else t.data_ptr() for t in exported]
    layout = device.gradient_layout()
    assert [name for name, *_ in layout] == list(expected)
    for name, index, offset, shape in layout:
        size = int(np.prod(shape))
        np.testing.assert_array_equal(views[index][offset:offset + size].reshape(shape), expected[name])
    (w0,) = device.state_tensors(["W0"])
    np.testing.assert_array_equal(np.from_dlpack(w0), device.state_dict()["W0"])
    device.zero_grad()
    with pytest.raises(TrainingOpError, match="no gradients accumulated"):
        device.optimizer_step()


@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("policy", ["raise", "skip"])
def test_a_nonfinite_loss_keeps_the_state(policy, memory):
    model = _model()
    device = on_device(model, memory, on_nonfinite=policy)
    device.step(_batches(1)[0])
    before = device.state_dict()
    bad = dict(_batches(1, seed=3)[0])
    bad["input"] = bad["input"].copy()
    bad["input"][0, 0] = np.nan
    if policy == "raise":
        with pytest.raises(ot.NonFiniteLossError):
            device.step(bad)
    else:
        assert not np.isfinite(device.step(bad)["loss"])
        assert device.skipped_steps == 1
    for name, value in device.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    assert device.lr_schedule_step == 1


@pytest.mark.parametrize("memory", MEMORIES)
def test_evaluate_and_run_any_batch_size_nothing_changes(memory):
    model = _model()
    host, device = ot.TrainingSession(model), on_device(model, memory)
    for s in (host, device):
        s.step(_batches(1)[0])
    before = device.state_dict()
    for rows in (12, 5, 12):
        batch = _batches(1, seed=rows, rows=rows)[0]
        np.testing.assert_allclose(device.evaluate(batch)["loss"], host.evaluate(batch)["loss"], rtol=1e-6)
        got = device.evaluate(batch, outputs=["logits"])["logits"]
        np.testing.assert_array_equal(got, host.evaluate(batch, outputs=["logits"])["logits"])
        np.testing.assert_array_equal(device.run(None, {"input": batch["input"]})[0],
                                      host.run(None, {"input": batch["input"]})[0])
    assert [f.name for f in device.eval_feeds()] == [f.name for f in host.eval_feeds()]
    for name, value in device.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    with pytest.raises(TrainingOpError, match="missing feed"):
        device.step({"input": _batches(1)[0]["input"]})


def test_checkpoints_resume_on_host_and_device(tmp_path):
    model = _model()
    host, device = ot.TrainingSession(model), ot.TrainingSession(model, device="cpu")
    b = _batches(4)
    for batch in b[:2]:
        host.step(batch)
        device.step(batch)
    device.properties["epoch"] = 3
    path = device.save(tmp_path / "ckpt.onnx")
    reopened_host = ot.TrainingSession(path)
    reopened_device = ot.TrainingSession(path, device="cpu")
    assert reopened_device.properties["epoch"] == 3
    _assert_same_state(reopened_device, host)
    for batch in b[2:]:
        expected = host.step(batch)["loss"]
        assert reopened_host.step(batch)["loss"] == expected
        np.testing.assert_allclose(reopened_device.step(batch)["loss"], expected, rtol=1e-6)
    reopened_device.load_state_dict(device.state_dict())
    _assert_same_state(reopened_device, device)
    with pytest.raises(TrainingOpError, match="float32"):
        device.load_state_dict({k: v.astype(np.float64) for k, v in device.state_dict().items()})


@pytest.mark.parametrize("memory", MEMORIES)
def test_exports_flat_parameters_and_initialize(tmp_path, memory):
    from onnx_training_ops.export import DeviceTrainer, export_step

    model = _model()
    host, device = ot.TrainingSession(model), on_device(model, memory)
    for batch in _batches(2):
        host.step(batch)
        device.step(batch)
    export_step(device, tmp_path / "export")
    trainer = DeviceTrainer(tmp_path / "export")
    batch = _batches(1, seed=9)[0]
    np.testing.assert_allclose(trainer.step(batch)["loss"], host.step(batch)["loss"], rtol=1e-6)
    device.step(batch)
    inference = device.export_inference_model()
    got = ort.InferenceSession(inference.SerializeToString()).run(None, {"input": batch["input"]})[0]
    np.testing.assert_array_equal(got, host.run(None, {"input": batch["input"]})[0])
    flat = device.get_flat_parameters()
    np.testing.assert_array_equal(flat, host.get_flat_parameters())
    if memory == "host":  # host arrays: live views, as on the host session
        live = device.get_flat_parameters(copy=False)
        np.testing.assert_array_equal(live, flat)
        (w0,) = device.state_views(["W0"])
        assert np.shares_memory(w0, live)
        before = device.evaluate(batch)["loss"]
        live *= 0.5  # written in place: the next run reads it
        assert device.evaluate(batch)["loss"] != before
    else:
        with pytest.raises(TrainingOpError, match="copy=True"):
            device.get_flat_parameters(copy=False)
        with pytest.raises(TrainingOpError, match="state_dict"):
            device.state_views(["W0"])
    device.load_flat_parameters(np.zeros_like(flat))
    assert not device.get_flat_parameters().any()
    device.initialize()
    host.initialize()
    _assert_same_state(device, host)


def test_placement_rules():
    assert placement(None).device is None
    assert placement(None, "cpu").device == "cpu"
    cuda = placement(["CUDAExecutionProvider", "CPUExecutionProvider"],
                     available=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert (cuda.device, cuda.device_id) == ("cuda", 0)
    second = placement(None, "cuda:1", available=["CUDAExecutionProvider", "CPUExecutionProvider"])
    assert second.providers == [("CUDAExecutionProvider", {"device_id": 1}), "CPUExecutionProvider"]
    assert second.device_id == 1
    for bad in ("gpu", "cuda:x", "cpu:1", 3):
        with pytest.raises(TrainingOpError, match="device"):
            placement(None, bad)
    with pytest.raises(TrainingOpError, match="none for it"):
        placement(["CPUExecutionProvider"], "cuda", available=["CUDAExecutionProvider", "CPUExecutionProvider"])


@pytest.mark.skipif("CUDAExecutionProvider" in ort.get_available_providers(), reason="onnxruntime-gpu installed")
def test_cuda_without_onnxruntime_gpu_is_a_clear_error_not_a_cpu_run():
    with pytest.raises(TrainingOpError, match="not available.*onnxruntime-gpu"):
        ot.TrainingSession(_model(), device="cuda")
    with pytest.raises(TrainingOpError, match="not available"):
        ot.TrainingSession(_model(), providers=["CUDAExecutionProvider", "CPUExecutionProvider"])


def test_a_large_model_trains_on_the_device_and_saves_streamed(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", str(32 * 1024))
    source = str(tmp_path / "mlp.onnx")
    import onnx

    onnx.save(make_mlp((64, 256, 64, 4)), source, save_as_external_data=True, location="mlp.onnx.data",
              size_threshold=1024)
    model = ot.build_training_model(source, "cross_entropy", ot.AdamW(lr=1e-2), trainable=["W1", "b1", "W2", "b2"])
    host, device = ot.TrainingSession(model), on_device(model, "device")
    assert host._store.model.large and device._store.model.large  # W0 frozen: a constant of the graph
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = {"input": rng.standard_normal((16, 64)).astype(np.float32), "labels": rng.integers(0, 4, 16)}
        np.testing.assert_allclose(device.step(batch)["loss"], host.step(batch)["loss"], rtol=1e-6)
    _assert_same_state(device, host)
    alive, most = [], [0]
    download = DeviceMemory.download

    def tracked(self, name):  # the host copies a save makes: one big tensor at a time, not the state
        array = download(self, name)
        alive[:] = [r for r in alive if r() is not None]
        if array.nbytes >= 1024:
            alive.append(weakref.ref(array))
            most[0] = max(most[0], len(alive))
        return array

    monkeypatch.setattr(DeviceMemory, "download", tracked)
    path = device.save(tmp_path / "ckpt.onnx")
    big = sum(1 for n in device.state_names if device._store.memory.dtype(n).itemsize
              * np.prod(device._store.memory.shape(n)) >= 1024)
    assert big >= 6 and most[0] <= 2, (big, most)
    monkeypatch.setattr(DeviceMemory, "download", download)
    _assert_same_state(ot.TrainingSession(path), host)
    exported = device.export_inference_model(tmp_path / "inference.onnx")
    got = ort.InferenceSession(str(tmp_path / "inference.onnx")).run(None, {"input": batch["input"]})[0]
    np.testing.assert_array_equal(got, host.run(None, {"input": batch["input"]})[0])
    assert exported is not None


def test_static_input_shapes_bind_fixed_addresses_and_step_the_same():
    model = _model(clip_grad_norm=0.5)
    host = ot.TrainingSession(model)
    device = ot.TrainingSession(model, device="cpu", input_shapes={"input": [12, 8], "labels": [12]})
    program = device._programs.steps[0]
    assert program.not_fixed is None and not device.cuda_graph  # CUDA graphs need a CUDA device
    assert device.device == "cpu" and host.device is None
    ops = {n.op_type for n in program.session.prepared_model.graph.node}
    assert not ops & {"Shape", "Size"}  # the shape arithmetic is folded
    for batch in _batches(4):
        np.testing.assert_allclose(device.step(batch)["loss"], host.step(batch)["loss"], rtol=1e-6)
        _assert_same_state(device, host)
    batch = _batches(1, rows=5)[0]
    with pytest.raises(TrainingOpError, match="'input'.*shape"):
        device.step(batch)
    np.testing.assert_allclose(device.evaluate(batch)["loss"], host.evaluate(batch)["loss"], rtol=1e-6)


def test_device_options_are_checked():
    with pytest.raises(TrainingOpError, match="input_shapes applies to a device-resident session"):
        ot.TrainingSession(_model(), input_shapes={"input": [4, 8]})
    with pytest.raises(TrainingOpError, match="cuda_graph=True needs the state on a CUDA device"):
        ot.TrainingSession(_model(), cuda_graph=True)  # the host session: it trained on, cuda_graph False
    with pytest.raises(TrainingOpError, match="fast=True applies the fused kernels.*update runs in the graph"):
        ot.TrainingSession(_model(), device="cpu", fast=True)  # it reported fast=True with no fused node
    with pytest.raises(TrainingOpError, match="cuda_graph must be True, False or None"):
        ot.TrainingSession(_model(), device="cpu", cuda_graph="yes")
    device = ot.TrainingSession(_model(), device="cpu", fast=False)
    assert not device.fast and device.fast_path_nodes == [] and not device.cuda_graph
    assert "state on 'cpu' (host arrays), update in the graph" in repr(device)
    assert "host arrays, fused kernels" in repr(ot.TrainingSession(_model()))
    assert "native kernels in the graph" in repr(ot.TrainingSession(_model(), fast=False))
    with pytest.raises(TrainingOpError, match="whole numbers"):
        ot.TrainingSession(_model(), device="cpu", input_shapes={"input": [4, -1]})
    with pytest.raises(TrainingOpError, match="input_shapes.*'labels'"):  # every symbolic data input
        ot.TrainingSession(_model(), device="cpu", input_shapes={"input": [4, 8]})
    with pytest.raises(TrainingOpError, match="cuda_graph=True but.*not a CUDA device"):
        ot.TrainingSession(_model(), device="cpu", input_shapes={"input": [4, 8], "labels": [4]}, cuda_graph=True)
    with pytest.raises(TrainingOpError, match="cuda_graph=True but.*no static shape"):
        ot.TrainingSession(_model(), device="cpu", cuda_graph=True)


@pytest.mark.parametrize("name", ["gpt2"])
def test_a_transformers_model_from_the_default_exporter_trains_on_the_device_as_on_the_host(name):
    """torch.onnx.export's defaults (dynamo). The host session's native gradient kernels
    (cross-entropy, LayerNorm) and the device session's standard ops differ in the last bits."""
    from tests.test_dynamo_export import VOCAB, _export, _loss

    _, exported = _export(name)
    model = ot.build_training_model(exported, _loss(name), ot.AdamW(lr=1e-3, weight_decay=0.01), clip_grad_norm=1.0)
    host, device = ot.TrainingSession(model), ot.TrainingSession(model, device="cpu")
    rng = np.random.default_rng(0)
    for _ in range(3):
        ids = rng.integers(0, VOCAB, (2, 8))
        labels = rng.integers(0, VOCAB, (2, 8)) if name == "gpt2" else rng.integers(0, 3, 2)
        batch = {"input_ids": ids, "labels": labels}
        np.testing.assert_allclose(device.step(batch)["loss"], host.step(batch)["loss"], rtol=1e-6)
    want = host.state_dict()
    for key, value in device.state_dict().items():
        np.testing.assert_allclose(value, want[key], rtol=1e-5, atol=1e-7, err_msg=key)


def test_a_nominal_checkpoint_opens_on_the_device_and_trains_once_filled(tmp_path):
    model = _model()
    host = ot.TrainingSession(model)
    host.step(_batches(1)[0])
    path = host.save(tmp_path / "nominal.onnx", nominal=True)
    device = ot.TrainingSession(path, device="cpu")
    assert device.nominal
    with pytest.raises(TrainingOpError, match="nominal"):
        device.step(_batches(1)[0])
    device.load_flat_parameters(host.get_flat_parameters(trainable_only=False), trainable_only=False)
    reference = ot.TrainingSession(path)
    reference.load_flat_parameters(host.get_flat_parameters(trainable_only=False), trainable_only=False)
    assert not device.nominal
    for batch in _batches(2, seed=5):
        np.testing.assert_allclose(device.step(batch)["loss"], reference.step(batch)["loss"], rtol=1e-6)
    _assert_same_state(device, reference)


def test_repr_and_summary_read_no_device_values(monkeypatch):
    model = _model()
    device = on_device(model, "device")
    expected = ot.TrainingSession(model).summary().to_dict()

    def refused(self, name):
        raise AssertionError(f"{name} copied from the device")

    monkeypatch.setattr(DeviceMemory, "download", refused)
    assert "state on 'cpu' (device memory), update in the graph" in repr(device)
    assert device.summary().to_dict() == expected


def test_an_optional_input_left_out_goes_back_to_its_default():
    """A reused binding must not keep the value an earlier step fed to an input with a default."""
    import onnx
    from onnx import helper, numpy_helper

    base = make_mlp((8, 16, 4))
    graph = base.graph
    logits = graph.output[0].name
    graph.node.append(helper.make_node("Add", [logits, "shift"], ["shifted"]))
    graph.input.append(helper.make_tensor_value_info("shift", onnx.TensorProto.FLOAT, [4]))
    graph.initializer.append(numpy_helper.from_array(np.zeros(4, np.float32), "shift"))
    graph.output[0].name = "shifted"
    model = ot.build_training_model(base, "cross_entropy", ot.AdamW(lr=1e-2), trainable=["W0", "b0", "W1", "b1"])
    host, device = ot.TrainingSession(model), ot.TrainingSession(model, device="cpu")
    assert "shift" in device.optional_feed_names
    shift = np.array([3.0, -3.0, 0.0, 1.0], np.float32)
    for i, batch in enumerate(_batches(4)):
        feeds = {**batch, "shift": shift} if i % 2 == 0 else batch
        np.testing.assert_allclose(device.step(feeds)["loss"], host.step(feeds)["loss"], rtol=1e-6)
    _assert_same_state(device, host)


def _frozen_model():
    """x -MatMul W0 (16x64, frozen: 4 KB)- Relu -MatMul W1 (64x4) + b (frozen, 16 B), MSE: a
    LoRA-like model whose frozen tensors are big and small."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    values = {"W0": rng.standard_normal((16, 64)), "W1": rng.standard_normal((64, 4)) * 0.1, "b": np.ones(4)}
    nodes = [helper.make_node("MatMul", ["x", "W0"], ["h"]), helper.make_node("Relu", ["h"], ["r"]),
             helper.make_node("MatMul", ["r", "W1"], ["m"]), helper.make_node("Add", ["m", "b"], ["y"])]
    graph = helper.make_graph(nodes, "frozen", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, ["N", 16])],
                              [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, ["N", 4])],
                              [numpy_helper.from_array(v.astype(np.float32), n) for n, v in values.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return ot.build_training_model(model, "mse", ot.Adam(lr=1e-2), trainable=["W1"])


@pytest.mark.parametrize("memory", MEMORIES)
def test_backward_and_steps_with_frozen_tensors_of_any_size(memory):
    """Issue 36 B.9: backward() failed whenever a frozen initializer was >= 1 KB (every LoRA
    model): 'ReplaceInitializedTensorImpl Failed to find existing initializer with name W0'."""
    model = _frozen_model()
    host, device = ot.TrainingSession(model), on_device(model, memory)
    rng = np.random.default_rng(1)
    for _ in range(2):
        feeds = {"x": rng.standard_normal((5, 16)).astype(np.float32),
                 "target": rng.standard_normal((5, 4)).astype(np.float32)}
        for s in (host, device):
            s.backward(feeds, scale=0.5)
            s.backward(feeds, scale=0.5)
        np.testing.assert_array_equal(device.gradients()["W1"], host.gradients()["W1"])
        device.optimizer_step()
        host.optimizer_step()
        np.testing.assert_allclose(device.step(feeds)["loss"], host.step(feeds)["loss"], rtol=1e-6)
        np.testing.assert_allclose(device.evaluate(feeds)["loss"], host.evaluate(feeds)["loss"], rtol=1e-6)
    _assert_same_state(device, host)
    # one copy of each frozen tensor for every program: bound as an input, not an initializer
    # onnxruntime copies into each session
    programs = [*device._programs.steps, *device._programs.evaluations.values(),
                *device._loop.accumulation.programs()[:2]]
    for program in programs:
        assert not {t.name for t in program.session.prepared_model.graph.initializer} & {"W0"}
        assert "W0" in program.constants
    if memory == "device":
        assert set(device._store.memory._constants) == {"W0"}


@pytest.mark.parametrize("memory", MEMORIES)
@pytest.mark.parametrize("capture_runs", [1, 2])
def test_a_step_that_onnxruntime_runs_again_to_capture_a_cuda_graph_updates_once(memory, capture_runs):
    """Issue 39 item 1 (seen on an H200: the first CUDA-graph step applied AdamW 2-3 times).
    onnxruntime's first Run of a session with CUDA graphs runs the model ``capture_runs`` more
    times (1 or 2, by version) and replays the capture; emulated here on the step's session.
    The fixed-address step's first call is a warm-up whose update is off (a bool input ANDed
    into the guard), so however often it runs, each step updates the state once."""
    model = _model(clip_grad_norm=0.5)
    host = ot.TrainingSession(model)
    device = on_device(model, memory, input_shapes={"input": [12, 8], "labels": [12]})
    program = device._programs.steps[0]
    assert program.not_fixed is None and program.gated and program.in_place
    real, calls = program.session.run_with_iobinding, []

    def capturing(io, run_options=None):
        calls.append(1 + capture_runs if not calls else 1)
        for _ in range(calls[-1]):
            real(io, run_options)

    program.session.run_with_iobinding = capturing
    for batch in _batches(3):
        np.testing.assert_allclose(device.step(batch)["loss"], host.step(batch)["loss"], rtol=1e-6)
        _assert_same_state(device, host)
    assert calls == [1 + capture_runs, 1, 1, 1]  # the warm-up (with its capture), then one run a step


def test_a_refused_cuda_graph_capture_retries_with_fresh_options(monkeypatch):
    """Issue 39 item 5: the retry without CUDA graphs reused the options object of the refused
    try, and onnxruntime refuses an external initializer added twice to one ('An OrtValue for
    this name has already been added'): every LoRA model. Emulated on the CPU: a capture that
    is refused, each try adding an external initializer to the options it is given."""
    from onnx_training_ops.training.engine import graph as graph_module

    value = ort.OrtValue.ortvalue_from_numpy(np.zeros(300, np.float32))
    so = ort.SessionOptions()
    so.add_external_initializers(["frozen"], [value])
    with pytest.raises(Exception, match="already been added"):  # what onnxruntime does
        so.add_external_initializers(["frozen"], [value])
    tries = []
    real = graph_module.InferenceSession

    def session(model, sess_options, providers):
        if any(o is sess_options for o in tries):  # as add_external_initializers on options used before
            raise RuntimeError("INVALID_ARGUMENT : An OrtValue for this name has already been added: frozen")
        tries.append(sess_options)
        if len(tries) == 1:
            raise RuntimeError("This session cannot use the CUDA Graph feature (emulated)")
        return real(model, sess_options=sess_options, providers=providers)

    monkeypatch.setattr(graph_module, "captures", lambda memory: True)
    monkeypatch.setattr(graph_module, "InferenceSession", session)
    device = on_device(_frozen_model(), input_shapes={"x": [5, 16], "target": [5, 4]})
    program = device._programs.steps[0]
    assert len(tries) == 2 and tries[0] is not tries[1]
    assert not device.cuda_graph and "refused CUDA graphs" in program.not_captured
    assert program.not_fixed is None  # the buffers still at fixed addresses
    feeds = {"x": np.ones((5, 16), np.float32), "target": np.zeros((5, 4), np.float32)}
    assert np.isfinite(device.step(feeds)["loss"])


def _conv_model():
    """Conv (3 -> 4, 3x3, pad 1, stride 2) -> Relu -> Conv (4 -> 4, 3x3, pad 1) -> Relu -> global
    average -> Gemm, cross entropy."""
    import onnx
    from onnx import helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array((rng.standard_normal((4, 3, 3, 3)) * 0.3).astype(np.float32), "K"),
             numpy_helper.from_array(np.zeros(4, np.float32), "kb"),
             numpy_helper.from_array((rng.standard_normal((4, 4, 3, 3)) * 0.3).astype(np.float32), "K2"),
             numpy_helper.from_array((rng.standard_normal((4, 5)) * 0.3).astype(np.float32), "W")]
    nodes = [helper.make_node("Conv", ["x", "K", "kb"], ["c"], pads=[1, 1, 1, 1], strides=[2, 2]),
             helper.make_node("Relu", ["c"], ["r0"]), helper.make_node("Conv", ["r0", "K2"], ["c2"], pads=[1, 1, 1, 1]),
             helper.make_node("Relu", ["c2"], ["r"]), helper.make_node("GlobalAveragePool", ["r"], ["p"]),
             helper.make_node("Flatten", ["p"], ["f"]), helper.make_node("Gemm", ["f", "W"], ["logits"])]
    graph = helper.make_graph(nodes, "cnn", [helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [6, 3, 8, 8])],
                              [helper.make_tensor_value_info("logits", onnx.TensorProto.FLOAT, [6, 5])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return ot.build_training_model(model, "cross_entropy", ot.Momentum(lr=0.1, momentum=0.9))


def test_on_a_gpu_convolution_gradients_are_convolutions(monkeypatch):
    """Issue 39 item 8: on a CUDA device the Conv gradients are onnxruntime's Conv and
    ConvTranspose (cuDNN), not the im2col Gemms (Pad/Slice per kernel offset) tuned for the
    CPU, which the CPU keeps. The GPU's pipeline runs here on the CPU: the same training."""
    from onnx_training_ops.training.engine import graph as graph_module

    model = _conv_model()
    rng = np.random.default_rng(1)
    batches = [{"x": rng.standard_normal((6, 3, 8, 8)).astype(np.float32), "labels": rng.integers(0, 5, 6)}
               for _ in range(3)]
    cpu = ot.TrainingSession(model, device="cpu")
    monkeypatch.setattr(graph_module, "device_provider", lambda device: "CUDAExecutionProvider")
    gpu = ot.TrainingSession(model, device="cpu")
    ops = {name: [n.op_type for n in s._programs.steps[0].session.prepared_model.graph.node]
           for name, s in (("cpu", cpu), ("gpu", gpu))}
    # forward and weight gradients: Conv; the second's input gradient: ConvTranspose
    assert ops["gpu"].count("ConvTranspose") == 1 and ops["gpu"].count("Conv") == 4
    assert "ConvTranspose" not in ops["cpu"] and ops["cpu"].count("Conv") == 2  # im2col: Gemms
    for batch in batches:
        np.testing.assert_allclose(gpu.step(batch)["loss"], cpu.step(batch)["loss"], rtol=1e-5)
    want = cpu.state_dict()
    for name, value in gpu.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-4, atol=1e-6, err_msg=name)
