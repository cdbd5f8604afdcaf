"""The command line's main job: build a training model, train it on scikit-learn's digits (.npz,
.csv, .safetensors), resume, summary; bad input exits 2 with one line."""

import json

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_training_ops import TrainingSession
from onnx_training_ops.cli import main
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.kernels.compile_notice import MESSAGE as COMPILE_NOTICE
from onnx_training_ops.storage.safetensors import encode

pytest.importorskip("sklearn")


@pytest.fixture(scope="module")
def digits(tmp_path_factory):
    """The digits as .npz (train / held-out), an MLP inference model and its training model."""
    from sklearn.datasets import load_digits

    d = load_digits()
    x, y = (d.data / 16.0).astype(np.float32), d.target.astype(np.int64)
    root = tmp_path_factory.mktemp("digits")
    np.savez(root / "train.npz", input=x[:1400], labels=y[:1400])
    np.savez(root / "test.npz", input=x[1400:], labels=y[1400:])
    onnx.save(make_mlp((64, 32, 10)), root / "mlp.onnx")
    assert main(["build", str(root / "mlp.onnx"), str(root / "train.onnx"), "--loss", "cross_entropy",
                 "--optimizer", "adamw", "--lr", "1e-2", "--weight-decay", "1e-4"]) == 0
    return root, x, y


def _train(root, out, *extra):
    return main(["train", str(root / "train.onnx"), "--data", str(root / "train.npz"), "--batch-size", "64",
                 "--out", str(out), "--no-progress", *extra])


def _rows(out):
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    for r in rows:
        r.pop("seconds")
    return rows


