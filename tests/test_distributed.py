"""Data-parallel training over loopback gloo (issue 13): 2 and 4 worker processes on this
machine equal single-process training on the full batch, keep identical state on every
rank, resume from rank 0's checkpoint exactly, and fail clearly when a worker dies."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

pytest.importorskip("torch.distributed")

from ddp_case import TABLE_ROWS, batch, embedding_batch, embedding_training_model, training_model  # noqa: E402
from onnx_training_ops import TrainingSession  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
WORKER = Path(__file__).with_name("_ddp_worker.py")
STEPS, SAVE_AT = 20, 10


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _launch(world: int, out: Path, *args: str, env_extra: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``world`` workers (as torchrun would set them up); wait for all."""
    return _launch_script(WORKER.name, world, str(out), *args, env_extra=env_extra)


def _launch_script(script: str, world: int, *args: str, env_extra: dict | None = None) -> list[subprocess.CompletedProcess]:
    """Run ``world`` copies of ``tests/<script>`` as the ranks of one job; wait for all."""
    port = _free_port()
    procs = []
    for rank in range(world):
        env = {**os.environ, "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "OMP_NUM_THREADS": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
               **(env_extra or {})}
        procs.append(subprocess.Popen([sys.executable, str(WORKER.with_name(script)), *args], cwd=ROOT, env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    done = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=180)
        done.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return done


def _ok(done) -> None:
    for rank, proc in enumerate(done):
        assert proc.returncode == 0, f"rank {rank}: {proc.stderr[-3000:]}"


def _single(dtype, first=0, last=STEPS, clip=True):
    session = TrainingSession(training_model(dtype, clip=clip))
    losses = [float(session.step({"input": x, "labels": y})["loss"])
              for x, y in (batch(k, dtype) for k in range(first, last))]
    return losses, session.state_dict()


def _ranks(out: Path, world: int):
    return [dict(np.load(out / f"rank{r}.npz")) for r in range(world)]


@pytest.fixture(scope="module")
def two_ranks(tmp_path_factory):
    """2 ranks, float64, 2 micro-batches per step (gradient accumulation), StepLR, clipping;
    rank 0 saves a checkpoint after step 10."""
    out = tmp_path_factory.mktemp("ddp2")
    _ok(_launch(2, out, "float64", "2", "0", str(STEPS), "-", str(SAVE_AT)))
    return out, _ranks(out, 2)


def test_two_ranks_equal_single_process_on_the_full_batch(two_ranks):
    _, ranks = two_ranks
    losses, state = _single(np.float64)
    for result in ranks:
        np.testing.assert_allclose(result["losses"], losses, rtol=1e-12)
        for name, value in state.items():
            np.testing.assert_allclose(result[name], value, rtol=1e-10, atol=1e-13, err_msg=name)
    assert state["optimizer.T"] == STEPS


def test_state_is_identical_on_every_rank(two_ranks):
    _, (r0, r1) = two_ranks
    assert str(r0["digest"]) == str(r1["digest"])
    for name in r0:
        if name not in ("losses", "digest"):
            assert np.array_equal(r0[name], r1[name]), name


def test_resume_from_rank0_checkpoint_continues_identically(two_ranks, tmp_path):
    out, ranks = two_ranks
    _ok(_launch(2, tmp_path, "float64", "2", str(SAVE_AT), str(STEPS), str(out / "checkpoint.onnx")))
    for before, after in zip(ranks, _ranks(tmp_path, 2)):
        assert np.array_equal(after["losses"], before["losses"][SAVE_AT:])
        for name in before:
            if name not in ("losses", "digest"):
                assert np.array_equal(after[name], before[name]), name


def test_four_ranks_float32_within_rounding(tmp_path):
    _ok(_launch(4, tmp_path, "float32", "1", "0", str(STEPS)))
    losses, state = _single(np.float32)
    ranks = _ranks(tmp_path, 4)
    assert len({str(r["digest"]) for r in ranks}) == 1
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5)
    for name, value in state.items():
        np.testing.assert_allclose(ranks[0][name], value, rtol=1e-4, atol=1e-5, err_msg=name)


def test_a_killed_worker_fails_the_job_with_a_clear_message(tmp_path):
    done = _launch(2, tmp_path, "float64", "1", "0", str(STEPS), env_extra={"DDP_TEST_DIE_AT": "1:3"})
    assert done[1].returncode == 3
    assert done[0].returncode != 0
    assert "another worker died or the network failed" in done[0].stderr, done[0].stderr[-2000:]


def test_example_under_torchrun(tmp_path):
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this Python")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    done = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()),
                           str(ROOT / "examples" / "train_ddp.py"), "--epochs", "1", "--out", str(tmp_path),
                           "--shard-optimizer-state"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "on all ranks" in done.stdout and "ZeRO-1" in done.stdout
    TrainingSession(tmp_path / "checkpoint.onnx")  # the gathered checkpoint loads whole


def test_cli_train_nproc_2(tmp_path):
    """``python -m onnx_training_ops train --nproc 2`` launches torchrun itself; a second run
    resumes from the checkpoint and trains the remaining epoch only."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "onnx_training_ops", "train", "--nproc", "2", "--out", str(tmp_path)]
    done = subprocess.run(command + ["--epochs", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 rank(s)" in done.stdout and "epoch 0:" in done.stdout
    assert TrainingSession(tmp_path / "checkpoint.onnx").properties["epoch"] == 1
    done = subprocess.run(command + ["--epochs", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "epochs 1..1" in done.stdout and "epoch 1:" in done.stdout and "epoch 0:" not in done.stdout
    # what train writes in one process, rank 0 writes too (issue 20 item 14)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["ranks"] == 2 and len(summary["held_out_losses_per_epoch"]) == 2
    assert (tmp_path / "inference_model.onnx").exists() and (tmp_path / "loss_curve.png").exists()
    # a finished checkpoint is no silent no-op ("epochs 5..4, 0 steps/s", exit 0)
    done = subprocess.run(command + ["--epochs", "2"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 2 and "already holds 2 epoch(s) and --epochs is 2: nothing to train" in done.stderr


def test_resuming_with_another_optimizer_is_refused(tmp_path):
    from onnx_training_ops import Adam, build_training_model
    from onnx_training_ops.demo import make_mlp
    from onnx_training_ops.demo_ddp import refusal

    session = TrainingSession(build_training_model(make_mlp((64, 8, 10)), "cross_entropy", Adam()))
    session.properties["epoch"] = 1
    path = session.save(tmp_path / "checkpoint.onnx")
    assert refusal(path, 3, "adam") == ""
    assert "was trained with Adam; --optimizer momentum cannot resume it" in refusal(path, 3, "momentum")
    assert "already holds 1 epoch(s) and --epochs is 1" in refusal(path, 1, "adam")
