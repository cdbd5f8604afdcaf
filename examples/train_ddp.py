"""Data-parallel training of an MLP on scikit-learn's digits, one process per rank.

Every rank builds the same model, takes its slice of each global batch (the same shuffled
order on every rank), and :class:`~onnx_training_ops.distributed.DistributedTrainingSession`
averages the gradients over the ranks before each optimizer step. Rank 0 writes a checkpoint
after every epoch (atomically, with the epoch as a property); a restarted job resumes from it
on every rank, so ``torchrun --max-restarts`` after a killed worker ends with the same
parameters as an uninterrupted run.

Run (one machine, 2 processes)::

    torchrun --nproc-per-node 2 examples/train_ddp.py [--epochs 5] [--out ddp_run]

Several machines (run on each; node 0's address as the rendezvous endpoint)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-id job1 --max-restarts 3 examples/train_ddp.py --out /shared/run

(``--out`` must then be a directory every node sees, or copy rank 0's checkpoint to each.)
Needs the ``distributed`` and ``demo`` extras.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import numpy as np

GLOBAL_BATCH = 64


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--out", default="ddp_run", help="checkpoint directory (resumed from if it holds one)")
    parser.add_argument("--lr", type=float, default=1e-2)
    return parser.parse_args()


def main() -> int:
    args = parse_args()
    try:
        from onnx_training_ops.distributed import (DistributedTrainingSession, destroy_process_group,
                                                   init_process_group)
        init_process_group()
    except ImportError as error:
        print(error, file=sys.stderr)
        return 2
    from onnx_training_ops import Adam, TrainingSession, build_training_model
    from onnx_training_ops.demo import load_digits_split, make_mlp
    from onnx_training_ops.schedules import CosineAnnealingLR

    x_train, y_train, x_val, y_val = load_digits_split()
    steps_per_epoch = len(x_train) // GLOBAL_BATCH
    path = os.path.join(args.out, "checkpoint.onnx")
    if os.path.exists(path):
        session = TrainingSession(path)
    else:
        model = build_training_model(make_mlp((64, 128, 10), seed=0), "cross_entropy", Adam(lr=args.lr))
        session = TrainingSession(model)
        session.set_lr_schedule(CosineAnnealingLR(T_max=args.epochs * steps_per_epoch))
    ddp = DistributedTrainingSession(session, check_every=steps_per_epoch)
    rank, world = ddp.rank, ddp.world_size
    if GLOBAL_BATCH % world:
        raise SystemExit(f"the global batch {GLOBAL_BATCH} does not split over {world} ranks")
    rows = GLOBAL_BATCH // world
    first = int(session.properties.get("epoch", 0))
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        print(f"{world} rank(s), {rows} rows each per step; epochs {first}..{args.epochs - 1}", flush=True)
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
