"""One optimizer step on N float32 parameters, per implementation: a standalone benchmark.

    python benchmarks/bench_kernels.py [--sizes 1e4,1e5,1e6,1e7] [--ops adam,momentum,nesterov,adagrad]
                                       [--contenders fused,torch_fused,...] [--json out.json] [--png out.png]

Times are the median of repeated steps after warm-up (state carried from step to step,
as in training). The memory-bandwidth floor is the bytes one step must move (Adam reads
X, G, V, H and writes X, V, H: 7 passes of N*4 bytes; Momentum and Adagrad 5) divided
by the memory bandwidth measured in the same run (``np.copyto`` and an in-place
multiply over a buffer far larger than the last-level cache, one and two threads, the
best kept; see :func:`copy_bandwidth`). Below ~1e6 elements
the working set fits in cache, so the "floor" is a DRAM floor, not a bound.

Adding a contender: write ``factory(op, n) -> step`` where ``step()`` performs one
optimizer step on ``n`` float32 parameters (build the state in the factory; use
:func:`make_state` and :data:`ATTRS` for the same inputs as everyone else), raise
:class:`NotAvailable` if it cannot run that op, and register it with
``@contender("name")`` or ``CONTENDERS["name"] = factory``. Each contender is measured in
its own process by default (see :func:`measure_isolated`); a wrapper script that
registers extra contenders and then calls ``bench_kernels.main()`` keeps working, since
the child processes re-run it.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import threading
import time
from typing import Callable

import numpy as np

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
    from onnx_training_ops.kernels import REFERENCE_KERNELS

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
    from onnx_training_ops.kernels import fused
    from onnx_training_ops.kernels.adagrad import adagrad_rate
    from onnx_training_ops.kernels.adam import adam_rate
    from onnx_training_ops.kernels.momentum import momentum_beta

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


@contender("onnx_reference_evaluator")
def onnx_reference_evaluator(op: str, n: int):
    from onnx import TensorProto, helper
    from onnx.reference import ReferenceEvaluator

    names = STATE_NAMES[op]
    updated = [k for k in names if k != "G"]
    attrs = ATTRS[op]
    node = helper.make_node(
        ONNX_OP[op], ["R", "T", *names], [f"{k}_new" for k in updated], domain="ai.onnx.preview.training", **attrs
    )
    f32 = lambda name: helper.make_tensor_value_info(name, TensorProto.FLOAT, None)  # noqa: E731
    graph = helper.make_graph(
        [node],
        "step",
        [f32("R"), helper.make_tensor_value_info("T", TensorProto.INT64, None), *(f32(k) for k in names)],
        [f32(f"{k}_new") for k in updated],
    )
    model = helper.make_model(
        graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid("ai.onnx.preview.training", 1)]
    )
    sess = ReferenceEvaluator(model)
    feeds = {"R": np.array(R, np.float32), "T": np.array(T, np.int64), **make_state(op, n)}

    def step():
        feeds.update(zip(updated, sess.run(None, feeds)))

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


# ---------------------------------------------------------------- measurement


def time_step(step: Callable[[], None], min_time: float, max_reps: int, min_reps: int = 5) -> dict:
    """Median (and min, repetitions) of ``step()`` wall time in seconds, after warm-up."""
    step()  # warm-up: first-call costs (compilation, allocation, state creation)
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


def measure_isolated(name: str, ops, sizes, min_time: float, max_reps: int) -> dict:
    """:func:`measure` in a fresh process. Thread pools of different contenders (numba's
    OpenMP, torch's own OpenMP, numexpr, onnxruntime) spin-wait after their work; in one
    process on 2 cores they steal each other's core and a parallel step then stalls for a
    scheduler slice (~8 ms here). The child re-runs the entry script (``sys.argv[0]``),
    so contenders a wrapper script registers before calling :func:`main` exist there too."""
    import subprocess

    cmd = [sys.executable, sys.argv[0], "--worker", name, "--ops", ",".join(ops),
           "--sizes", ",".join(map(str, sizes)), "--min-time", str(min_time), "--max-reps", str(max_reps)]  # fmt: skip
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        reason = f"worker failed: {proc.stderr.strip().splitlines()[-1:] or proc.returncode}"
        return {f"{op}/{n}": {"n/a": reason} for op in ops for n in sizes}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def run(sizes, ops, contenders, min_time: float, max_reps: int, log=print, stat: str = "median_s",
        isolate: bool = True) -> dict:  # fmt: skip
    load_before = _loadavg()
    bw = copy_bandwidth()
    log("bandwidth (bytes read + written), GB/s: " + ", ".join(f"{k} {v / 1e9:.1f}" for k, v in bw.items()))
    per_contender = {}
    for name in contenders:
        log(f"measuring {name}{' (own process)' if isolate else ''} ...")
        per_contender[name] = (measure_isolated if isolate else measure)(name, ops, sizes, min_time, max_reps)
    log(f"{stat[:-2]} time per step; xT = ratio to torch_fused, xF = ratio to the bandwidth floor")
    log(format_header(contenders))
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
            log(format_row(row, contenders, stat))
    return {
        "machine": {"platform": platform.platform(), "processor": platform.processor(), "python": sys.version.split()[0]},
        "versions": _versions(),
        "loadavg_before_after": [load_before, _loadavg()],  # other processes distort timings on 2 cores
        "isolated_processes": isolate,
        "copy_bandwidth_bytes_per_s": bw,
        "dtype": "float32",
        "t": T,
        "results": results,
    }


def _loadavg():
    try:
        import os

        return os.getloadavg()
    except (AttributeError, OSError):
        return None


def _versions() -> dict:
    out = {}
    for mod in ("numpy", "numba", "onnx", "onnxruntime", "torch"):
        try:
            out[mod] = __import__(mod).__version__
        except Exception:  # noqa: BLE001 - a missing peer is reported, not fatal
            out[mod] = None
    return out


def format_header(contenders) -> str:
    return f"{'op':9s} {'n':>9s} " + " ".join(f"{c:>26s}" for c in contenders) + f" {'floor':>9s}"


def format_row(row, contenders, stat: str = "median_s") -> str:
    ref = row["times"].get("torch_fused", {}).get(stat)
    cells = []
    for c in contenders:
        tm = row["times"].get(c)
        if tm is None:
            cells.append(f"{'n/a':>26s}")
            continue
        ms = tm[stat] * 1e3
        vs_torch = f"{tm[stat] / ref:6.2f}xT" if ref else "    -   "
        vs_floor = f"{tm[stat] / row['floor_s']:7.1f}xF"
        cells.append(f"{ms:9.4f}ms {vs_torch} {vs_floor}")
    return f"{row['op']:9s} {row['n']:>9d} " + " ".join(cells) + f" {row['floor_s'] * 1e3:7.4f}ms"


def plot(report: dict, path: str, stat: str = "median_s") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in report["results"]))
    fig, axes = plt.subplots(1, len(ops), figsize=(4.5 * len(ops), 4), squeeze=False)
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
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES), help="comma list, e.g. 1e4,1e5")
    ap.add_argument("--ops", default=",".join(OPS))
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"any of {', '.join(CONTENDERS)}")
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds of timed steps per cell (at least 5 steps)")
    ap.add_argument("--max-reps", type=int, default=500)
    ap.add_argument("--stat", choices=["median", "min"], default="median",
                    help="statistic shown in the table and plot (the JSON holds both)")  # fmt: skip
    ap.add_argument("--same-process", action="store_true",
                    help="measure all contenders in this process (default: each in its own)")  # fmt: skip
    ap.add_argument("--worker", help=argparse.SUPPRESS)  # internal: measure one contender, print JSON
    ap.add_argument("--json", help="write the results as JSON here")
    ap.add_argument("--png", help="write a log-log plot here (needs matplotlib)")
    args = ap.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    ops = args.ops.split(",")
    contenders = args.contenders.split(",")
    for c in contenders + ([args.worker] if args.worker else []):
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r}; known: {', '.join(CONTENDERS)}")
    if args.worker:
        print(json.dumps(measure(args.worker, ops, sizes, args.min_time, args.max_reps)))
        return 0
    stat = f"{args.stat}_s"
    report = run(sizes, ops, contenders, args.min_time, args.max_reps, stat=stat, isolate=not args.same_process)
    for r in report["results"]:
        for c, why in r["n/a"].items():
            print(f"n/a: {r['op']} {c}: {why}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    if args.png:
        plot(report, args.png, stat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
