"""One rank of the data-parallel tests (run by tests/test_distributed.py with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set): trains the tests' MLP on this rank's shard of
each global batch and writes its losses and final state to ``OUT/rank<r>.npz``.

Usage: python tests/_ddp_worker.py OUT DTYPE MICRO FIRST LAST [CHECKPOINT_IN] [SAVE_AT]

CHECKPOINT_IN ``auto``: resume from ``OUT/checkpoint.onnx`` if it exists (at the step it
holds) and save it every 5 steps (what a job under ``torchrun --max-restarts`` does).
DDP_TEST_DIE_AT=``rank:step`` kills that rank after that step, in the first attempt only;
DDP_TEST_ZERO=1 shards the optimizer state (ZeRO-1); DDP_TEST_CLIP=0 trains without clipping;
DDP_TEST_BN=1 trains a float32 model with BatchNorm (mode="train").

DDP_TEST_RUNS=``RUN,RUN,...`` trains several configurations one after the other in this
process (one launch, several checks), each written to ``OUT/<RUN>.rank<r>.npz``. A RUN is
``ENGINE-ZERO-CLIP-MODEL[-die]``: ENGINE as :func:`ddp_case.open_session` takes it (``host``,
``cpu``, ``device``, ``cuda``); ZERO and CLIP ``0``/``1``; MODEL ``mlp`` or ``emb`` (a float64
embedding table with lazy Adam, 10 steps at most); ``die``: rank 1 exits after step 3 (the
last run). DDP_TEST_BACKEND: the process group's backend (default: init_process_group's).
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from onnx_training_ops import TrainingSession  # noqa: E402
from onnx_training_ops.distributed import DistributedTrainingSession, destroy_process_group, init_process_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_case import (  # noqa: E402
    batch,
    batchnorm_training_model,
    embedding_batch,
    embedding_training_model,
    open_session,
    training_model,
)


def train(session: TrainingSession, out: str, dtype, micro: int, first: int, last: int, *, zero: bool, emb: bool,
          save_at: int = -1, auto: bool = False, die_at: str | None = None, name: str = "") -> None:
    """Train ``session`` data-parallel on steps ``first..last-1``; write ``OUT/[NAME.]rank<r>.npz``."""
    checkpoint = os.path.join(out, "checkpoint.onnx")
    ddp = DistributedTrainingSession(session, check_every=5, shard_optimizer_state=zero)
    session = ddp.session  # sharded: this rank's session on its shard of the model
    rank, world = ddp.rank, ddp.world_size
    losses = []
    for k in range(first, last):
        if emb:
            whole = embedding_batch(k)
        else:
            x, y = batch(k, dtype)
            whole = {"input": x, "labels": y}
        rows = len(next(iter(whole.values()))) // world
        part = rows // micro
        loss = 0.0
        for m in range(micro):
            start = rank * rows + m * part
            feeds = {key: value[start:start + part] for key, value in whole.items()}
            loss += float(ddp.backward(feeds, scale=1 / micro)["loss"]) / micro
        ddp.optimizer_step()
        losses.append(ddp.average(loss))
        if k + 1 == save_at or (auto and (k + 1) % 5 == 0):
            session.properties["step"] = k + 1
            ddp.save(checkpoint)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and die_at == f"{rank}:{k}":
            os._exit(3)  # a killed worker
    digest = ddp.check_parameters()
    state = ddp.full_state_dict()  # sharded: the whole state on rank 0 only
    own = session.state_dict()
    np.savez(os.path.join(out, f"{name + '.' if name else ''}rank{rank}.npz"), losses=np.array(losses),
             digest=digest, **(state if state is not None else own),
             **{f"own:{key}": value for key, value in own.items()} if name else {})


def main() -> None:
    out, dtype = sys.argv[1], np.dtype(sys.argv[2])
    micro, first, last = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    source = sys.argv[6] if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    save_at = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    init_process_group(os.environ.get("DDP_TEST_BACKEND"), timeout_s=60)
    runs = os.environ.get("DDP_TEST_RUNS")
    if runs:
        for run in runs.split(","):
            engine, zero, clip, model, *die = run.split("-")
            emb = model == "emb"
            made = embedding_training_model() if emb else training_model(dtype, clip=clip == "1")
            train(open_session(made, engine), out, dtype, micro, first, last if not emb else min(last, first + 10),
                  zero=zero == "1", emb=emb, die_at="1:3" if die else None, name=run)
        destroy_process_group()
        return
    auto = source == "auto"
    checkpoint = os.path.join(out, "checkpoint.onnx")
    if auto:
        source = checkpoint if os.path.exists(checkpoint) else None
    if source:
        session = TrainingSession(source)
    elif os.environ.get("DDP_TEST_BN") == "1":
        session = TrainingSession(batchnorm_training_model())
    else:
        session = TrainingSession(training_model(dtype, clip=os.environ.get("DDP_TEST_CLIP", "1") == "1"))
    if auto:
        first = int(session.properties.get("step", first))
    train(session, out, dtype, micro, first, last, zero=os.environ.get("DDP_TEST_ZERO") == "1", emb=False,
          save_at=save_at, auto=auto,
          die_at=os.environ.get("DDP_TEST_DIE_AT"))
    destroy_process_group()


if __name__ == "__main__":
    main()
