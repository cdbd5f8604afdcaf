"""Data-parallel training of an MLP on scikit-learn's digits, one process per rank.

The training loop is :mod:`onnx_training_ops.demo_ddp` (read it: ~60 lines around
``DistributedTrainingSession``); this script runs it, so it works from a source checkout.

Run (one machine, 2 processes)::

    torchrun --nproc-per-node 2 examples/train_ddp.py [--epochs 5] [--out ddp_run] [--shard-optimizer-state]

or, without torchrun on the path, ``python -m onnx_training_ops train --nproc 2``.

Several machines (run on each; node 0's address as the rendezvous endpoint)::

    torchrun --nnodes 2 --nproc-per-node 4 --rdzv-backend c10d \\
        --rdzv-endpoint HOST0:29500 --rdzv-id job1 --max-restarts 3 examples/train_ddp.py --out /shared/run

(``--out`` must then be a directory every node sees, or copy rank 0's checkpoint to each.)
Needs the ``distributed`` and ``demo`` extras.
"""

from __future__ import annotations

import sys

from onnx_training_ops.demo_ddp import main

if __name__ == "__main__":
    sys.exit(main())
