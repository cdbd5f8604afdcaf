"""Optimizer benchmarks: one optimizer step per implementation, and MLP training steps/s.

    python -m onnx_training_ops bench [--sizes 1e4,1e5,1e6,1e7] [--ops adam,momentum,nesterov,adagrad]
                                      [--contenders graph,training_session,fused,...] [--quick]
                                      [--json benchmarks/results/bench.json] [--png benchmarks/results/bench.png]

(``benchmarks/bench_optimizers.py`` runs the same.) Two parts:

**One step on N float32 parameters** for Adam, Momentum (standard and nesterov) and
Adagrad, per contender (:data:`CONTENDERS`): ``graph`` (a one-node model in
:class:`onnx_training_ops.InferenceSession`, the PyOp plugin, IOBinding with two sets of
buffers swapped between steps), ``training_session`` (``TrainingSession.from_graph`` on
the same node: the fast path, state updated in place by the fused kernel; G is a feed
read on every step), the ``fused`` kernel alone, the ``numpy_reference`` kernels,
``onnx_reference_evaluator`` (``onnx.reference.ReferenceEvaluator``), ``torch_foreach``
and ``torch_fused`` (``torch.optim`` with ``foreach=True`` / ``fused=True``). Times are
the median of repeated steps after warm-up (state carried from step to step, as in
training; T fixed at 10 so bias correction is in play). The memory-bandwidth floor is
the bytes one step must move (Adam reads X, G, V, H and writes X, V, H: 7 passes of N*4
bytes; Momentum and Adagrad 5) divided by the memory bandwidth measured in the same run
(:func:`copy_bandwidth`). Below ~1e6 elements the working set fits in cache, so the
"floor" is a DRAM floor, not a bound.

**End to end**: training steps/s of an MLP 64-128-10 (ReLU, cross-entropy, batch 64, Adam)
for the TrainingSession fast path, the full graph (``fast=False``) and a torch eager loop
(``torch.optim.Adam`` with torch's default implementation choice, and with ``fused=True``),
each in its own process, run in interleaved rounds (:func:`measure_mlp`).

Each contender runs in its own process (numba's and torch's thread pools spin-wait after
their work; in one process on 2 cores they steal each other's core).

Adding a contender: write ``factory(op, n) -> step`` where ``step()`` performs one
optimizer step on ``n`` float32 parameters (build the state in the factory; use
:func:`make_state` and :data:`ATTRS` for the same inputs as everyone else), raise
:class:`NotAvailable` if it cannot run that op, and register it with
``@contender("name")``. A script that registers contenders and then calls
``main(argv, worker_script=__file__)`` has them measured too: the worker processes
re-run that script.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import threading
import time
from typing import Callable

import numpy as np

from .bench_mlp import DEFAULT_SHAPES, MLP_CONTENDERS, format_mlp, measure_mlp, mlp_worker, parse_shape

OPS = ("adam", "momentum", "nesterov", "adagrad")
SIZES = (10**4, 10**5, 10**6, 10**7)
ONNX_OP = {"adam": "Adam", "momentum": "Momentum", "nesterov": "Momentum", "adagrad": "Adagrad"}
# Passes over N*itemsize bytes one step must make at least: (reads, writes).
TRAFFIC = {"adam": (4, 3), "momentum": (3, 2), "nesterov": (3, 2), "adagrad": (3, 2)}

R = float(np.float32(1e-3))
T = 10  # T > 0: Adam's bias correction and Momentum's beta are in play
F32 = lambda v: float(np.float32(v))  # noqa: E731 - attribute values as a model (float32) holds them
ATTRS = {
    "adam": dict(alpha=F32(0.9), beta=F32(0.999), epsilon=F32(1e-8), norm_coefficient=0.0, norm_coefficient_post=0.0),
    # torch SGD(momentum=0.9, dampening=0) <-> Momentum(alpha=0.9, beta=1)
    "momentum": dict(alpha=F32(0.9), beta=1.0, mode="standard", norm_coefficient=0.0),
    "nesterov": dict(alpha=F32(0.9), beta=1.0, mode="nesterov", norm_coefficient=0.0),
    "adagrad": dict(decay_factor=0.0, epsilon=F32(1e-10), norm_coefficient=0.0),
}
STATE_NAMES = {"adam": ("X", "G", "V", "H"), "momentum": ("X", "G", "V"), "nesterov": ("X", "G", "V"), "adagrad": ("X", "G", "H")}


class NotAvailable(Exception):
    """A contender cannot run this op (missing package, unsupported mode, ...)."""


def make_state(op: str, n: int, dtype=np.float32, seed: int = 0) -> dict[str, np.ndarray]:
    """The op's tensors X, G and V/H (as named in STATE_NAMES), the same for every contender."""
    rng = np.random.default_rng(seed)
    state = {"X": rng.standard_normal(n).astype(dtype), "G": (rng.standard_normal(n) * 1e-2).astype(dtype)}
    if "V" in STATE_NAMES[op]:
        state["V"] = (rng.standard_normal(n) * 1e-2).astype(dtype)
    if "H" in STATE_NAMES[op]:
        state["H"] = (rng.random(n) * 1e-4).astype(dtype)
    return state


