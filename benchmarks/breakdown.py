"""Where the ``graph`` contender's time goes (the PyOp bridge's copies vs the kernel)."""

from __future__ import annotations

import statistics
import time

import numpy as np

from .contenders import graph_session
from .measure import timed
from .problem import STATE_NAMES, make_state


def graph_breakdown(op: str = "adam", n: int = 10**7, reps: int = 20) -> dict:
    """Median per-step split of the ``graph`` contender (run in this process).

    The PyOp bridge (onnxruntime-extensions ``pyop/pyfunc.cc``) copies each input into a
    fresh numpy array before calling Python and copies each returned array into the
    output tensor after. Timed here: the whole ``run_with_iobinding``; the Python hook
    (everything between the bridge's call and its return: attribute casting, the kernel,
    the outputs' conversion); the kernel alone (the fused in-place update on the copies).
    ``bridge_and_ort_s`` = total - hook: the input and output copies, GIL hand-over and
    onnxruntime's own work. For scale, ``copies_estimate_s`` times the same copies in
    numpy (``len(inputs)`` fresh ``np.empty`` + ``copyto`` and ``len(outputs)`` ``copyto``
    into existing buffers, after :func:`plugin.keep_freed_memory`).
    """
    from onnxruntime_extensions import PyCustomOpDef
    from onnxruntime_extensions._ocos import Opdef

    from onnx_training_ops.runtime import plugin

    sess, step = graph_session(op, n)
    hook_times, kernel_times = [], []
    original_hook = plugin._hook

    def timed_hook(k_id, feed, attributes):
        t0 = time.perf_counter()
        try:
            return original_hook(k_id, feed, attributes)
        finally:
            hook_times.append(time.perf_counter() - t0)

    wrapped = []
    for k_id in plugin._registered_ids:
        opdef = Opdef._odlist[k_id]
        body = opdef.body

        def timed_body(*args, _body=body, **kwargs):
            t0 = time.perf_counter()
            try:
                return _body(*args, **kwargs)
            finally:
                kernel_times.append(time.perf_counter() - t0)

        wrapped.append((opdef, body))
        opdef.body = timed_body
    PyCustomOpDef.install_hooker(timed_hook)
    try:
        for _ in range(3):
            step()
        hook_times.clear()
        kernel_times.clear()
        totals = []
        for _ in range(reps):
            t0 = time.perf_counter()
            step()
            totals.append(time.perf_counter() - t0)
    finally:
        PyCustomOpDef.install_hooker(original_hook)
        for opdef, body in wrapped:
            opdef.body = body
    total, hook, kernel = (statistics.median(x) for x in (totals, hook_times, kernel_times))
    n_in, n_out = len(STATE_NAMES[op]), len(STATE_NAMES[op]) - 1
    src = make_state(op, n)
    outs = [np.empty(n, np.float32) for _ in range(n_out)]

    def copies():
        fresh = []
        for k in STATE_NAMES[op]:
            a = np.empty(n, np.float32)
            np.copyto(a, src[k])
            fresh.append(a)
        for o, a in zip(outs, fresh):
            np.copyto(o, a)

    copies()
    copies_t = statistics.median(timed(copies) for _ in range(reps))
    return {
        "op": op, "n": n, "total_s": total, "hook_s": hook, "kernel_s": kernel,
        "hook_other_s": hook - kernel, "bridge_and_ort_s": total - hook,
        "copies_estimate_s": copies_t, "inputs_copied": n_in, "outputs_copied": n_out,
        "bytes_copied": (n_in + n_out) * n * 4,
    }  # fmt: skip


def format_breakdown(b: dict) -> str:
    """The breakdown as text lines."""
    ms = lambda k: f"{b[k] * 1e3:7.2f} ms ({b[k] / b['total_s']:4.0%})"  # noqa: E731
    return "\n".join([
        f"graph path breakdown, {b['op']} n={b['n']:.0e} (median of steps):",
        f"  total run_with_iobinding      {b['total_s'] * 1e3:7.2f} ms",
        f"  kernel (fused, in place)      {ms('kernel_s')}",
        f"  rest of the Python hook       {ms('hook_other_s')}",
        f"  bridge copies + onnxruntime   {ms('bridge_and_ort_s')}   "
        f"({b['inputs_copied']} inputs in, {b['outputs_copied']} outputs out: {b['bytes_copied'] / 1e6:.0f} MB)",
        f"  same copies in numpy          {b['copies_estimate_s'] * 1e3:7.2f} ms (estimate, for scale)",
    ] + ([f"  copies at the measured 1-thread copy bandwidth: "
          f"{b['copies_at_bandwidth_s'] * 1e3:.2f} ms "
          f"(2 x {b['bytes_copied'] / 1e6:.0f} MB read + written)"]
         if "copies_at_bandwidth_s" in b else []))  # fmt: skip
