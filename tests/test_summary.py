"""summary() of training models and sessions, repr, and trained weights back into torch modules
(both exporters: names kept by dynamo optimize=False, recorded for TorchScript)."""

import logging
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_training_ops import Adam, AdamW, Momentum, TrainingSession, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.training.state.torch_names import KEY, record_torch_names, torch_name_map
from onnx_training_ops.training.summary import summary


def test_summary_of_a_training_model_lists_tensors_state_loss_and_gradient_ops():
    model = build_training_model(make_mlp((4, 8, 3)), "cross_entropy", AdamW(lr=1e-3), trainable=["W0", "b0", "W1"])
    s = summary(model)
    assert s.training and s.loss == "loss" and s.labels == "labels" and s.mode == "eval"
    assert [(t.name, t.shape) for t in s.trainable] == [("W0", (4, 8)), ("b0", (8,)), ("W1", (8, 3))]
    assert [(t.name, t.shape) for t in s.frozen] == [("b1", (3,))]
    assert s.trainable_count == 32 + 8 + 24 and s.frozen_count == 3
    assert s.optimizer["type"] == "AdamW" and s.optimizer["lr"] == 1e-3
    # V and H per trainable (float32) and the int64 step count
    assert s.optimizer_state_bytes == 2 * 4 * (32 + 8 + 24) + 8
    assert {t.name for t in s.optimizer_state} == ({f"{p}.{v}" for p in ("W0", "b0", "W1") for v in "VH"}
                                                   | {"optimizer.T"})
    assert s.gradient_ops["Gemm"] == 2 and s.gradient_ops["Relu"] == 1 and "SoftmaxCrossEntropyLoss" in s.gradient_ops
    assert s.learning_rates == {"learning_rate": pytest.approx(1e-3)}
    text = str(s)
    assert "trainable: 3 tensors, 64 parameters" in text and "W0" in text and "[4, 8]" in text and "AdamW(" in text


def test_summary_of_an_inference_model_and_ops_without_rules():
    model = make_mlp((4, 8, 3))
    model.graph.node.append(helper.make_node("NonMaxSuppression", ["a", "b"], ["c"]))
    s = summary(model)
    assert not s.training and s.trainable_count == 4 * 8 + 8 + 8 * 3 + 3 and s.frozen == []
    assert s.ops_without_rules == ["NonMaxSuppression"]


def test_session_summary_and_repr_follow_the_live_state():
    session = TrainingSession(build_training_model(make_mlp((4, 8, 3)), "cross_entropy", Momentum(lr=0.1)))
    s = session.summary()
    assert s == summary(session.training_model())
    assert s.optimizer_state_bytes == 4 * (32 + 8 + 24 + 3) + 8  # one V per trainable
    x = np.random.default_rng(0).normal(size=(5, 4)).astype(np.float32)
    session.step({"input": x, "labels": np.arange(5) % 3})
    text = repr(session)
    assert text.startswith("<TrainingSession 4 trainable tensors (67 parameters)") and "Momentum" in text
    assert "step 1" in text and "learning_rate=0.1" in text


def test_summary_in_train_mode_keeps_batchnorm_statistics_frozen():
    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.normal(size=(3, 2, 1, 1)).astype(np.float32), "w"),
             numpy_helper.from_array(np.ones(3, np.float32) * 1.5, "scale"),
             numpy_helper.from_array(np.full(3, 0.1, np.float32), "bias"),
             numpy_helper.from_array(np.zeros(3, np.float32), "mean"),
             numpy_helper.from_array(np.ones(3, np.float32), "var")]
    nodes = [helper.make_node("Conv", ["x", "w"], ["c"]),
             helper.make_node("BatchNormalization", ["c", "scale", "bias", "mean", "var"], ["y"])]
    graph = helper.make_graph(nodes, "bn", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 2, 4, 4])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 3, 4, 4])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 10
    s = summary(build_training_model(model, "mse", Adam(), mode="train"))
    assert [t.name for t in s.trainable] == ["w", "scale", "bias"] and s.mode == "train"
    assert {t.name for t in s.frozen} >= {"mean", "var"}
    assert s.gradient_ops.get("Conv") == 1 and "BatchNormalization" in s.gradient_ops


