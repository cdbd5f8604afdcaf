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

from ddp_case import (  # noqa: E402
    TABLE_ROWS,
    batch,
    embedding_batch,
    embedding_training_model,
    open_session,
    training_model,
)

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


def _launch_script(script: str, world: int, *args: str,
                   env_extra: dict | None = None) -> list[subprocess.CompletedProcess]:
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


ENGINE_RUNS = ["cpu-0-1-mlp", "device-0-1-mlp", "device-1-0-mlp", "host-0-0-emb", "host-1-0-emb", "device-1-0-emb",
               "device-0-1-mlp-die"]


def _run(out: Path, run: str, world: int = 2) -> list[dict]:
    return [dict(np.load(out / f"{run}.rank{r}.npz")) for r in range(world)]


def _assert_close(result: dict, losses, state: dict) -> None:
    np.testing.assert_allclose(result["losses"], losses, rtol=1e-12)
    for name, value in state.items():
        np.testing.assert_allclose(result[name], value, rtol=1e-10, atol=1e-13, err_msg=name)


def test_every_engine_two_ranks_equal_one_process(two_ranks, tmp_path):
    """One launch, seven runs. The update in the graph (``device="cpu"``), its state in host
    arrays (``torch.from_numpy``) or in onnxruntime-allocated OrtValues as on a GPU
    (``torch.from_dlpack``): 2 ranks on half batches (2 micro-batches each) equal one process on
    the full batch (float64, 1e-10), bit for bit the host engine's 2-rank run; ZeRO-1 without
    clipping (gradients reduced to their owners). Lazy Adam on a table, host engine unsharded and
    ZeRO-1, device memory ZeRO-1: each rank scatters its rows' gradients and a touched count
    into the flat buffer; after the reduction the rows touched on any rank are updated (and
    only they), as one process on the full batch does. Last, rank 1 is killed after step 3:
    rank 0's next collective stops it with the message."""
    done = _launch(2, tmp_path, "float64", "2", "0", str(STEPS), env_extra={"DDP_TEST_RUNS": ",".join(ENGINE_RUNS)})
    assert done[1].returncode == 3, done[1].stderr[-3000:]
    assert done[0].returncode != 0
    assert "all-reduce failed on rank 0 of 2: another worker died or the network failed" in done[0].stderr, \
        done[0].stderr[-3000:]
    losses, state = _single(np.float64)
    _, host = two_ranks
    for run in ("cpu-0-1-mlp", "device-0-1-mlp"):
        ranks = _run(tmp_path, run)
        assert str(ranks[0]["digest"]) == str(ranks[1]["digest"])
        _assert_close(ranks[0], losses, state)
        for name in state:
            assert np.array_equal(ranks[0][name], host[0][name]), (run, name)
    # ZeRO-1 without clipping: each rank holds and updates its own trainables' V and H
    losses, state = _single(np.float64, clip=False)
    sharded = _run(tmp_path, "device-1-0-mlp")
    _assert_close(sharded[0], losses, state)
    owned = [{n for n in r if n.startswith("own:") and n.endswith((".V", ".H"))} for r in sharded]
    assert owned[0] and owned[1] and not owned[0] & owned[1]
    assert {n[4:] for n in owned[0] | owned[1]} == {n for n in state if n.endswith((".V", ".H"))}
    # lazy tables: rows looked up on any rank are updated, the others keep their bits
    session = TrainingSession(embedding_training_model())
    initial = session.state_dict()
    losses = [float(session.step(embedding_batch(k))["loss"]) for k in range(10)]
    state = session.state_dict()
    for run in ("host-0-0-emb", "host-1-0-emb", "device-1-0-emb"):
        table = _run(tmp_path, run)[0]
        _assert_close(table, losses, state)
        assert np.array_equal(table["E"][TABLE_ROWS - 10:], initial["E"][TABLE_ROWS - 10:]), run
        assert not np.array_equal(table["E"][:TABLE_ROWS - 10], initial["E"][:TABLE_ROWS - 10]), run


