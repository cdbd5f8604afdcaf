"""The command line under faults a user meets: data files that are not UTF-8, a damaged log in --out, a run
stopped after its last checkpoint, Ctrl-C, a plain install without tqdm/matplotlib, a reader that closes
stdout. Each is exit 2 with one line, or the run goes on; nothing is lost."""

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from onnx_training_ops import TrainingSession
from onnx_training_ops.cli import main
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.kernels.compile_notice import MESSAGE as COMPILE_NOTICE


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A 4-8-3 MLP's training model (Adam) and 40 samples as .npz and as a UTF-8 .csv."""
    root = tmp_path_factory.mktemp("tiny")
    onnx.save(make_mlp((4, 8, 3)), root / "mlp.onnx")
    assert main(["build", str(root / "mlp.onnx"), str(root / "train.onnx"), "--loss", "cross_entropy",
                 "--optimizer", "adam", "--lr", "1e-2"]) == 0
    rng = np.random.default_rng(0)
    x, y = rng.normal(size=(40, 4)).astype(np.float32), rng.integers(0, 3, 40)
    np.savez(root / "data.npz", input=x, labels=y)
    header = "input[0],input[1],input[2],input[3],labels\n"
    body = "".join(",".join([repr(float(v)) for v in row] + [str(label)]) + "\n" for row, label in zip(x, y))
    (root / "data.csv").write_text(header + body, encoding="utf-8")
    return root, header, body


def _train(root, out, *extra, data="data.npz"):
    return main(["train", str(root / "train.onnx"), "--data", str(root / data), "--batch-size", "16",
                 "--out", str(out), "--no-plot", *extra])


def _errors(capsys):
    """stderr's lines, less the first-run notice that the kernels compile (a fresh install's)."""
    return [line for line in capsys.readouterr().err.splitlines() if line.strip() and line != COMPILE_NOTICE]


