"""One rank of test_fault_ranks (RANK, WORLD_SIZE, MASTER_ADDR, MASTER_PORT set): for each
case named on the command line, rank 0 opens the base model and the other ranks the case's
variant, in one process group; prints ``CASE ran DIGEST`` after 3 steps, or ``CASE
clean-error MESSAGE`` when DistributedTrainingSession refuses the mix. A case ending ``-zero``
shards the optimizer state. A crash (gloo's SIGABRT) ends the process."""

from __future__ import annotations

import os
import sys

import numpy as np

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.distributed import DistributedTrainingSession, destroy_process_group, init_process_group

VARIANTS = {  # name -> (sizes, activation, optimizer, seed)
    "base": ((8, 16, 4), "Tanh", ot.Adam(lr=1e-2), 3),
    "other-seed": ((8, 16, 4), "Tanh", ot.Adam(lr=1e-2), 4),
    "hidden": ((8, 12, 4), "Tanh", ot.Adam(lr=1e-2), 3),
    "momentum": ((8, 16, 4), "Tanh", ot.Momentum(lr=1e-2, momentum=0.9), 3),
    "activation": ((8, 16, 4), "Relu", ot.Adam(lr=1e-2), 3),
}


def model(name: str):
    sizes, activation, optimizer, seed = VARIANTS[name]
    return ot.build_training_model(make_mlp(sizes, activation=activation, seed=seed), "cross_entropy", optimizer)


def main() -> None:
    init_process_group(timeout_s=60)
    rank = int(os.environ["RANK"])
    rng = np.random.default_rng(rank)
    feeds = {"input": rng.standard_normal((4, 8)).astype(np.float32), "labels": rng.integers(0, 4, 4)}
    for case in sys.argv[1:]:
        variant = case.removesuffix("-zero")
        session = ot.TrainingSession(model("base" if rank == 0 else variant))
        try:
            ddp = DistributedTrainingSession(session, shard_optimizer_state=case.endswith("-zero"))
        except ot.TrainingOpError as error:
            print(case, "clean-error", str(error), flush=True)
            continue
        for _ in range(3):
            ddp.step(feeds)
        print(case, "ran", ddp.check_parameters(), flush=True)
    destroy_process_group()


if __name__ == "__main__":
    main()