def _gpus() -> int:
    import onnxruntime as ort
    import torch

    cuda = torch.cuda.is_available() and "CUDAExecutionProvider" in ort.get_available_providers()
    return torch.cuda.device_count() if cuda else 0


@pytest.mark.parametrize("backend", ["nccl", "gloo"])
def test_cuda_ranks_equal_one_process(tmp_path, backend):
    """On GPUs (skipped elsewhere): each rank's state on ``cuda:LOCAL_RANK``, its flat gradient
    buffer reduced in place through DLPack, unsharded (clipping: all-reduce) and ZeRO-1
    (reduce to owners, broadcast back); equal to one process on the full batch within float32
    rounding. NCCL: 2 ranks on 2 GPUs, else 1 (NCCL refuses two ranks on one GPU; one rank
    still reduces the device buffers through NCCL); gloo: 2 ranks, on one GPU if need be (gloo
    stages CUDA tensors through host memory)."""
    gpus = _gpus()
    if not gpus:
        pytest.skip("needs CUDA in torch and onnxruntime-gpu's CUDAExecutionProvider (no GPU here)")
    world = min(2, gpus) if backend == "nccl" else 2
    runs = ["cuda-0-1-mlp", "cuda-1-0-mlp"]
    _ok(_launch(world, tmp_path, "float32", "1", "0", "10",
                env_extra={"DDP_TEST_RUNS": ",".join(runs), "DDP_TEST_BACKEND": backend}))
    for run, clip in zip(runs, (True, False)):
        losses, state = _single(np.float32, last=10, clip=clip)
        ranks = _run(tmp_path, run, world)
        assert len({str(r["digest"]) for r in ranks}) == 1
        np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5)
        for name, value in state.items():
            np.testing.assert_allclose(ranks[0][name], value, rtol=1e-4, atol=1e-5, err_msg=f"{run}: {name}")