def test_build_then_train_learns_the_digits(digits, tmp_path, capsys):
    root, x, y = digits
    out = tmp_path / "run"
    assert _train(root, out, "--epochs", "4", "--eval-data", str(root / "test.npz"), "--schedule", "cosine") == 0
    rows = _rows(out)
    assert [r["epoch"] for r in rows] == [1, 2, 3, 4] and rows[-1]["steps"] == 4 * 22
    assert rows[-1]["train_loss"] < rows[0]["train_loss"] and rows[-1]["eval_loss"] < rows[0]["eval_loss"]
    assert rows[0]["lr"] == pytest.approx(1e-2) and rows[-1]["lr"] < rows[1]["lr"]  # cosine
    assert (out / "loss_curve.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    logits = ort.InferenceSession(str(out / "inference_model.onnx")).run(None, {"input": x[1400:]})[0]
    assert np.mean(logits.argmax(1) == y[1400:]) > 0.85
    # the held-out loss it logged is the inference model's cross-entropy on the same data
    z = logits - logits.max(1, keepdims=True)
    nll = -(z[np.arange(len(z)), y[1400:]] - np.log(np.exp(z).sum(1))).mean()
    assert rows[-1]["eval_loss"] == pytest.approx(nll, rel=1e-5)


def test_an_interrupted_run_resumes_to_the_result_of_one_run(digits, tmp_path, monkeypatch, capsys):
    root, _, _ = digits
    args = ("--epochs", "3", "--schedule", "warmup_cosine:warmup_steps=10")
    assert _train(root, tmp_path / "whole", *args) == 0
    real_step, calls = TrainingSession.step, [0]

    def interrupted(self, *a, **k):
        calls[0] += 1
        if calls[0] == 30:  # in the second epoch (22 steps each)
            raise KeyboardInterrupt
        return real_step(self, *a, **k)

    monkeypatch.setattr(TrainingSession, "step", interrupted)
    assert _train(root, tmp_path / "parts", *args) == 130
    monkeypatch.setattr(TrainingSession, "step", real_step)
    assert [r["epoch"] for r in _rows(tmp_path / "parts")] == [1]
    assert _train(root, tmp_path / "parts", *args) == 0
    assert _rows(tmp_path / "parts") == _rows(tmp_path / "whole")
    whole = TrainingSession(str(tmp_path / "whole" / "checkpoint.onnx")).state_dict()
    parts = TrainingSession(str(tmp_path / "parts" / "checkpoint.onnx")).state_dict()
    assert whole.keys() == parts.keys() and all(np.array_equal(whole[k], parts[k]) for k in whole)
    # a finished run is no silent no-op; a run with other settings is refused
    assert _train(root, tmp_path / "parts", *args) == 2
    assert _train(root, tmp_path / "parts", "--epochs", "4", "--batch-size", "32") == 2
    assert _train(root, tmp_path / "parts", "--epochs", "4", "--schedule", "warmup_cosine:warmup_steps=10") == 2
    err = [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]
    assert "nothing to train" in err[0] and "--batch-size 64, this run asks 32" in err[1]
    assert "sized for --epochs 3, this run asks 4" in err[2]
    # without a schedule a larger --epochs trains further
    assert _train(root, tmp_path / "plain", "--epochs", "1") == 0
    assert _train(root, tmp_path / "plain", "--epochs", "2") == 0
    assert [r["epoch"] for r in _rows(tmp_path / "plain")] == [1, 2]


def test_csv_and_safetensors_train_exactly_as_npz(digits, tmp_path):
    root, x, y = digits
    header = ",".join([f"input[{i}]" for i in range(64)] + ["digit"])  # the label column last, unnamed
    body = "\n".join(",".join([repr(float(v)) for v in row] + [str(label)]) for row, label in zip(x[:1400], y[:1400]))
    (tmp_path / "train.csv").write_text(header + "\n" + body + "\n")
    (tmp_path / "train.safetensors").write_bytes(encode({"input": x[:1400], "labels": y[:1400]}))
    for name in ("train.npz", str(tmp_path / "train.csv"), str(tmp_path / "train.safetensors")):
        data = root / name if name == "train.npz" else name
        assert main(["train", str(root / "train.onnx"), "--data", str(data), "--epochs", "1", "--out",
                     str(tmp_path / name.replace("/", "_")), "--no-progress", "--no-plot"]) == 0
    rows = [_rows(tmp_path / name.replace("/", "_")) for name in
            ("train.npz", str(tmp_path / "train.csv"), str(tmp_path / "train.safetensors"))]
    assert rows[0] == rows[1] == rows[2]


def test_build_options_and_summary(digits, tmp_path, capsys):
    root, _, _ = digits
    out = tmp_path / "frozen.onnx"
    assert main(["build", str(root / "mlp.onnx"), str(out), "--loss", "cross_entropy", "--optimizer", "sgd",
                 "--lr", "0.1", "--freeze", "b*"]) == 0
    capsys.readouterr()
    assert main(["summary", str(out), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in s["trainable"]] == ["W0", "W1"] and [t["name"] for t in s["frozen"]] == ["b0", "b1"]
    assert s["optimizer"]["type"] == "Momentum" and s["optimizer"]["momentum"] == 0.0
    assert s["trainable_count"] == 64 * 32 + 32 * 10
    assert main(["build", str(root / "mlp.onnx"), str(out), "--loss", "mse", "--optimizer", "adam",
                 "--trainable", "W*", "b1"]) == 0
    assert main(["summary", str(out)]) == 0
    text = capsys.readouterr().out
    assert "trainable: 3 tensors" in text and "Adam(" in text and "Gemm x2" in text
    assert main(["summary", str(root / "mlp.onnx"), "--json"]) == 0  # an inference model
    s = json.loads(capsys.readouterr().out)
    assert s["training"] is False and s["trainable_count"] == 64 * 32 + 32 + 32 * 10 + 10


@pytest.mark.parametrize("argv, message", [
    (["train", "{root}/train.onnx", "--data", "{root}/missing.npz"], "does not exist"),
    (["train", "{root}/mlp.onnx", "--data", "{root}/train.npz"], "no training_info"),
    (["train", "{root}/train.onnx", "--data", "{root}/bad.npz"], "'pixels' is not an input"),
    (["train", "{root}/train.onnx", "--data", "{root}/train.npz", "--schedule", "cosin"], "expected one of"),
    (["train", "{root}/train.onnx", "--data", "{root}/train.npz", "--optimizer", "adam"],
     "--optimizer: options of the demo"),
    (["train", "--data", "{root}/train.npz"], "needs a training model"),
    (["train", "{root}/train.onnx", "--data", "{root}/train.npz", "--device", "tpu"],
     "device must be 'cpu', 'cuda', 'cuda:N' or 'dml', found 'tpu'"),
    (["train", "--nproc", "2", "--device", "cuda:1"], "--device cuda:1 with --nproc: give cpu or cuda"),
    (["build", "{root}/mlp.onnx", "{out}", "--loss", "cross_entropy", "--trainable", "nope*"],
     "matches no initializer"),
    (["build", "{root}/mlp.onnx", "{out}", "--loss", "mse", "--class-axis", "1"], "--class-axis: options of"),
    (["build", "{root}/mlp.onnx", "{out}", "--loss", "cross_entropy", "--optimizer", "adagrad", "--momentum", "0.9"],
     "--momentum is not an option of --optimizer adagrad"),
    (["summary", "{root}/nothing.onnx"], "nothing.onnx"),
])
def test_bad_input_exits_2_with_one_line(digits, tmp_path, capsys, argv, message):
    root, x, _ = digits
    np.savez(root / "bad.npz", pixels=x[:10], labels=np.zeros(10, np.int64))
    argv = [a.format(root=root, out=tmp_path / "o.onnx") for a in argv] + ["--no-progress"] * (argv[0] == "train")
    assert main([*argv, "--out", str(tmp_path / "out")] if argv[0] == "train" else argv) == 2
    err = [line for line in capsys.readouterr().err.strip().splitlines() if line != COMPILE_NOTICE]  # first run's
    assert len(err) == 1 and err[0].startswith("error: ") and message in err[0], err
    assert not (tmp_path / "o.onnx").exists()


def test_trainable_patterns_see_parameters_the_torchscript_exporter_merged(tmp_path, capsys):
    """An Identity alias (TorchScript's merge of equal values) is a parameter --trainable can name."""
    model = make_mlp((4, 8, 8))
    inits = {t.name: t for t in model.graph.initializer}
    inits["b1"].CopyFrom(onnx.numpy_helper.from_array(onnx.numpy_helper.to_array(inits["b0"]), "b1"))
    model.graph.initializer.remove(inits["b1"])
    model.graph.node.insert(0, onnx.helper.make_node("Identity", ["b0"], ["b1"]))
    onnx.save(model, tmp_path / "m.onnx")
    assert main(["build", str(tmp_path / "m.onnx"), str(tmp_path / "t.onnx"), "--loss", "mse",
                 "--trainable", "W1", "b1"]) == 0
    assert "merged with an equal one" in capsys.readouterr().err
    assert main(["summary", str(tmp_path / "t.onnx"), "--json"]) == 0
    s = json.loads(capsys.readouterr().out)
    assert [t["name"] for t in s["trainable"]] == ["W1", "b1"] and {"W0", "b0"} <= {t["name"] for t in s["frozen"]}


def test_progress_bar_threads_and_device(digits, tmp_path, capsys):
    root, _, _ = digits
    assert main(["train", str(root / "train.onnx"), "--data", str(root / "train.npz"), "--epochs", "1",
                 "--threads", "1", "--device", "cpu", "--out", str(tmp_path), "--no-plot"]) == 0
    captured = capsys.readouterr()
    assert "22/22" in captured.err and "step" in captured.err  # tqdm's bar: 22 steps of 64 (the last 56)
    assert "trained 1 epoch: training loss" in captured.out and not (tmp_path / "loss_curve.png").exists()


def test_a_built_model_exports_for_javascript_without_python(digits, tmp_path):
    """build then export-step: the training step for onnxruntime-web/node/mobile from the shell."""
    root, _, _ = digits
    assert main(["export-step", str(root / "train.onnx"), str(tmp_path / "web")]) == 0
    manifest = json.loads((tmp_path / "web" / "manifest.json").read_text())
    params = [s["name"] for s in manifest["state"] if s["role"] == "parameter"]
    assert params == ["W0", "b0", "W1", "b1"] and manifest["optimizer"]["type"] == "AdamW"
    assert (tmp_path / "web" / manifest["files"]["step"]["path"]).is_file()
