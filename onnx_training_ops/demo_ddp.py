"""One rank of the data-parallel demo: an MLP on scikit-learn's digits, trained by
:class:`~onnx_training_ops.distributed.DistributedTrainingSession`.

Every rank builds the same model, takes its slice of each global batch (the same shuffled
order on every rank), and the gradients are averaged over the ranks before each optimizer
step. Rank 0 writes a checkpoint after every epoch (atomically, with the epoch as a
property); a restarted job resumes from it on every rank, so ``--max-restarts`` after a
killed worker ends with the same parameters as an uninterrupted run.

Run under torchrun (``python -m onnx_training_ops train --nproc 2`` does it for you)::

    torchrun --nproc-per-node 2 -m onnx_training_ops.demo_ddp --epochs 5 --out ddp_run

Needs the ``distributed`` and ``demo`` extras.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Sequence

import numpy as np

GLOBAL_BATCH = 64


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--out", default="ddp_run", help="checkpoint directory (resumed from if it holds one)")
    parser.add_argument("--lr", type=float, default=1e-2)
    parser.add_argument("--shard-optimizer-state", action="store_true",
                        help="ZeRO-1: each rank holds and updates the optimizer state of its share of the trainables")
    return parser.parse_args(argv)


def _session_options(world: int):
    """One rank's share of the cores for onnxruntime (ranks on one machine must not oversubscribe)."""
    import onnxruntime as ort

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors reach us as exceptions; no warnings per rank
    options.intra_op_num_threads = max(1, (os.cpu_count() or 1) // max(1, local))
    return options


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from .distributed import DistributedTrainingSession, destroy_process_group, init_process_group
        init_process_group()
    except ImportError as error:
        print(error, file=sys.stderr)
        return 2
    from .build import Adam, build_training_model
    from .training import TrainingSession
    from .demo import load_digits_split, make_mlp
    from .training.schedules import CosineAnnealingLR

    x_train, y_train, x_val, y_val = load_digits_split()
    steps_per_epoch = len(x_train) // GLOBAL_BATCH
    path = os.path.join(args.out, "checkpoint.onnx")
    options = _session_options(int(os.environ.get("WORLD_SIZE", 1)))
    if os.path.exists(path):
        session = TrainingSession(path, sess_options=options)
    else:
        model = build_training_model(make_mlp((64, 128, 10), seed=0), "cross_entropy", Adam(lr=args.lr))
        session = TrainingSession(model, sess_options=options)
        session.set_lr_schedule(CosineAnnealingLR(T_max=args.epochs * steps_per_epoch))
    ddp = DistributedTrainingSession(session, check_every=steps_per_epoch,
                                     shard_optimizer_state=args.shard_optimizer_state)
    session = ddp.session  # sharded: reopened on this rank's shard
    rank, world = ddp.rank, ddp.world_size
    if GLOBAL_BATCH % world:
        raise SystemExit(f"the global batch {GLOBAL_BATCH} does not split over {world} ranks")
    rows = GLOBAL_BATCH // world
    first = int(session.properties.get("epoch", 0))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        sharding = ", optimizer state sharded (ZeRO-1)" if ddp.sharded else ""
        print(f"{world} rank(s), {rows} rows each per step{sharding}; epochs {first}..{args.epochs - 1}",
              flush=True)
    start = time.perf_counter()
    for epoch in range(first, args.epochs):
        order = np.random.default_rng(epoch).permutation(len(x_train))  # the same on every rank
        losses = []
        for k in range(steps_per_epoch):
            index = order[k * GLOBAL_BATCH + rank * rows:k * GLOBAL_BATCH + (rank + 1) * rows]
            losses.append(float(ddp.step({"input": x_train[index], "labels": y_train[index]})["loss"]))
        train_loss = ddp.average(float(np.mean(losses)))
        session.properties["epoch"] = epoch + 1
        ddp.save(path)
        if rank == 0:
            logits = session.run(None, {"input": x_val})[0]
            accuracy = float(np.mean(logits.argmax(1) == y_val))
            print(f"epoch {epoch}: train loss {train_loss:.4f}, val accuracy {accuracy:.3f}", flush=True)
    elapsed = time.perf_counter() - start
    digest = ddp.check_parameters()
    if rank == 0:
        steps = (args.epochs - first) * steps_per_epoch
        print(f"{steps / elapsed if elapsed else 0:.0f} steps/s; state {digest[:16]} on all ranks", flush=True)
    destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
