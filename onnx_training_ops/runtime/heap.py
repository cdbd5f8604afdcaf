"""glibc's malloc told to hand big blocks back to the system (Linux with glibc; nothing elsewhere).

Without its arena (a large model's sessions whose caller turned the arena off,
``training/options/options.py``), onnxruntime allocates every tensor with ``malloc``. glibc
serves a block past ``M_MMAP_THRESHOLD`` with ``mmap`` and unmaps it when freed, but raises that
threshold to the size of each mapped block freed (up to 32 MB): after the first step, a training
step's activations (a few MB each) come from the heap, where freed blocks stay in the process
(fragmented, and the heap is only trimmed from its top). Measured on the TinyLlama-shaped int4
LoRA step (``benchmarks/bench_lora_int4.py``): the peak RSS 0.3 GB higher than with the
threshold fixed (``MALLOC_MMAP_THRESHOLD_=131072``). :func:`return_big_blocks` fixes it at
:data:`THRESHOLD` with ``mallopt`` (which also stops the dynamic raise), once per process;
``ONNX_TRAINING_OPS_MALLOPT=0`` leaves malloc as it is (and so does a threshold the environment
already set). The cost: every big tensor of every step is a fresh mapping the kernel zeroes (the
int4 LoRA step, 2 layers: 290,000 page faults a step, 1.65 s against 1.11 s on the shared
arena), which is why sessions use the arena by default.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import os
import sys
import threading

M_MMAP_THRESHOLD = -3  # glibc's malloc.h
THRESHOLD = 128 << 10  # glibc's initial value, kept fixed
_done: bool | None = None
_lock = threading.Lock()


def return_big_blocks() -> bool:
    """Fix glibc's mmap threshold at :data:`THRESHOLD` (once per process); True if it is set
    (now or before), False where there is no glibc, it was turned off, or ``mallopt`` failed."""
    global _done
    with _lock:
        if _done is None:
            _done = _set()
        return _done


def _set() -> bool:
    if not sys.platform.startswith("linux") or os.environ.get("ONNX_TRAINING_OPS_MALLOPT", "1") == "0":
        return False
    if "MALLOC_MMAP_THRESHOLD_" in os.environ:  # the environment chose; glibc read it at start
        return True
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6")
        libc.gnu_get_libc_version  # noqa: B018 - glibc only (musl has mallopt as a stub)
        return libc.mallopt(M_MMAP_THRESHOLD, THRESHOLD) == 1
    except (OSError, AttributeError):
        return False