# ---------------------------------------------------------------- torch names


torch = pytest.importorskip("torch")


class Block(torch.nn.Module):
    """Linear on [N, T, C] (TorchScript folds its weight transposed), two LayerNorms of equal
    fresh values (the TorchScript exporter merges them), a second Linear."""

    def __init__(self):
        super().__init__()
        self.a, self.n, self.n2, self.b = (torch.nn.Linear(6, 8), torch.nn.LayerNorm(8), torch.nn.LayerNorm(8),
                                           torch.nn.Linear(8, 3))

    def forward(self, x):
        return self.b(self.n2(self.n(torch.relu(self.a(x)))))


def _export(module, x, path, **kwargs):
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    try:
        torch.onnx.export(module, (x,), str(path), input_names=["x"], output_names=["y"], **kwargs)
    finally:
        logging.disable(logging.NOTSET)
    return onnx.load(str(path))


@pytest.mark.parametrize("exporter", ["torchscript", "torchscript_folded", "dynamo"])
def test_trained_weights_load_into_the_torch_module(tmp_path, exporter):
    torch.manual_seed(0)
    module = Block().eval()
    x = torch.randn(4, 5, 6)
    kwargs = {"torchscript": dict(dynamo=False, do_constant_folding=False, dynamic_axes={"x": {0: "N"}}),
              "torchscript_folded": dict(dynamo=False, dynamic_axes={"x": {0: "N"}}),
              "dynamo": dict(dynamo=True, optimize=False)}[exporter]
    model = _export(module, x, tmp_path / "m.onnx", **kwargs)
    if exporter.startswith("torchscript"):
        record_torch_names(model, module.state_dict())
        assert any(m.key == KEY for m in model.metadata_props)
    if exporter == "torchscript_folded":
        assert any(t.name.startswith("onnx::MatMul") for t in model.graph.initializer)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the builder says it untied the merged LayerNorm parameters
        session = TrainingSession(build_training_model(model, "mse", Adam(lr=1e-2)))
    session.save(tmp_path / "ckpt.onnx")  # the mapping survives a checkpoint
    session = TrainingSession(str(tmp_path / "ckpt.onnx"))
    rng = np.random.default_rng(0)
    for _ in range(3):
        session.step({"x": rng.normal(size=(4, 5, 6)).astype(np.float32),
                      "target": rng.normal(size=(4, 5, 3)).astype(np.float32)})
    state = session.to_torch_state_dict()
    assert set(state) == set(module.state_dict())
    trained = Block().eval()
    trained.load_state_dict(state, strict=True)
    assert not torch.equal(trained.a.weight, module.a.weight)  # the weights did change
    assert not torch.equal(trained.n.bias, trained.n2.bias)  # and the merged LayerNorms trained apart
    probe = rng.normal(size=(4, 5, 6)).astype(np.float32)  # dynamo: the example batch size
    expected = ort.InferenceSession(session.export_inference_model().SerializeToString()).run(None, {"x": probe})[0]
    with torch.no_grad():
        np.testing.assert_allclose(trained(torch.from_numpy(probe)).numpy(), expected, rtol=1e-5, atol=1e-5)


def test_equal_untied_weights_under_exporter_names_are_ambiguous(tmp_path):
    module = Block().eval()
    with torch.no_grad():
        module.b.weight.copy_(torch.zeros(3, 8))
    extra = torch.nn.Linear(8, 3)
    with torch.no_grad():
        extra.weight.zero_()
    model = _export(module, torch.randn(2, 5, 6), tmp_path / "m.onnx", dynamo=False)
    state = {**module.state_dict(), "other.weight": extra.weight}
    from onnx_training_ops.errors import TrainingOpError
    with pytest.raises(TrainingOpError, match="equals 2 different torch tensors"):
        torch_name_map(model, state)
