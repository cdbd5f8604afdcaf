"""One rank of the data-parallel tests (run by tests/test_distributed.py with RANK,
WORLD_SIZE, MASTER_ADDR and MASTER_PORT set): trains the tests' MLP on this rank's shard of
each global batch and writes its losses and final state to ``OUT/rank<r>.npz``.

Usage: python tests/_ddp_worker.py OUT DTYPE MICRO FIRST LAST [CHECKPOINT_IN] [SAVE_AT]

CHECKPOINT_IN ``auto``: resume from ``OUT/checkpoint.onnx`` if it exists (at the step it
holds) and save it every 5 steps (what a job under ``torchrun --max-restarts`` does).
DDP_TEST_DIE_AT=``rank:step`` kills that rank after that step, in the first attempt only;
DDP_TEST_ZERO=1 shards the optimizer state (ZeRO-1); DDP_TEST_CLIP=0 trains without clipping;
DDP_TEST_BN=1 trains a float32 model with BatchNorm (mode="train"); DDP_TEST_EMB=1 a float64
embedding table with lazy Adam.
"""

from __future__ import annotations

import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from onnx_training_ops import TrainingSession  # noqa: E402
from onnx_training_ops.distributed import DistributedTrainingSession, destroy_process_group, init_process_group  # noqa: E402

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from ddp_case import batch, batchnorm_training_model, embedding_batch, embedding_training_model, training_model  # noqa: E402


def main() -> None:
    out, dtype = sys.argv[1], np.dtype(sys.argv[2])
    micro, first, last = int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5])
    source = sys.argv[6] if len(sys.argv) > 6 and sys.argv[6] != "-" else None
    save_at = int(sys.argv[7]) if len(sys.argv) > 7 else -1
    init_process_group(timeout_s=60)
    auto = source == "auto"
    checkpoint = os.path.join(out, "checkpoint.onnx")
    if auto:
        source = checkpoint if os.path.exists(checkpoint) else None
    if source:
        session = TrainingSession(source)
    elif os.environ.get("DDP_TEST_EMB") == "1":
        session = TrainingSession(embedding_training_model())
    elif os.environ.get("DDP_TEST_BN") == "1":
        session = TrainingSession(batchnorm_training_model())
    else:
        session = TrainingSession(training_model(dtype, clip=os.environ.get("DDP_TEST_CLIP", "1") == "1"))
    if auto:
        first = int(session.properties.get("step", first))
    ddp = DistributedTrainingSession(session, check_every=5,
                                     shard_optimizer_state=os.environ.get("DDP_TEST_ZERO") == "1")
    session = ddp.session  # sharded: this rank's session on its shard of the model
    rank, world = ddp.rank, ddp.world_size
    losses = []
    for k in range(first, last):
        if os.environ.get("DDP_TEST_EMB") == "1":
            whole = embedding_batch(k)
        else:
            x, y = batch(k, dtype)
            whole = {"input": x, "labels": y}
        rows = len(next(iter(whole.values()))) // world
        part = rows // micro
        loss = 0.0
        for m in range(micro):
            start = rank * rows + m * part
            feeds = {name: value[start:start + part] for name, value in whole.items()}
            loss += float(ddp.backward(feeds, scale=1 / micro)["loss"]) / micro
        ddp.optimizer_step()
        losses.append(ddp.average(loss))
        if k + 1 == save_at or (auto and (k + 1) % 5 == 0):
            session.properties["step"] = k + 1
            ddp.save(checkpoint)
        first_attempt = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") == "0"
        if first_attempt and os.environ.get("DDP_TEST_DIE_AT") == f"{rank}:{k}":
            os._exit(3)  # a killed worker
    digest = ddp.check_parameters()
    state = ddp.full_state_dict()  # sharded: the whole state on rank 0 only
    np.savez(os.path.join(out, f"rank{rank}.npz"), losses=np.array(losses), digest=digest,
             **(state if state is not None else session.state_dict()))
    destroy_process_group()


if __name__ == "__main__":
    main()