CONTENDERS: dict[str, Callable[[str, int], Callable[[], None]]] = {}


def contender(name: str):
    def register(factory):
        CONTENDERS[name] = factory
        return factory

    return register


@contender("numpy_reference")
def numpy_reference(op: str, n: int):
    from .kernels import REFERENCE_KERNELS

    kernel, attrs, names = REFERENCE_KERNELS[ONNX_OP[op]], ATTRS[op], STATE_NAMES[op]
    s = make_state(op, n)
    r, t = np.array(R, np.float32), np.array(T, np.int64)
    updated = [k for k in names if k != "G"]

    def step():
        outs = kernel(r, t, *(s[k] for k in names), **attrs)
        s.update(zip(updated, outs))

    return step


@contender("fused")
def fused_kernel(op: str, n: int):
    from .kernels import fused
    from .kernels.adagrad import adagrad_rate
    from .kernels.adam import adam_rate
    from .kernels.momentum import momentum_beta

    fused.warm_up()
    a, s = ATTRS[op], make_state(op, n)
    if op == "adam":

        def step():  # scalar preparation included: it is part of every step
            rate = adam_rate(R, T, a["alpha"], a["beta"])
            fused.adam_(s["X"], s["G"], s["V"], s["H"], rate, a["alpha"], a["beta"], a["epsilon"],
                        a["norm_coefficient"], a["norm_coefficient_post"])  # fmt: skip

    elif op in ("momentum", "nesterov"):

        def step():
            fused.momentum_(s["X"], s["G"], s["V"], R, a["alpha"], momentum_beta(T, a["beta"]),
                            a["norm_coefficient"], a["mode"] == "nesterov")  # fmt: skip

    else:

        def step():
            rate = adagrad_rate(R, T, a["decay_factor"])
            fused.adagrad_(s["X"], s["G"], s["H"], rate, a["epsilon"], a["norm_coefficient"])

    return step


def step_model(op: str, n: int, initializers: dict[str, np.ndarray] | None = None, count_output: bool = False):
    """A model of one ``op`` node on tensors of ``n`` float32 (``n=None``: unknown shape);
    ``initializers`` become initializers (and stay graph inputs with a default).
    ``count_output`` adds a scalar ``T_out = Identity(T)`` node and output (see
    :func:`training_session`)."""
    from onnx import TensorProto, helper, numpy_helper

    from .schema import DOMAIN

    names = STATE_NAMES[op]
    updated = [k for k in names if k != "G"]
    node = helper.make_node(ONNX_OP[op], ["R", "T", *names], [f"{k}_new" for k in updated], domain=DOMAIN, **ATTRS[op])
    shape = None if n is None else [n]
    f32 = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, shape)  # noqa: E731
    nodes = [node]
    outputs = [f32(f"{k}_new") for k in updated]
    if count_output:
        nodes.append(helper.make_node("Identity", ["T"], ["T_out"]))
        outputs.append(helper.make_tensor_value_info("T_out", TensorProto.INT64, []))
    graph = helper.make_graph(
        nodes,
        "step",
        [helper.make_tensor_value_info("R", TensorProto.FLOAT, []), helper.make_tensor_value_info("T", TensorProto.INT64, []),
         *(f32(k) for k in names)],  # fmt: skip
        outputs,
        initializer=[numpy_helper.from_array(v, k) for k, v in (initializers or {}).items()],
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])
    model.ir_version = 8  # onnxruntime rejects onnx 1.23's default (IR 14)
    return model


