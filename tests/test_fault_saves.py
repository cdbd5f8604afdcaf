"""Fault suite, saves (issue 20 item 6): concurrent saves to names that share a prefix, a
Ctrl-C right after the temporary file is created, a read-only directory. Before the fix a
save to ``ck.onnx`` deleted the in-flight temporary of a save to ``ck.onnx.bak`` (7-12 of 50
concurrent saves failed) and an interrupted save left its temporary behind for good."""

from __future__ import annotations

import os
import threading

import numpy as np
import pytest
from test_interrupts import ctrl_c, default_sigint_handler  # noqa: F401 - the fixture

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.storage import checkpoint

NAMES = ["ck.onnx", "ck.onnx.bak", "ck.onnx.1", "ck.onnx.tmp"]


def _session(seed: int) -> ot.TrainingSession:
    return ot.TrainingSession(ot.build_training_model(make_mlp((64, 256, 10), seed=seed), "cross_entropy",
                                                      ot.Adam(lr=1e-3)))


def test_concurrent_saves_to_names_sharing_a_prefix_all_land(tmp_path):
    sessions = [_session(seed) for seed in range(len(NAMES))]
    failures: list[str] = []

    def save_many(session, name):
        for _ in range(12):
            try:
                session.save(tmp_path / name)
            except Exception as error:  # noqa: BLE001 - every failure counts
                failures.append(f"{name}: {error!r}")

    threads = [threading.Thread(target=save_many, args=pair) for pair in zip(sessions, NAMES)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    assert sorted(os.listdir(tmp_path)) == sorted(NAMES)  # no temporary left
    for session, name in zip(sessions, NAMES):
        loaded = ot.TrainingSession(tmp_path / name).state_dict()
        for key, value in session.state_dict().items():
            np.testing.assert_array_equal(loaded[key], value, err_msg=f"{name}: {key}")


def test_ctrl_c_right_after_the_temporary_is_created_leaves_nothing(tmp_path, monkeypatch):
    path = tmp_path / "ck.onnx"
    checkpoint.atomic_write(path, b"old")
    real = checkpoint.tempfile.mkstemp

    def mkstemp_then_ctrl_c(*args, **kwargs):
        made = real(*args, **kwargs)
        ctrl_c()
        return made

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", mkstemp_then_ctrl_c)
    with pytest.raises(KeyboardInterrupt):
        checkpoint.atomic_write(path, b"new")
    assert os.listdir(tmp_path) == ["ck.onnx"] and path.read_bytes() == b"old"


def test_this_processs_own_leftover_temporary_is_removed_by_the_next_save(tmp_path):
    leftover = tmp_path / f".ck.onnx.{os.getpid()}.abc123.tmp"  # an earlier write cut short
    other = tmp_path / f".ck.onnx.bak.{os.getpid()}.abc123.tmp"  # another name's: not ours
    leftover.write_bytes(b"partial")
    other.write_bytes(b"partial")
    checkpoint.atomic_write(tmp_path / "ck.onnx", b"new")
    assert not leftover.exists() and other.exists()


def test_a_read_only_directory_names_the_path_given(tmp_path, monkeypatch):
    """As the OS answers in a read-only directory (root, who runs CI, may write anywhere:
    the refusal is injected where it happens, at the temporary's creation)."""
    def refused(prefix="", suffix="", dir=None):
        raise PermissionError(13, "Permission denied", os.path.join(dir, f"{prefix}x1y2z3{suffix}"))

    monkeypatch.setattr(checkpoint.tempfile, "mkstemp", refused)
    with pytest.raises(ot.TrainingOpError, match=r"cannot write '.*ck\.onnx': Permission denied") as info:
        _session(0).save(tmp_path / "ck.onnx")
    assert ".tmp" not in str(info.value) and isinstance(info.value, OSError)