@pytest.mark.parametrize("kind, message", [
    ("latin-1", "is not UTF-8 text (byte 0xe9 on line 1)"),
    ("utf-16", "is UTF-16 text"),
    ("utf-32", "is UTF-32 text"),
    ("binary", "is not UTF-8 text"),
    ("nul", "holds NUL bytes"),
])
def test_a_csv_that_is_not_utf8_text_exits_2_with_one_line(tiny, tmp_path, capsys, kind, message):
    root, header, body = tiny
    text = header.replace("labels", "étiquette") + body
    data = {"latin-1": text.encode("latin-1"), "utf-16": text.encode("utf-16"), "utf-32": text.encode("utf-32"),
            "binary": bytes(range(256)) * 4, "nul": (header + body).encode().replace(b",", b"\0", 1)}[kind]
    (tmp_path / "data.csv").write_bytes(data)
    capsys.readouterr()
    assert main(["train", str(root / "train.onnx"), "--data", str(tmp_path / "data.csv"), "--out",
                 str(tmp_path / "out"), "--no-progress", "--no-plot"]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and err[0].startswith("error: data file") and message in err[0], err
    assert not (tmp_path / "out").exists()


def test_a_utf8_csv_with_a_byte_order_mark_trains_as_without(tiny, tmp_path):
    root, header, body = tiny
    (tmp_path / "bom.csv").write_bytes(b"\xef\xbb\xbf" + (header + body).encode())
    assert _train(root, tmp_path / "plain", "--no-progress", data="data.csv") == 0
    assert main(["train", str(root / "train.onnx"), "--data", str(tmp_path / "bom.csv"), "--batch-size", "16",
                 "--out", str(tmp_path / "bom"), "--no-plot", "--no-progress"]) == 0
    rows = [[{k: v for k, v in json.loads(line).items() if k != "seconds"}
             for line in (tmp_path / run / "metrics.jsonl").read_text().splitlines()] for run in ("plain", "bom")]
    assert rows[0] == rows[1]


@pytest.mark.parametrize("damage", ["cut", "garbage", "latin-1", "not-a-row"])
def test_a_damaged_log_never_stops_a_resume(tiny, tmp_path, capsys, damage):
    root, _, _ = tiny
    out = tmp_path / "run"
    assert _train(root, out, "--epochs", "2", "--no-progress") == 0
    log = out / "metrics.jsonl"
    good = log.read_bytes()
    first, second = good.splitlines()
    damaged = {"cut": good[:-7], "garbage": good + b"{not json\n", "latin-1": first + b"\n\xe9t\xe9\n" + second,
               "not-a-row": good + b"[1, 2]\n"}[damage]
    log.write_bytes(damaged)
    capsys.readouterr()
    assert _train(root, out, "--epochs", "3", "--no-progress") == 0
    err = _errors(capsys)
    warnings = [line for line in err if line.startswith("warning:")]
    assert len(warnings) == 1 and "resumes from its checkpoint" in warnings[0]
    assert "metrics.jsonl.damaged" in warnings[0]
    assert (out / "metrics.jsonl.damaged").read_bytes() == damaged  # the file as found is kept
    epochs = [json.loads(line)["epoch"] for line in log.read_text().splitlines()]
    assert epochs == ([1, 3] if damage == "cut" else [1, 2, 3])  # every readable row kept, the new one added
    assert TrainingSession(str(out / "checkpoint.onnx")).properties["epoch"] == 3


def test_a_run_stopped_after_its_last_checkpoint_writes_its_inference_model_when_rerun(tiny, tmp_path, capsys,
                                                                                        monkeypatch):
    root, _, _ = tiny
    out = tmp_path / "run"
    real = TrainingSession.export_inference_model

    def stopped(self, path=None, outputs=None):
        if path is not None:
            raise KeyboardInterrupt
        return real(self, path, outputs)

    for epochs, stale in (("1", False), ("2", True)):  # no inference model yet; then one of epoch 1
        monkeypatch.setattr(TrainingSession, "export_inference_model", stopped)
        assert _train(root, out, "--epochs", epochs, "--no-progress") == 130
        err = _errors(capsys)
        assert err[-1] == f"interrupted: the same command resumes from {out / 'checkpoint.onnx'}"
        assert (out / "inference_model.onnx").exists() == stale
        monkeypatch.setattr(TrainingSession, "export_inference_model", real)
        assert _train(root, out, "--epochs", epochs, "--no-progress") == 0
        assert f"wrote {out / 'inference_model.onnx'}" in capsys.readouterr().out
        trained = TrainingSession(str(out / "checkpoint.onnx")).export_inference_model()
        assert onnx.load(out / "inference_model.onnx") == trained
        assert _train(root, out, "--epochs", epochs, "--no-progress") == 2  # now a finished run: nothing to do
        assert "nothing to train" in _errors(capsys)[-1]


def test_ctrl_c_says_whether_the_same_command_resumes(tiny, tmp_path, capsys, monkeypatch):
    root, _, _ = tiny
    real, calls = TrainingSession.step, [0]

    def interrupted_at(n):
        def step(self, *a, **k):
            calls[0] += 1
            if calls[0] == n:
                raise KeyboardInterrupt
            return real(self, *a, **k)
        return step

    monkeypatch.setattr(TrainingSession, "step", interrupted_at(2))  # in epoch 1: no checkpoint yet
    assert _train(root, tmp_path / "a", "--epochs", "3", "--no-progress") == 130
    assert _errors(capsys)[-1] == "interrupted: no checkpoint was written yet: the same command starts again"
    calls[0] = 0
    monkeypatch.setattr(TrainingSession, "step", interrupted_at(5))  # in epoch 2 (3 steps each)
    assert _train(root, tmp_path / "b", "--epochs", "3", "--no-progress") == 130
    assert _errors(capsys)[-1] == f"interrupted: the same command resumes from {tmp_path / 'b' / 'checkpoint.onnx'}"
    monkeypatch.setattr(TrainingSession, "step", real)
    assert _train(root, tmp_path / "b", "--epochs", "3", "--no-progress") == 0


def test_a_plain_install_without_tqdm_or_matplotlib_trains(tiny, tmp_path, capsys, monkeypatch):
    root, _, _ = tiny
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda n, *a: None if n in ("tqdm", "matplotlib") else real(n, *a))
    monkeypatch.setitem(sys.modules, "tqdm", None)  # an import would fail as on a plain install
    assert main(["train", str(root / "train.onnx"), "--data", str(root / "data.npz"), "--batch-size", "16",
                 "--epochs", "2", "--out", str(tmp_path)]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[0].startswith("note: no loss_curve.png: matplotlib is not installed") and "[cli]" in err[0]
    assert err[1:] == ["training: 3/6 steps, epoch 1, loss " + err[1].rsplit(" ", 1)[1],
                       "training: 6/6 steps, epoch 2, loss " + err[2].rsplit(" ", 1)[1]]
    assert (tmp_path / "inference_model.onnx").exists() and not (tmp_path / "loss_curve.png").exists()
    assert "loss_curve.png" not in captured.out


def test_a_wrong_column_lists_the_data_inputs_only(tiny, tmp_path, capsys):
    root, _, _ = tiny
    np.savez(tmp_path / "bad.npz", inputs=np.zeros((4, 4), np.float32), labels=np.zeros(4, np.int64))
    np.savez(tmp_path / "lr.npz", input=np.zeros((4, 4), np.float32), labels=np.zeros(4, np.int64),
             learning_rate=np.full(4, 0.1, np.float32))
    for name, message in (("bad.npz", "'inputs' is not an input of the model; inputs: input, labels"),
                          ("lr.npz", "'learning_rate' is not an input of the model; inputs: input, labels")):
        capsys.readouterr()
        assert main(["train", str(root / "train.onnx"), "--data", str(tmp_path / name), "--out",
                     str(tmp_path / "out"), "--no-progress", "--no-plot"]) == 2
        err = _errors(capsys)
        assert len(err) == 1 and err[0].endswith(message), err


@pytest.mark.parametrize("name, text, message", [
    ("data.csv", "input[0],labels\n1.0,x\n", "every value must be a number"),
    ("eval.csv", "input[0],labels\n1.0\n", "row 2 has 1 values, the header 2"),
])
def test_a_bad_data_file_fails_before_the_session_opens(tiny, tmp_path, capsys, monkeypatch, name, text, message):
    """--data and --eval-data are read and checked first: a bad file is told at once, not after the
    session opened (on a fresh install, after a minute of compiling kernels)."""
    import onnx_training_ops.training as training

    root, header, body = tiny
    (tmp_path / "data.csv").write_text(header + body, encoding="utf-8")
    (tmp_path / name).write_text(text, encoding="utf-8")

    def never(*args, **kwargs):
        raise AssertionError("the session was opened before the data was read")

    monkeypatch.setattr(training, "TrainingSession", never)
    capsys.readouterr()
    assert main(["train", str(root / "train.onnx"), "--data", str(tmp_path / "data.csv"), "--eval-data",
                 str(tmp_path / ("eval.csv" if name == "eval.csv" else "data.csv")), "--out", str(tmp_path / "out"),
                 "--no-progress", "--no-plot"]) == 2
    err = _errors(capsys)
    assert len(err) == 1 and message in err[0] and name in err[0], err


def test_the_written_files_are_named_without_a_double_slash(tiny, tmp_path, capsys, monkeypatch):
    root, _, _ = tiny
    monkeypatch.chdir(tmp_path)
    assert main(["train", str(root / "train.onnx"), "--data", str(root / "data.npz"), "--epochs", "1",
                 "--out", "run1/", "--no-progress", "--no-plot"]) == 0
    out = capsys.readouterr().out
    assert "wrote run1/{checkpoint.onnx, metrics.jsonl, inference_model.onnx}" in out and "//" not in out


def test_a_reader_that_closes_stdout_ends_summary_quietly(tiny):
    """``summary | head``: no 'Broken pipe' on stderr, the status a shell gives a tool SIGPIPE ended."""
    root, _, _ = tiny
    read, write = os.pipe()
    os.close(read)  # the reader is gone before the first line
    try:
        result = subprocess.run([sys.executable, "-m", "onnx_training_ops", "summary", str(root / "train.onnx")],
                                stdout=write, stderr=subprocess.PIPE, text=True, timeout=120)
    finally:
        os.close(write)
    assert result.stderr == "" and result.returncode == 141


def test_ctrl_c_elsewhere_is_one_word(monkeypatch, capsys):
    import onnx_training_ops.cli as cli

    def interrupted(args):
        raise KeyboardInterrupt

    monkeypatch.setattr(cli, "_conformance", interrupted)
    assert main(["conformance"]) == 130
    assert _errors(capsys) == ["interrupted"]


def test_export_for_training_without_torch_names_the_extra(monkeypatch):
    """A missing extra is a one-line hint, never an ImportError's traceback."""
    from onnx_training_ops.errors import TrainingOpError
    from onnx_training_ops.export.from_torch import export_for_training

    monkeypatch.setitem(sys.modules, "torch", None)  # `import torch` raises ImportError
    with pytest.raises(TrainingOpError, match=r"^export_for_training needs torch: pip install "
                                              r"'onnx-training-ops\[torch\]'$"):
        export_for_training(object(), (np.zeros(1),), "model.onnx", input_names=["x"], output_names=["y"])