@contender("onnx_reference_evaluator")
def onnx_reference_evaluator(op: str, n: int):
    from onnx.reference import ReferenceEvaluator

    updated = [k for k in STATE_NAMES[op] if k != "G"]
    sess = ReferenceEvaluator(step_model(op, None))
    feeds = {"R": np.array(R, np.float32), "T": np.array(T, np.int64), **make_state(op, n)}

    def step():
        feeds.update(zip(updated, sess.run(None, feeds)))

    return step


# Session options of the ``graph`` contender, chosen by measurement on this machine (2 cores,
# Adam, median of 5 runs of the four GRAPH_VARIANTS, ms per step at 1e4/1e5/1e6/1e7):
#   default threads, spinning   0.069  0.197  4.01  38.1
#   1 thread, spinning          0.062  0.206  3.46  35.2
#   default threads, no spin    0.061  0.216  3.46  33.9
#   1 thread, no spin           0.040  0.157  2.79  33.5   <- chosen
# The node is one PyOp that runs numba's own threads; onnxruntime's intra-op pool has no
# work to share and, spinning, only competes with them. Run-to-run spread is 10-25%.
GRAPH_OPTIONS = {"intra_op_num_threads": 1, "allow_spinning": False}
GRAPH_VARIANTS = {
    "graph_default": {"intra_op_num_threads": 0, "allow_spinning": True},
    "graph_t1": {"intra_op_num_threads": 1, "allow_spinning": True},
    "graph_nospin": {"intra_op_num_threads": 0, "allow_spinning": False},
    "graph_t1_nospin": {"intra_op_num_threads": 1, "allow_spinning": False},
}


def graph_session(op: str, n: int, options: dict | None = None, kernels: str = "pyop"):
    """``(session, step)``: the one-node model in :class:`onnx_training_ops.InferenceSession`
    run with IOBinding. Inputs are bound zero-copy (``OrtValue.ortvalue_from_numpy``),
    outputs to preallocated buffers; two bindings swap the roles of two sets of X/V/H
    buffers, so each step's new state is the next step's input without a copy.
    ``kernels``: the PyOp path unless told otherwise (``benchmarks/bench_native.py`` times both)."""
    import onnxruntime as ort

    from . import plugin
    from .session import InferenceSession

    plugin.keep_freed_memory()  # the bridge's per-call input copies then reuse memory
    options = GRAPH_OPTIONS if options is None else options
    so = ort.SessionOptions()
    so.intra_op_num_threads = options["intra_op_num_threads"]
    if not options["allow_spinning"]:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = InferenceSession(step_model(op, n), sess_options=so, kernels=kernels)
    s = make_state(op, n)
    updated = [k for k in STATE_NAMES[op] if k != "G"]
    sets = [{k: s[k] for k in updated}, {k: np.empty_like(s[k]) for k in updated}]
    fixed = {"R": np.array(R, np.float32), "T": np.array(T, np.int64), "G": s["G"]}
    bindings = []
    for i in (0, 1):
        b = sess.io_binding()
        for k, v in fixed.items():
            b.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
        for k in updated:
            b.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(sets[i][k]))
            b.bind_ortvalue_output(f"{k}_new", ort.OrtValue.ortvalue_from_numpy(sets[1 - i][k]))
        bindings.append(b)
    current = [0]
    run = sess.run_with_iobinding

    def step():
        run(bindings[current[0]])
        current[0] ^= 1

    step.buffers = sets  # for tests: the state lives in sets[current]
    step.current = current
    return sess, step


@contender("graph")
def graph(op: str, n: int):
    return graph_session(op, n)[1]


def _graph_variant(options):
    return lambda op, n: graph_session(op, n, options)[1]


