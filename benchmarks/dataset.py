"""The MLP benchmark's data: batches a training loop cycles through (numpy only, so
onnxruntime-training's worker loads this file by path, as it loads :mod:`.timing`).

A loop that feeds one batch over and over memorizes it: the loss reaches 0 within some
15,000 steps, the gradients vanish, and onnxruntime-training's step then falls from 60 to
41 us on MLP 64-128-10 (ours does not change). That regime is no training anyone runs, so
every contender cycles through the same ``BATCHES`` batches, labelled by a random linear
teacher: learnable, as data is, but not in a few epochs.
"""

import numpy as np

BATCHES = 32
WARMUP_STEPS = 500  # before the first timed round, every contender alike


def mlp_batches(sizes, batch: int, count: int = BATCHES) -> list:
    """``count`` pairs ``(x float32 [batch, sizes[0]], y int64 [batch])``, the same for every caller."""
    rng = np.random.default_rng(0)
    teacher = rng.standard_normal((sizes[0], sizes[-1]))
    out = []
    for _ in range(count):
        x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
        out.append((x, np.argmax(x @ teacher, axis=1).astype(np.int64)))
    return out
