"""One thread count for every contender (``bench --threads N``; ``--quick``: 1).

torch, numba and onnxruntime each size their pools to the machine by default, and a pool
that meets a busy core stalls a whole step for a scheduler slice: on a loaded 2-core machine
torch's 2 threads made one 1e4-element step take milliseconds, and the table printed 0.00x.
The parent puts the count in the environment; each worker process calls :func:`pin` first.
onnxruntime sessions that run one PyOp node keep 1 intra-op thread (the kernel's numba pool,
pinned here, does the work); every other pool gets the count.
"""

from __future__ import annotations

import os
import sys

ENV = "ONNX_TRAINING_OPS_BENCH_THREADS"


def requested() -> int | None:
    """The pinned count, or None (each library's default)."""
    value = os.environ.get(ENV)
    return int(value) if value else None


def pin(n: int | None) -> None:
    """Pin this process's pools (and its children's, through the environment) to ``n``."""
    if not n:
        return
    os.environ[ENV] = str(n)
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        os.environ[var] = str(n)
    import numba

    numba.set_num_threads(min(n, numba.config.NUMBA_NUM_THREADS))
    if "torch" in sys.modules:
        sys.modules["torch"].set_num_threads(n)


def torch_pinned(torch) -> None:
    """Apply the pinned count to ``torch`` (imported after :func:`pin`)."""
    n = requested()
    if n:
        torch.set_num_threads(n)


def onnxruntime_threads(default: int) -> int:
    """intra_op_num_threads for a session whose unpinned setting is ``default``."""
    n = requested()
    return default if n is None or default == 1 else n


def in_use() -> dict:
    """The pools' sizes in this process, for the report."""
    import numba

    out = {"pinned": requested(), "numba": numba.get_num_threads()}
    if "torch" in sys.modules:
        out["torch"] = sys.modules["torch"].get_num_threads()
    return out