@contender("training_session")
def training_session(op: str, n: int):
    """``TrainingSession.from_graph`` on the one-node model, X_new->X, V_new->V, H_new->H:
    the fast path updates the state in place with the fused kernel. R and T are
    initializers; G is a graph input, fed on every step (as a real gradient is) and read
    by the kernel in place.

    The model also carries ``T_out = Identity(T)``: with the optimizer node cut out, a graph
    of nothing else leaves onnxruntime a session with no nodes, which it refuses to
    create ("OrtValue indexes should have been populated"). The scalar Identity costs
    one tiny onnxruntime run per step, as a real model's forward/backward would dwarf."""
    from .training import TrainingSession

    s = make_state(op, n)
    updated = [k for k in STATE_NAMES[op] if k != "G"]
    init = {"R": np.array(R, np.float32), "T": np.array(T, np.int64), **{k: s[k] for k in updated}}
    sess = TrainingSession.from_graph(step_model(op, n, init, count_output=True), {f"{k}_new": k for k in updated})
    if not sess.fast_path_nodes:
        raise NotAvailable("the fast path did not take the optimizer node")
    feeds = {"G": s["G"]}
    run = sess.step

    def step():
        run(feeds)

    step.session = sess
    return step


def _torch_optimizer(op: str, n: int, impl: str):
    try:
        import torch
    except ImportError as exc:
        raise NotAvailable(f"torch not importable: {exc}") from exc
    s = make_state(op, n)
    p = torch.nn.Parameter(torch.from_numpy(s["X"]))
    p.grad = torch.from_numpy(s["G"])
    kw = {impl: True}
    a = ATTRS[op]
    try:
        if op == "adam":
            opt = torch.optim.Adam([p], lr=R, betas=(a["alpha"], a["beta"]), eps=a["epsilon"], **kw)
        elif op in ("momentum", "nesterov"):
            opt = torch.optim.SGD([p], lr=R, momentum=a["alpha"], dampening=0.0, nesterov=op == "nesterov", **kw)
        else:
            opt = torch.optim.Adagrad([p], lr=R, eps=a["epsilon"], **kw)
        opt.step()  # creates the state (moments, step counters); fails here if unsupported
    except (RuntimeError, ValueError, TypeError) as exc:
        raise NotAvailable(f"torch.optim {impl}=True: {exc}") from exc
    return opt.step


@contender("torch_foreach")
def torch_foreach(op: str, n: int):
    return _torch_optimizer(op, n, "foreach")


@contender("torch_fused")
def torch_fused(op: str, n: int):
    return _torch_optimizer(op, n, "fused")




for _name, _options in GRAPH_VARIANTS.items():  # not in the default set: for choosing GRAPH_OPTIONS
    CONTENDERS[_name] = _graph_variant(_options)

DEFAULT_CONTENDERS = ("graph", "training_session", "fused", "numpy_reference", "onnx_reference_evaluator",
                      "torch_foreach", "torch_fused")  # fmt: skip


# ---------------------------------------------------------------- measurement


def time_step(step: Callable[[], None], min_time: float, max_reps: int, min_reps: int = 5, warmup: int = 2) -> dict:
    """Median (and min, repetitions) of ``step()`` wall time in seconds, after warm-up."""
    for _ in range(warmup):  # first-call costs (compilation, allocation, state creation, page faults)
        step()
    t0 = time.perf_counter()
    step()
    first = time.perf_counter() - t0
    reps = int(min(max_reps, max(min_reps, min_time / max(first, 1e-7))))
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        step()
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "reps": reps}


