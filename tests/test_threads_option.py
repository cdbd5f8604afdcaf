"""``TrainingSession(threads=N)``, ``train --threads N`` and the memory defaults applied to
what the caller's ``sess_options`` leave at onnxruntime's defaults (issue 29, core C).
Read back from the onnxruntime sessions themselves (``get_session_options``)."""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest

import onnx_training_ops as ot
from onnx_training_ops.cli import build_parser, main
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.training.options.options import fresh_options


def _model():
    return ot.build_training_model(make_mlp(sizes=(6, 8, 4)), "cross_entropy", ot.Adam())


def _options(session: ot.TrainingSession) -> list[ort.SessionOptions]:
    """The options of every onnxruntime session it opened (step, evaluate, run)."""
    feeds = {"input": np.zeros((2, 6), np.float32), "labels": np.zeros(2, np.int64)}
    session.step(feeds)
    session.evaluate(feeds)
    session.run(["logits"], {"input": feeds["input"]})
    sessions = session._programs.sessions()
    return [s.get_session_options() for s in sessions]


def _entry(so: ort.SessionOptions, key: str) -> str | None:
    try:
        return so.get_session_config_entry(key)
    except Exception:  # noqa: BLE001 - absent
        return None


@pytest.mark.parametrize("threads", [1, 2, 0])
def test_threads_reach_every_onnxruntime_session(threads):
    for so in _options(ot.TrainingSession(_model(), threads=threads)):
        assert so.intra_op_num_threads == threads


def test_default_threads_one_for_a_small_model():
    assert {so.intra_op_num_threads for so in _options(ot.TrainingSession(_model()))} == {1}


def test_sess_options_left_at_defaults_get_the_memory_defaults():
    """Before: passing SessionOptions() dropped the memory defaults (mem pattern on, no shared arena)."""
    for so in _options(ot.TrainingSession(_model(), sess_options=ort.SessionOptions())):
        assert so.enable_mem_pattern is False
        assert _entry(so, "session.use_env_allocators") == "1"
        assert so.intra_op_num_threads == 1  # a small model: the default thread count too


def test_what_the_caller_sets_rules():
    mine = ort.SessionOptions()
    mine.enable_cpu_mem_arena = False  # no arena: then no shared arena either
    mine.intra_op_num_threads = 2
    mine.add_session_config_entry("session.disable_prepacking", "1")
    for so in _options(ot.TrainingSession(_model(), sess_options=mine)):
        assert so.enable_cpu_mem_arena is False
        assert _entry(so, "session.use_env_allocators") is None
        assert so.intra_op_num_threads == 2
        assert _entry(so, "session.disable_prepacking") == "1"
        assert so.enable_mem_pattern is False
    assert mine.enable_mem_pattern is True  # the caller's own object is not changed


def test_large_model_defaults_apply_to_defaults_left():
    so = fresh_options(ort.SessionOptions(), {}, large=True)
    assert so.enable_cpu_mem_arena is True and so.enable_mem_pattern is False
    assert _entry(so, "session.disable_prepacking") == "1" and _entry(so, "session.use_env_allocators") == "1"
    no_arena = ort.SessionOptions()
    no_arena.enable_cpu_mem_arena = False
    assert _entry(fresh_options(no_arena, {}, large=True), "session.use_env_allocators") is None
    kept = ort.SessionOptions()
    kept.add_session_config_entry("session.disable_prepacking", "0")
    assert _entry(fresh_options(kept, {}, large=True), "session.disable_prepacking") == "0"


def test_threads_and_sess_options_together():
    mine = ort.SessionOptions()
    mine.intra_op_num_threads = 2
    with pytest.raises(ot.TrainingOpError, match=r"threads=1 but sess_options.intra_op_num_threads is 2"):
        ot.TrainingSession(_model(), sess_options=mine, threads=1)
    assert {so.intra_op_num_threads for so in _options(ot.TrainingSession(_model(), sess_options=mine,
                                                                          threads=2))} == {2}
    plain = ort.SessionOptions()  # 0 there: threads= decides
    assert {so.intra_op_num_threads for so in _options(ot.TrainingSession(_model(), sess_options=plain,
                                                                          threads=2))} == {2}


@pytest.mark.parametrize("bad", [-1, 1.5, "2", True])
def test_bad_threads_refused(bad):
    with pytest.raises(ot.TrainingOpError, match="threads must be a whole number >= 0"):
        ot.TrainingSession(_model(), threads=bad)


def test_with_model_keeps_threads():
    s = ot.TrainingSession(_model(), threads=2)
    assert {so.intra_op_num_threads for so in _options(s.with_model(_model()))} == {2}


def test_cli_train_threads(capsys):
    assert build_parser().parse_args(["train", "--threads", "2"]).threads == 2
    assert build_parser().parse_args(["train"]).threads is None
    with pytest.raises(SystemExit):
        build_parser().parse_args(["train", "--threads", "-1"])
    assert "must be a whole number >= 0" in capsys.readouterr().err
    assert main(["train", "--threads", "2"]) != 0  # the digits demo: its own thread count
    assert "--threads needs a training model" in capsys.readouterr().err


def test_cli_train_passes_threads_to_the_session(tmp_path, monkeypatch):
    """``train MODEL --threads N`` opens its TrainingSession with threads=N (not options that would
    drop the package's memory defaults)."""
    import onnx

    from onnx_training_ops.cli import train as cli_train

    path = tmp_path / "training.onnx"
    onnx.save(_model(), path)
    seen = {}
    real = ot.TrainingSession.__init__

    def spy(self, *args, **kwargs):
        seen.update(kwargs)
        real(self, *args, **kwargs)

    monkeypatch.setattr(ot.TrainingSession, "__init__", spy)
    args = build_parser().parse_args(["train", str(path), "--threads", "2", "--out", str(tmp_path / "out")])
    cli_train._open(args)
    assert seen.get("threads") == 2 and seen.get("sess_options") is None