def test_device_memory_shares_its_buffers_with_torch(one_rank):
    """OrtValues onnxruntime allocated (as on a GPU, here on the CPU): the flat gradient buffer
    and the state reach torch by DLPack without a copy, and a world of one steps as the session
    alone does, bit for bit, unsharded and sharded."""
    import onnxruntime as ort
    import torch

    from onnx_training_ops.distributed import DistributedTrainingSession

    model = training_model(np.float64)
    alone = open_session(model, "device")
    expected = [float(alone.step(dict(zip(("input", "labels"), batch(k))))["loss"]) for k in range(3)]
    for zero in (False, True):
        ddp = DistributedTrainingSession(open_session(model, "device"), shard_optimizer_state=zero)
        for k in range(3):
            assert float(ddp.step(dict(zip(("input", "labels"), batch(k))))["loss"]) == expected[k]
        ddp.backward(dict(zip(("input", "labels"), batch(3))))
        (buffer,) = ddp.session.gradient_tensors()
        assert isinstance(buffer, ort.OrtValue)
        shared = ddp._shared(buffer)
        assert shared.data_ptr() == buffer.data_ptr() and shared.dtype == torch.float64
        shared.zero_()  # what the all-reduce writes is what optimizer_step applies
        assert not any(g.any() for g in ddp.session.gradients().values())
        ddp.session.zero_grad()
        for name, value in alone.state_dict().items():
            np.testing.assert_array_equal(ddp.full_state_dict()[name], value, err_msg=name)


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
    resumes from the checkpoint and trains the remaining epoch only, with each rank's update in
    the graph (``--device cpu``)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    command = [sys.executable, "-m", "onnx_training_ops", "train", "--nproc", "2", "--out", str(tmp_path)]
    done = subprocess.run(command + ["--epochs", "1"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "2 rank(s)" in done.stdout and "epoch 0:" in done.stdout
    assert TrainingSession(tmp_path / "checkpoint.onnx").properties["epoch"] == 1
    done = subprocess.run(command + ["--epochs", "2", "--device", "cpu"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "state on cpu; epochs 1..1" in done.stdout and "epoch 1:" in done.stdout and "epoch 0:" not in done.stdout
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


def test_cli_sharding_needs_processes():
    done = subprocess.run([sys.executable, "-m", "onnx_training_ops", "train", "--shard-optimizer-state"],
                          cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert done.stderr.strip() == "error: --shard-optimizer-state needs --nproc 2 or more (it shards over processes)"


def test_torchrun_max_restarts_resumes_after_a_killed_worker(two_ranks, tmp_path):
    """Rank 1 dies after step 12; torchrun restarts both ranks, which resume from the step-10
    checkpoint and end with the uninterrupted run's state, bit for bit."""
    torchrun = Path(sys.executable).with_name("torchrun")
    if not torchrun.exists():
        pytest.skip("torchrun is not installed beside this Python")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "DDP_TEST_DIE_AT": "1:12"}
    done = subprocess.run([str(torchrun), "--nproc-per-node", "2", "--master-port", str(_free_port()),
                           "--max-restarts", "1", str(WORKER), str(tmp_path), "float64", "2", "0", str(STEPS),
                           "auto"], cwd=ROOT, env=env, capture_output=True, text=True, timeout=180)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "another worker died" in done.stderr or "exitcode" in done.stderr  # the failure was seen
    _, uninterrupted = two_ranks
    for before, after in zip(uninterrupted, _ranks(tmp_path, 2)):
        for name in before:
            if name not in ("losses", "digest"):
                assert np.array_equal(after[name], before[name]), name


def _optimizer_state(result) -> set[str]:
    return {name for name in result if name.endswith((".V", ".H"))}


def test_zero1_is_bit_identical_to_unsharded(two_ranks, tmp_path):
    """ZeRO-1 with global-norm clipping (gradients all-reduced, each rank updates its
    trainables, owners broadcast them): the same bits as the unsharded run, and rank 0's
    gathered checkpoint is the unsharded run's checkpoint."""
    out, unsharded = two_ranks
    _ok(_launch(2, tmp_path, "float64", "2", "0", str(STEPS), "-", str(SAVE_AT), env_extra={"DDP_TEST_ZERO": "1"}))
    sharded = _ranks(tmp_path, 2)
    for name in unsharded[0]:
        if name != "digest":
            assert np.array_equal(sharded[0][name], unsharded[0][name]), name
    # each rank holds only its own trainables' optimizer state: the two halves split the whole
    own0, own1 = _optimizer_state(TrainingSession(tmp_path / "checkpoint.onnx").state_dict()), None
    mine = [_optimizer_state(r) for r in sharded]
    assert mine[0] == own0  # rank 0 wrote the gathered (whole) state
    own1 = mine[1]
    assert own1 and own1 < own0
    saved_z = TrainingSession(tmp_path / "checkpoint.onnx").state_dict()
    saved = TrainingSession(out / "checkpoint.onnx").state_dict()
    assert all(np.array_equal(saved_z[k], saved[k]) for k in saved)


def test_zero1_resumes_from_its_checkpoint(two_ranks, tmp_path):
    out, unsharded = two_ranks
    _ok(_launch(2, tmp_path, "float64", "2", str(SAVE_AT), str(STEPS), str(out / "checkpoint.onnx"),
                env_extra={"DDP_TEST_ZERO": "1"}))
    resumed = _ranks(tmp_path, 2)
    assert np.array_equal(resumed[0]["losses"], unsharded[0]["losses"][SAVE_AT:])
    for name in unsharded[0]:
        if name not in ("losses", "digest"):
            assert np.array_equal(resumed[0][name], unsharded[0][name]), name


def test_zero1_four_ranks_reduce_scatter_float32(tmp_path):
    """No clipping: gradients are reduced to their owner only; 4 ranks (one trainable each)
    equal single-process training on the full batch within float32 rounding."""
    _ok(_launch(4, tmp_path, "float32", "1", "0", str(STEPS), env_extra={"DDP_TEST_ZERO": "1", "DDP_TEST_CLIP": "0"}))
    losses, state = _single(np.float32, clip=False)
    ranks = _ranks(tmp_path, 4)
    assert len({str(r["digest"]) for r in ranks}) == 1
    np.testing.assert_allclose(ranks[0]["losses"], losses, rtol=1e-5)
    for name, value in state.items():
        np.testing.assert_allclose(ranks[0][name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    held = [_optimizer_state(r) for r in ranks[1:]]
    assert all(len(h) == 2 for h in held) and not set.intersection(*held)  # V and H of one trainable each


def test_batchnorm_buffers_follow_rank_0(tmp_path):
    """Running statistics come from each rank's own shard; after each optimizer step rank 0's
    are broadcast (DDP's broadcast_buffers), so the state hash agrees every 5 steps."""
    _ok(_launch(2, tmp_path, "float32", "1", "0", "10", env_extra={"DDP_TEST_BN": "1", "DDP_TEST_ZERO": "1"}))
    r0, r1 = _ranks(tmp_path, 2)
    assert str(r0["digest"]) == str(r1["digest"])
    stats = [name for name in r0 if "running_mean" in name]
    assert stats and all(np.array_equal(r0[n], r1[n]) and np.abs(r0[n]).max() > 0 for n in stats)


def test_without_torch_a_one_line_hint(tmp_path):
    """No torch: the example says how to install it, in one line and without a traceback."""
    script = str(ROOT / "examples" / "train_ddp.py")
    code = (f"import sys, runpy; sys.modules['torch'] = None; sys.argv = ['train_ddp.py', '--out', {str(tmp_path)!r}]; "
            f"runpy.run_path({script!r}, run_name='__main__')")
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert done.stderr.strip() == "distributed training needs torch: pip install 'onnx-training-ops[distributed]'"


@pytest.fixture
def one_rank(tmp_path):
    """A world of one process (this one), for the wrapper's API without subprocesses."""
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'store'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def test_a_model_path_opens_the_session_and_a_sharded_world_of_one_saves_whole(one_rank, tmp_path):
    from onnx_training_ops.distributed import DistributedTrainingSession

    path = tmp_path / "model.onnx"
    path.write_bytes(training_model(np.float64).SerializeToString())
    ddp = DistributedTrainingSession(str(path), shard_optimizer_state=True, fast=False)
    assert not ddp.session.fast and set(ddp.owners.values()) == {0}
    losses, state = _single(np.float64, last=3)
    for k in range(3):
        x, y = batch(k)
        assert float(ddp.step({"input": x, "labels": y})["loss"]) == losses[k]
    ddp.save(tmp_path / "saved.onnx")
    saved = TrainingSession(tmp_path / "saved.onnx").state_dict()
    assert set(saved) == set(state) and all(np.array_equal(saved[k], state[k]) for k in state)


def test_wrapper_errors_name_the_problem(one_rank, monkeypatch):
    import torch.distributed

    from onnx_training_ops.distributed import DistributedTrainingSession
    from onnx_training_ops.errors import TrainingOpError

    session = TrainingSession(training_model(np.float64))
    with pytest.raises(TrainingOpError, match=r"\['fast'\] apply only when a model is given"):
        DistributedTrainingSession(session, fast=False)
    with monkeypatch.context() as patch:  # a group that reduces CUDA tensors only, for host state
        patch.setattr(torch.distributed, "get_backend", lambda group=None: "nccl")
        with pytest.raises(TrainingOpError, match=r"state on cpu, but the process group's backend 'nccl' reduces "
                                                  r"\['cuda'\] tensors only: init_process_group\('gloo'\)"):
            DistributedTrainingSession(TrainingSession(training_model(np.float64), device="cpu"))
    ddp = DistributedTrainingSession(session, shard_optimizer_state=True)
    x, y = batch(0)
    ddp.backward({"input": x, "labels": y})
    with pytest.raises(TrainingOpError, match=r"unknown learning-rate input\(s\) \['lr_typo'\]"):
        ddp.optimizer_step({"lr_typo": 0.1})