def copy_bandwidth(nbytes: int = 512 * 2**20, reps: int = 7) -> dict:
    """Bytes read + written per second over ``nbytes`` (far beyond the last-level cache),
    with one thread and with two threads each doing half:

    - ``copy``: ``np.copyto(dst, src)``. Its stores to ``dst`` first pull each line into
      cache (write-allocate), so DRAM moves ~3 bytes per 2 counted: it understates what
      an in-place update, whose stores hit lines it has just read, can reach.
    - ``inplace``: ``np.multiply(a, 1, out=a)``, a read-modify-write stream like the
      optimizers' own.

    ``best`` (the largest) is the bandwidth the floor uses.
    """
    src = np.ones(nbytes // 4, np.float32)
    dst = np.zeros_like(src)
    half = src.size // 2
    one = np.float32(1)

    def copy(d, s):
        np.copyto(d, s)

    def inplace(d, s):
        np.multiply(d, one, out=d)

    out = {}
    for name, kernel in (("copy", copy), ("inplace", inplace)):

        def one_thread():
            kernel(dst, src)

        def two_threads():  # numpy releases the GIL in both
            th = threading.Thread(target=kernel, args=(dst[:half], src[:half]))
            th.start()
            kernel(dst[half:], src[half:])
            th.join()

        for label, f in (("1_thread", one_thread), ("2_threads", two_threads)):
            f()
            out[f"{name}_{label}"] = 2 * nbytes / min(_timed(f) for _ in range(reps))
    out["best"] = max(out.values())
    return out


def _timed(f):
    t0 = time.perf_counter()
    f()
    return time.perf_counter() - t0


def floor_seconds(op: str, n: int, bandwidth: float, itemsize: int = 4) -> float:
    reads, writes = TRAFFIC[op]
    return (reads + writes) * n * itemsize / bandwidth


def measure(name: str, ops, sizes, min_time: float, max_reps: int) -> dict:
    """One contender over ops x sizes in this process: ``{"op/n": timing or {"n/a": reason}}``."""
    out = {}
    for op in ops:
        for n in sizes:
            try:
                step = CONTENDERS[name](op, n)
            except NotAvailable as exc:
                out[f"{op}/{n}"] = {"n/a": str(exc)}
                continue
            out[f"{op}/{n}"] = time_step(step, min_time, max_reps)
            del step
    return out


def _worker_command(worker_script: str | None) -> list[str]:
    if worker_script:
        return [sys.executable, worker_script]
    return [sys.executable, "-m", "onnx_training_ops.bench"]


def _run_worker(args: list[str], worker_script: str | None, timeout: float | None = None):
    """Run a worker process; ``(parsed last stdout line, None)`` or ``(None, reason)``."""
    proc = subprocess.run(_worker_command(worker_script) + args, capture_output=True, text=True, timeout=timeout)
    if proc.returncode:
        return None, f"worker failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), None


def measure_isolated(name: str, ops, sizes, min_time: float, max_reps: int, worker_script: str | None = None) -> dict:
    """:func:`measure` in a fresh process. Thread pools of different contenders (numba's
    OpenMP, torch's own OpenMP, onnxruntime's) spin-wait after their work; in one process
    on 2 cores they steal each other's core and a parallel step then stalls for a
    scheduler slice (~8 ms here)."""
    args = ["--worker", name, "--ops", ",".join(ops), "--sizes", ",".join(map(str, sizes)),
            "--min-time", str(min_time), "--max-reps", str(max_reps)]  # fmt: skip
    out, reason = _run_worker(args, worker_script)
    if out is None:
        return {f"{op}/{n}": {"n/a": reason} for op in ops for n in sizes}
    return out


# ---------------------------------------------------------------- graph path: where the time goes


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

    from . import plugin

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
    copies_t = statistics.median(_timed(copies) for _ in range(reps))
    return {
        "op": op, "n": n, "total_s": total, "hook_s": hook, "kernel_s": kernel,
        "hook_other_s": hook - kernel, "bridge_and_ort_s": total - hook,
        "copies_estimate_s": copies_t, "inputs_copied": n_in, "outputs_copied": n_out,
        "bytes_copied": (n_in + n_out) * n * 4,
    }  # fmt: skip


def format_breakdown(b: dict) -> str:
    ms = lambda k: f"{b[k] * 1e3:7.2f} ms ({b[k] / b['total_s']:4.0%})"  # noqa: E731
    return "\n".join([
        f"graph path breakdown, {b['op']} n={b['n']:.0e} (median of steps):",
        f"  total run_with_iobinding      {b['total_s'] * 1e3:7.2f} ms",
        f"  kernel (fused, in place)      {ms('kernel_s')}",
        f"  rest of the Python hook       {ms('hook_other_s')}",
        f"  bridge copies + onnxruntime   {ms('bridge_and_ort_s')}   "
        f"({b['inputs_copied']} inputs in, {b['outputs_copied']} outputs out: {b['bytes_copied'] / 1e6:.0f} MB)",
        f"  same copies in numpy          {b['copies_estimate_s'] * 1e3:7.2f} ms (estimate, for scale)",
    ] + ([f"  copies at the measured 1-thread copy bandwidth: {b['copies_at_bandwidth_s'] * 1e3:.2f} ms "
          f"(2 x {b['bytes_copied'] / 1e6:.0f} MB read + written)"] if "copies_at_bandwidth_s" in b else []))  # fmt: skip


# ---------------------------------------------------------------- end to end: MLP training steps/s
# (in .bench_mlp)


# ---------------------------------------------------------------- the run, table, plot


def run(sizes, ops, contenders, min_time: float, max_reps: int, log=print, stat: str = "median_s",
        isolate: bool = True, worker_script: str | None = None, bandwidth_bytes: int = 512 * 2**20) -> dict:  # fmt: skip
    load_before = _loadavg()
    bw = copy_bandwidth(bandwidth_bytes)
    log("bandwidth (bytes read + written), GB/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items()))
    per_contender = {}
    for name in contenders:
        log(f"measuring {name}{' (own process)' if isolate else ''} ...")
        if isolate:
            per_contender[name] = measure_isolated(name, ops, sizes, min_time, max_reps, worker_script)
        else:
            per_contender[name] = measure(name, ops, sizes, min_time, max_reps)
    results = []
    for op in ops:
        for n in sizes:
            row = {"op": op, "n": n, "floor_s": floor_seconds(op, n, bw["best"]), "times": {}, "n/a": {}}
            for name in contenders:
                cell = per_contender[name][f"{op}/{n}"]
                if "n/a" in cell:
                    row["n/a"][name] = cell["n/a"]
                else:
                    row["times"][name] = cell
            results.append(row)
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": sys.version.split()[0],
                    "cpus": os.cpu_count()},  # fmt: skip
        "versions": _versions(),
        "loadavg_before_after": [load_before, _loadavg()],  # other processes distort timings on 2 cores
        "isolated_processes": isolate,
        "graph_session_options": GRAPH_OPTIONS,
        "training_session_gradient": "G is a graph input fed on every step; R and T are initializers",
        "copy_bandwidth_bytes_per_s": bw,
        "dtype": "float32",
        "t": T,
        "stat": stat,
        "results": results,
    }


