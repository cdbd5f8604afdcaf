"""Rough edges a new user hits (issue 20, items 9-16): messages, CLI, warnings."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.training.state.shard import partition, shard_model

BATCH = {"input": np.zeros((2, 8), np.float32), "labels": np.zeros(2, np.int64)}


def test_sessions_with_the_users_options_leave_no_initializer_for_onnxruntime_to_remove(capfd):
    """examples/bench_ddp.py printed 16 "Removing initializer" warnings: the fast path cut the
    optimizer nodes and left their constants and learning rate in the graph."""
    model = ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", ot.AdamW())
    for source in (model, shard_model(model, partition(model, 2), 1, 2)):
        for fast in (True, False):
            session = ot.TrainingSession(source, sess_options=ort.SessionOptions(), fast=fast)
            session.backward(BATCH)
            session.optimizer_step()
            session.step(BATCH)
    assert "Removing initializer" not in capfd.readouterr().err


def _loss_output_model(batchnorm: bool):
    """x -> MatMul W [-> BatchNormalization] -> mean of squares, the loss as the model's output."""
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    inits = [numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "W"),
             numpy_helper.from_array(np.array([1.5, 0.5], np.float32), "scale"),
             numpy_helper.from_array(np.array([0.1, -0.2], np.float32), "bias"),
             numpy_helper.from_array(np.zeros(2, np.float32), "mean"),
             numpy_helper.from_array(np.ones(2, np.float32), "var")]
    nodes = [helper.make_node("MatMul", ["x", "W"], ["h"])]
    if batchnorm:
        nodes.append(helper.make_node("BatchNormalization", ["h", "scale", "bias", "mean", "var"], ["y"]))
    else:
        nodes.append(helper.make_node("Identity", ["h"], ["y"]))
    nodes += [helper.make_node("Mul", ["y", "y"], ["sq"]), helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)]
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", 3])],
                              [helper.make_tensor_value_info("loss", TensorProto.FLOAT, [])],
                              inits if batchnorm else inits[:1])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def test_optimizer_step_after_backward_with_the_models_own_loss_output():
    """Item 10: the apply stage asked for the forward pass's feeds (KeyError: 'x')."""
    x = np.random.default_rng(1).standard_normal((4, 3)).astype(np.float32)
    staged = ot.TrainingSession(ot.build_training_model(_loss_output_model(False), "loss", ot.Adam(lr=0.1)))
    whole = ot.TrainingSession(ot.build_training_model(_loss_output_model(False), "loss", ot.Adam(lr=0.1)))
    staged.backward({"x": x})
    staged.optimizer_step()
    whole.step({"x": x})
    np.testing.assert_allclose(staged.state_dict()["W"], whole.state_dict()["W"], rtol=1e-6)


def test_mode_train_with_the_models_own_loss_output_differentiates_the_training_forward():
    """The loss output was read from the eval-mode main graph: BatchNorm on running statistics
    was differentiated in mode="train", silently (found while checking item 7)."""
    torch = __import__("pytest").importorskip("torch")
    x = np.random.default_rng(1).standard_normal((6, 3)).astype(np.float32)
    session = ot.TrainingSession(ot.build_training_model(_loss_output_model(True), "loss",
                                                         ot.Momentum(lr=1.0, momentum=0.0), trainable=["W"],
                                                         mode="train"))
    W0 = session.state_dict()["W"].copy()
    session.step({"x": x})
    w = torch.tensor(W0, requires_grad=True)
    y = torch.nn.functional.batch_norm(torch.from_numpy(x) @ w, None, None, torch.tensor([1.5, 0.5]),
                                       torch.tensor([0.1, -0.2]), training=True)
    (y * y).mean().backward()
    np.testing.assert_allclose(W0 - session.state_dict()["W"], w.grad.numpy(), rtol=1e-4, atol=1e-6)


def test_a_truncated_checkpoint_says_it_is_truncated(tmp_path):
    """docs/training.md §5 promised it; the message was protobuf's 'Wire format was corrupt'."""
    import pytest

    session = ot.TrainingSession(ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", ot.Adam()))
    path = session.save(tmp_path / "ck.onnx")
    data = open(path, "rb").read()
    for cut in (len(data) // 3, len(data) - 7, 1):
        (tmp_path / "cut.onnx").write_bytes(data[:cut])
        with pytest.raises(ot.TrainingOpError, match=r"'.*cut\.onnx' is truncated: .* restore it from a complete copy"):
            ot.TrainingSession(tmp_path / "cut.onnx")
    (tmp_path / "text.onnx").write_bytes(b"not a model at all \xff\xff\xff\xff")
    with pytest.raises(ot.TrainingOpError, match="is not an ONNX model"):
        ot.TrainingSession(tmp_path / "text.onnx")


def test_properties_that_are_not_json_are_a_training_op_error(tmp_path):
    import onnx
    import pytest

    session = ot.TrainingSession(ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", ot.Adam()))
    model = session.training_model()
    for entry in model.metadata_props:
        if entry.key == "onnx_training_ops.properties":
            entry.value = "{not json"
            break
    else:
        model.metadata_props.add(key="onnx_training_ops.properties", value="{not json")
    from onnx_training_ops.storage import checkpoint

    onnx.save(checkpoint.add_checksums(model), tmp_path / "ck.onnx")
    with pytest.raises(ot.TrainingOpError, match="properties .* are not valid JSON"):
        ot.TrainingSession(tmp_path / "ck.onnx")


def test_the_docs_list_every_exit_status_of_the_cli():
    import re
    from pathlib import Path

    from onnx_training_ops import cli

    text = Path(__file__).resolve().parents[1].joinpath("docs", "semantics.md").read_text()  # Robustness
    sentence = re.search(r"The CLI exits (.*?)\. Details", text, re.S).group(1)
    listed = {int(code) for code in re.findall(r"\b(\d+) \(", sentence)}
    assert listed == {cli.EXIT_OK, cli.EXIT_FAILED, cli.EXIT_USAGE, cli.EXIT_INTERNAL, cli.EXIT_INTERRUPTED}


def test_the_documented_signatures_name_every_parameter():
    """Item 16: the README's TrainingSession signature lacked sess_options and session_config,
    docs/training.md §1 build_training_model's groups, clipping and sparse tables. The API
    reference is generated from the docstrings now: their Args name every parameter too."""
    import inspect
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    training = (root / "docs" / "training.md").read_text()
    for obj, name in ((ot.TrainingSession, "TrainingSession"), (ot.build_training_model, "build_training_model")):
        documented = re.search(rf"`{name}\((model.*?)\)", training, re.S).group(1)  # the signature
        args = inspect.getdoc(obj).split("Args:")[1].split("Raises:")[0]
        for parameter in inspect.signature(obj).parameters:
            if parameter != "self":
                assert re.search(rf"\b{parameter}\b", documented), (name, parameter)
                assert re.search(rf"^    {parameter}( \(.*\))?:", args, re.M), (name, parameter)


def test_build_training_model_says_what_loss_and_optimizer_take():
    import typing

    hints = typing.get_type_hints(ot.build_training_model)
    assert ot.CrossEntropyLoss in typing.get_args(hints["loss"]) or \
        any(issubclass(ot.CrossEntropyLoss, a) for a in typing.get_args(hints["loss"]) if isinstance(a, type))
    assert ot.RMSProp in typing.get_args(hints["optimizer"])
