"""SessionOptions for the onnxruntime sessions a TrainingSession opens (one per program).

Each onnxruntime session gets a fresh SessionOptions (``InferenceSession`` registers the
kernel library in the options it is given): every settable attribute of the user's options,
the config entries among :data:`CONFIG_KEYS` it holds, and ``session_config``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping

import onnxruntime as ort

from ...runtime.heap import return_big_blocks

# every settable SessionOptions attribute (intra_op_num_threads, enable_profiling, ...)
_OPTION_ATTRIBUTES = [name for name, value in vars(ort.SessionOptions).items()
                      if isinstance(value, property) and value.fset is not None]
# config entries copied from a given SessionOptions (onnxruntime cannot list them; pass any
# other through ``session_config``)
CONFIG_KEYS = (
    "session.intra_op.allow_spinning", "session.inter_op.allow_spinning",
    "session.force_spinning_stop", "session.set_denormal_as_zero", "session.use_env_allocators",
    "session.disable_prepacking", "session.intra_op_thread_affinities", "session.dynamic_block_base",
    "session.disable_cpu_ep_fallback", "session.use_device_allocator_for_initializers",
    "session.disable_aot_function_inlining", "optimization.enable_gelu_approximation",
    "optimization.disable_specified_optimizers", "session.qdqisint8allowed",
)


# Every session's options (without sess_options of the caller's): no memory pattern. The
# pattern plans one block for a whole step beside what the arena holds, and gains no speed
# in a training step: peak RSS with / without it, same ms/step within noise (2 threads, AdamW,
# the real-model benchmark's models): BERT 4L/256 846 / 751 MB, GPT-2 4L/256 1516 / 1157 MB,
# ResNet-18 955 / 802 MB (README, "Performance").
DEFAULT_OPTIONS = {"enable_mem_pattern": False}

# A large model's sessions (without sess_options of the caller's), besides: no memory pattern (one
# block for a whole step's plan, beside what the arena holds), no prepacking (a packed second copy of
# every constant MatMul weight: a frozen base model twice), and the process's shared CPU arena
# (SHARED_ARENA_CONFIG below: it grows by what a request needs, never to a power of two). A large
# model's sessions once had no arena, every tensor from malloc with glibc told to map and unmap each
# big block (runtime/heap.py): the least memory, but every step then faults in fresh pages for each
# of its big tensors, zeroed by the kernel. Measured on the int4 LoRA benchmark (TinyLlama's shape,
# 2 layers, 1 x 256 tokens, benchmarks/bench_lora_int4.py): 290,000 page faults and 0.68 s of system
# time a step without the arena, 1.65 against 1.11 s a step; 22 layers: peak RSS 2.10 GB without,
# 2.17 GB with it (torch + peft: 6.25 GB). GPT-2 124M full fine-tuning (python -m benchmarks memory):
# 3.05 GB without, 3.08 GB with.
LARGE_MODEL_OPTIONS = {"enable_mem_pattern": False}
LARGE_MODEL_CONFIG = {"session.disable_prepacking": "1", "session.use_env_allocators": "1"}


# Other sessions (without sess_options of the caller's) allocate from one CPU arena shared
# by the process, which grows by what a request needs (kSameAsRequested) where a session's
# own arena grows to the next power of two. Peak RSS per-session / shared, same ms/step
# within noise (2 threads, AdamW, the real-model benchmark's models): BERT 4L/256 751 / 725 MB,
# GPT-2 4L/256 1156 / 1134 MB, ResNet-18 800 / 752 MB. The shared arena keeps its peak until
# the process ends (a session's own is freed with the session); large models use it too.
SHARED_ARENA_CONFIG = {"session.use_env_allocators": "1"}
_SAME_AS_REQUESTED = 1  # OrtArenaExtendStrategy
_shared_arena: bool | None = None
_lock = threading.Lock()


def shared_arena() -> bool:
    """Register the shared CPU arena with onnxruntime's environment (once per process); True
    when sessions can use it (also when the program registered one of its own first)."""
    global _shared_arena
    with _lock:
        if _shared_arena is None:
            info = ort.OrtMemoryInfo("Cpu", ort.OrtAllocatorType.ORT_ARENA_ALLOCATOR, 0, ort.OrtMemType.DEFAULT)
            try:
                ort.create_and_register_allocator(info, ort.OrtArenaCfg(0, _SAME_AS_REQUESTED, -1, -1))
                _shared_arena = True
            except Exception as error:  # noqa: BLE001 - one is registered already, or none can be
                _shared_arena = "already" in str(error).lower()
        return _shared_arena


LARGE_MODEL_CONFIG_WITHOUT_ARENA = {k: v for k, v in LARGE_MODEL_CONFIG.items() if k not in SHARED_ARENA_CONFIG}


def _large_config() -> dict[str, str]:
    """:data:`LARGE_MODEL_CONFIG`, less the shared arena where none could be registered."""
    return LARGE_MODEL_CONFIG if shared_arena() else LARGE_MODEL_CONFIG_WITHOUT_ARENA


def apply_memory_options(so: ort.SessionOptions, large: bool = False) -> None:
    """Set :data:`DEFAULT_OPTIONS` on ``so``, and for a ``large`` model
    :data:`LARGE_MODEL_OPTIONS` and :data:`LARGE_MODEL_CONFIG` too (else the shared arena,
    :data:`SHARED_ARENA_CONFIG`)."""
    for attr, value in {**DEFAULT_OPTIONS, **(LARGE_MODEL_OPTIONS if large else {})}.items():
        setattr(so, attr, value)
    config = _large_config() if large else (SHARED_ARENA_CONFIG if shared_arena() else {})
    for key, entry in config.items():
        so.add_session_config_entry(key, entry)


def fresh_options(base: ort.SessionOptions | None, config: Mapping[str, str],
                  large: bool = False, threads: int = 0, force_threads: bool = False) -> ort.SessionOptions:
    """A new SessionOptions: ``base``'s attributes and known config entries, then ``config``.

    Without ``base``, onnxruntime's own log is silenced (errors come back as our exception;
    its log line would repeat them). The package's defaults apply to whatever ``base`` leaves
    at onnxruntime's defaults (all of them without ``base``): ``threads`` intra-op threads
    (0: onnxruntime's choice), :data:`DEFAULT_OPTIONS`, for a ``large`` model
    :data:`LARGE_MODEL_OPTIONS` and :data:`LARGE_MODEL_CONFIG`, else the shared arena
    (:data:`SHARED_ARENA_CONFIG`) unless ``base`` turned the arena off.

    Args:
        base: the caller's options (copied, never changed), or None.
        config: session config entries set last.
        large: the model is large (memory first).
        threads: intra-op threads where ``base`` leaves the count at 0.
        force_threads: ``threads`` also over a count ``base`` sets (the caller passed both).

    Returns:
        New SessionOptions for one onnxruntime session.
    """
    so = ort.SessionOptions()
    if base is None:
        so.log_severity_level = 4
        so.intra_op_num_threads = threads
        apply_memory_options(so, large)
    else:
        for attr in _OPTION_ATTRIBUTES:
            setattr(so, attr, getattr(base, attr))
        held = set()
        for key in CONFIG_KEYS:
            try:
                value = base.get_session_config_entry(key)
            except Exception:  # not set
                continue
            so.add_session_config_entry(key, value)
            held.add(key)
        if force_threads or base.intra_op_num_threads == 0:
            so.intra_op_num_threads = threads
        _memory_defaults(so, base, held, large)
    for key, entry in config.items():
        so.add_session_config_entry(key, entry)
    if large and not so.enable_cpu_mem_arena:  # the caller's choice: freed big blocks go back (runtime/heap.py)
        return_big_blocks()
    return so


_ORT_DEFAULTS = ort.SessionOptions()


def _memory_defaults(so: ort.SessionOptions, base: ort.SessionOptions, held: set[str], large: bool) -> None:
    """:func:`apply_memory_options` for what ``base`` leaves at onnxruntime's defaults."""
    for attr, value in {**DEFAULT_OPTIONS, **(LARGE_MODEL_OPTIONS if large else {})}.items():
        if getattr(base, attr) == getattr(_ORT_DEFAULTS, attr):
            setattr(so, attr, value)
    if large:
        config = _large_config() if so.enable_cpu_mem_arena else LARGE_MODEL_CONFIG_WITHOUT_ARENA
    else:  # the shared arena only where the caller kept an arena
        config = SHARED_ARENA_CONFIG if so.enable_cpu_mem_arena and shared_arena() else {}
    for key, entry in config.items():
        if key not in held:
            so.add_session_config_entry(key, entry)