def _loadavg():
    try:
        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def _versions() -> dict:
    out = {}
    for mod in ("numpy", "numba", "onnx", "onnxruntime", "onnxruntime_extensions", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing peer is reported, not fatal
            out[mod] = None
    return out


CELL = 27


def format_header(contenders) -> str:
    return f"{'op':9s} {'n':>9s} " + " ".join(f"{c:>{CELL}s}" for c in contenders) + f" {'floor':>10s}"


def format_row(row, contenders, stat: str = "median_s") -> str:
    ref = row["times"].get("torch_fused", {}).get(stat)
    cells = []
    for c in contenders:
        tm = row["times"].get(c)
        if tm is None:
            cells.append(f"{'n/a':>{CELL}s}")
            continue
        vs_torch = f"{tm[stat] / ref:5.2f}xT" if ref else "   -   "
        cells.append(f"{_ms(tm[stat])} {vs_torch} {tm[stat] / row['floor_s']:5.1f}xF")
    return f"{row['op']:9s} {row['n']:>9d} " + " ".join(cells) + f" {_ms(row['floor_s'])}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}ms"


def format_table(report: dict, contenders=None) -> str:
    stat = report.get("stat", "median_s")
    if contenders is None:
        contenders = list(dict.fromkeys(c for r in report["results"] for c in [*r["times"], *r["n/a"]]))
    lines = [f"{stat[:-2]} time per step; xT = ratio to torch_fused, xF = ratio to the bandwidth floor",
             format_header(contenders)]  # fmt: skip
    lines += [format_row(r, contenders, stat) for r in report["results"]]
    ratios = []
    for r in report["results"]:
        t = {c: v[stat] for c, v in r["times"].items()}
        parts = []
        if "graph" in t and "onnx_reference_evaluator" in t:
            parts.append(f"graph speed-up over ReferenceEvaluator {t['onnx_reference_evaluator'] / t['graph']:5.1f}x")
        if "training_session" in t:
            parts.append(f"fast path {t['training_session'] / r['floor_s']:5.2f}x floor")
            if "torch_fused" in t:
                parts.append(f"fast path {t['training_session'] / t['torch_fused']:5.2f}x torch_fused")
        if "graph" in t and "torch_fused" in t:
            parts.append(f"graph {t['graph'] / t['torch_fused']:5.2f}x torch_fused")
        if parts:
            ratios.append(f"{r['op']:9s} {r['n']:>9d}  " + "; ".join(parts))
    if ratios:
        lines += ["", "ratios:"] + ratios
    return "\n".join(lines)


def plot(report: dict, path: str, stat: str = "median_s") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in report["results"]))
    shapes = report.get("mlp", {})
    shape = next(iter(shapes), "")
    mlp = {k: v for k, v in shapes.get(shape, {}).items() if "steps_per_s" in v}
    ncols = len(ops) + bool(mlp)
    fig, axes = plt.subplots(1, ncols, figsize=(4.5 * ncols, 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in report["results"] if r["op"] == op]
        names = list(dict.fromkeys(c for r in rows for c in r["times"]))
        for c in names:
            pts = [(r["n"], r["times"][c][stat] * 1e3) for r in rows if c in r["times"]]
            ax.loglog(*zip(*pts), marker="o", label=c)
        ax.loglog([r["n"] for r in rows], [r["floor_s"] * 1e3 for r in rows], "k--", label="bandwidth floor")
        ax.set_title(f"{op} (float32, one step)")
        ax.set_xlabel("parameters")
        ax.set_ylabel(f"ms ({stat[:-2]})")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if mlp:
        ax = axes[0][-1]
        ax.barh(list(mlp), [v["steps_per_s"] for v in mlp.values()])
        ax.set_title(f"MLP {shape}, Adam")
        ax.set_xlabel("training steps/s")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None, worker_script: str | None = None) -> int:
    """The command line (``python -m onnx_training_ops bench``). ``worker_script``: the
    script the worker processes run (default: this module), for scripts that register
    extra contenders before calling ``main``."""
    ap = argparse.ArgumentParser(prog="onnx-training-ops bench", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    return run_from_args(args, ap, worker_script)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--sizes", default=None, help="comma list (default 1e4,1e5,1e6,1e7; --quick: 1e4,1e5)")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--contenders", default=",".join(DEFAULT_CONTENDERS),
                    help=f"comma list of: {', '.join(CONTENDERS)}")  # fmt: skip
    ap.add_argument("--quick", action="store_true", help="sizes 1e4,1e5, few repetitions, short MLP (a smoke test)")
    ap.add_argument("--min-time", type=float, default=None, help="seconds of timed steps per cell (default 0.5)")
    ap.add_argument("--max-reps", type=int, default=None, help="default 500")
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="statistic shown in the table and plot (the JSON holds both)")  # fmt: skip
    ap.add_argument("--mlp", default=",".join(MLP_CONTENDERS),
                    help=f"MLP contenders, comma list of {', '.join(MLP_CONTENDERS)}; 'none' to skip")  # fmt: skip
    ap.add_argument("--mlp-steps", type=int, default=None, help="steps per round (default 1000)")
    ap.add_argument("--mlp-rounds", type=int, default=None, help="rounds (default 5)")
    ap.add_argument("--mlp-shapes", default=";".join(DEFAULT_SHAPES),
                    help="MLP layer sizes x batch, ';'-separated (default %(default)s)")
    ap.add_argument("--ortt-python", default=None,
                    help="a Python with onnxruntime-training (its own virtualenv: numpy<2, onnx<=1.16, torch): "
                         "adds onnxruntime-training's AdamW step to the MLP table")
    ap.add_argument("--mlp-shape", help=argparse.SUPPRESS)
    ap.add_argument("--no-breakdown", action="store_true", help="skip the graph-path time breakdown")
    ap.add_argument("--same-process", action="store_true",
                    help="measure all contenders in this process (default: each in its own)")  # fmt: skip
    ap.add_argument("--json", default="benchmarks/results/bench.json", help="write the results here ('' for none)")
    ap.add_argument("--png", default="benchmarks/results/bench.png", help="write the plot here ('' for none)")
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one contender, print JSON
    ap.add_argument("--mlp-worker", help=argparse.SUPPRESS)
    ap.add_argument("--breakdown-worker", help=argparse.SUPPRESS)


def run_from_args(args: argparse.Namespace, ap: argparse.ArgumentParser, worker_script: str | None = None) -> int:
    sizes = [int(float(s)) for s in (args.sizes or ("1e4,1e5" if args.quick else ",".join(map(str, SIZES)))).split(",")]
    ops = args.ops.split(",")
    contenders = [c for c in args.contenders.split(",") if c]
    min_time = args.min_time if args.min_time is not None else (0.05 if args.quick else 0.5)
    max_reps = args.max_reps if args.max_reps is not None else (20 if args.quick else 500)
    mlp_names = [] if args.mlp in ("", "none") else args.mlp.split(",")
    for c in contenders + ([args.worker] if args.worker else []):
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r}; known: {', '.join(CONTENDERS)}")
    for op in ops:
        if op not in OPS:
            ap.error(f"unknown op {op!r}; known: {', '.join(OPS)}")
    for m in mlp_names + ([args.mlp_worker] if args.mlp_worker else []):
        if m not in MLP_CONTENDERS:
            ap.error(f"unknown MLP contender {m!r}; known: {', '.join(MLP_CONTENDERS)}")
    if args.worker:
        print(json.dumps(measure(args.worker, ops, sizes, min_time, max_reps)))
        return 0
    if args.mlp_worker:
        mlp_worker(args.mlp_worker, parse_shape(args.mlp_shape or DEFAULT_SHAPES[0]))
        return 0
    if args.breakdown_worker:
        op, n = args.breakdown_worker.split("/")
        print(json.dumps(graph_breakdown(op, int(n), reps=5 if args.quick else 20)))
        return 0
    stat = f"{args.stat}_s"
    report = run(sizes, ops, contenders, min_time, max_reps, stat=stat, isolate=not args.same_process,
                 worker_script=worker_script, bandwidth_bytes=(64 if args.quick else 512) * 2**20)  # fmt: skip
    print(format_table(report, contenders))
    for r in report["results"]:
        for c, why in r["n/a"].items():
            print(f"n/a: {r['op']} {r['n']} {c}: {why}")
    if "graph" in contenders and not args.no_breakdown:
        target = f"{'adam' if 'adam' in ops else ops[0]}/{max(sizes)}"
        print(f"measuring the graph path's breakdown ({target}, own process) ...")
        breakdown, reason = _run_worker(["--breakdown-worker", target] + (["--quick"] if args.quick else []),
                                        worker_script)  # fmt: skip
        if breakdown is not None:
            breakdown["copies_at_bandwidth_s"] = 2 * breakdown["bytes_copied"] / report["copy_bandwidth_bytes_per_s"]["copy_1_thread"]
        report["graph_breakdown"] = breakdown if breakdown is not None else {"n/a": reason}
        print(format_breakdown(breakdown) if breakdown is not None else f"graph breakdown n/a: {reason}")
    if mlp_names:
        print("measuring the MLP training loop (interleaved rounds, each contender in its own process) ...")
        steps = args.mlp_steps or (20 if args.quick else 1000)
        rounds = args.mlp_rounds or (2 if args.quick else 5)
        report["mlp"] = {}
        shapes = args.mlp_shapes.split(";")
        for shape in shapes[:1] if args.quick and args.mlp_shapes == ";".join(DEFAULT_SHAPES) else shapes:
            result = measure_mlp(mlp_names, steps, rounds, worker_script, parse_shape(shape), args.ortt_python)
            report["mlp"][shape] = result
            print(format_mlp(result, shape))
    report["loadavg_end"] = _loadavg()
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    if args.png:
        os.makedirs(os.path.dirname(os.path.abspath(args.png)), exist_ok=True)
        plot(report, args.png, stat)
        print(f"wrote {args.png}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
