"""Optimizer benchmarks: one optimizer step per implementation, and MLP training steps/s.

    python -m benchmarks [--sizes 1e4,1e5,1e6,1e7] [--ops adam,momentum,nesterov,adagrad]
                         [--contenders graph,graph_native,portable,training_session,...]
                         [--quick] [--ortt-python PATH]
                         [--json benchmarks/results/bench.json] [--png benchmarks/results/bench.png]
    python -m benchmarks embeddings|overhead|memory|models|gpu ...   (see ``__main__.py``)

(``make bench`` runs it.) This folder is not part of the installed
package: run it from a checkout (its root on ``sys.path``; the worker processes it starts get
the root on ``PYTHONPATH``, so they find it from any working directory). Two parts:

**One step on N float32 parameters** for Adam, Momentum (standard and nesterov) and
Adagrad, per contender (:data:`.contenders.CONTENDERS`): ``graph`` (a one-node model in
:class:`onnx_training_ops.InferenceSession`, the PyOp plugin, IOBinding with two sets of
buffers swapped between steps), ``graph_native`` (the same model prepared with
``kernels="native"``, X/V/H bound in place: one OrtValue as input and output),
``portable`` (``prepare(model, portable=True)``: standard ONNX ops in plain onnxruntime,
IOBinding in place), ``training_session`` (``TrainingSession.from_graph`` on the same node:
the fast path, state updated in place by the fused kernel; G is a feed read on every
step), the ``fused`` kernel alone, the ``numpy_reference`` kernels,
``onnx_reference_evaluator`` (``onnx.reference.ReferenceEvaluator``), ``torch_foreach`` and
``torch_fused`` (``torch.optim`` with ``foreach=True`` / ``fused=True``), and with
``--ortt-python PATH`` ``onnxruntime_training`` (onnxruntime-training's on-device API,
AdamW ``Optimizer.step()`` alone, in that Python). Times are the median of repeated steps
after warm-up (state carried from step to step, as in training; T fixed at 10 so bias
correction is in play). The memory-bandwidth floor is the bytes one step must move (Adam
reads X, G, V, H and writes X, V, H: 7 passes of N*4 bytes; Momentum and Adagrad 5)
divided by the memory bandwidth measured in the same run
(:func:`.measure.copy_bandwidth`). Below ~1e6 elements the working set fits in cache, so
the "floor" is a DRAM floor, not a bound.

**End to end** (:mod:`.mlp`): training steps/s of an MLP 64-128-10 (ReLU, cross-entropy,
batch 64, Adam) for the TrainingSession fast path, the full graph (``fast=False``) and a
torch eager loop, each in its own process, run in interleaved rounds.

Each contender runs in its own process (:mod:`.measure`).

Adding a contender: write ``factory(op, n) -> step`` where ``step()`` performs one
optimizer step on ``n`` float32 parameters (build the state in the factory; use
:func:`.problem.make_state` and :data:`.problem.ATTRS` for the same inputs as everyone
else), raise :class:`NotAvailable` if it cannot run that op, and register it with
``@contender("name")``. A script that registers contenders and then calls
``main(argv, worker_script=__file__)`` has them measured too: the worker processes re-run
that script.

Modules, top-down: this CLI; :mod:`.measure` (timing, processes) and :mod:`.report` (table,
JSON, plot); :mod:`.contenders`; :mod:`.problem` (the step every contender performs);
:mod:`.breakdown` (the PyOp path's time split); :mod:`.mlp`, :mod:`.embeddings`;
``_ortt_worker.py`` (runs in onnxruntime-training's own Python).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil

# the worker processes (``python -m benchmarks...``) find this checkout's folder from any directory
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in os.environ.get("PYTHONPATH", "").split(os.pathsep):
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, os.environ.get("PYTHONPATH")) if p)

from . import threads  # noqa: E402
from .breakdown import format_breakdown, graph_breakdown
from .contenders import (
    CONTENDERS,
    DEFAULT_CONTENDERS,
    GRAPH_OPTIONS,
    NATIVE_OPTIONS,
    ORTT,
    PORTABLE_OPTIONS,
    contender,
    graph,
    graph_native,
    graph_session,
    portable,
    portable_session,
    torch_foreach,  # fmt: skip
    torch_fused,
    training_session,
)
from .measure import copy_bandwidth, floor_seconds, loadavg, measure, measure_isolated, measure_ortt, run, run_worker
from .mlp import DEFAULT_SHAPES, MLP_CONTENDERS, format_mlp, measure_mlp, mlp_worker, parse_shape
from .problem import ATTRS, ONNX_OP, OPS, SIZES, STATE_NAMES, NotAvailable, R, T, make_state, step_model
from .report import flags, format_table, plot, write_json
from .timing import time_step

__all__ = [
    "ATTRS", "CONTENDERS", "DEFAULT_CONTENDERS", "GRAPH_OPTIONS", "NATIVE_OPTIONS", "ONNX_OP", "OPS", "ORTT",
    "PORTABLE_OPTIONS", "R", "SIZES", "STATE_NAMES", "T", "NotAvailable", "add_arguments", "contender",
    "copy_bandwidth", "floor_seconds", "format_breakdown", "format_mlp", "format_table", "graph", "graph_breakdown",
    "graph_native", "graph_session", "main", "make_state", "measure", "measure_isolated", "measure_mlp", "measure_ortt",
    "plot", "portable", "portable_session", "run", "run_from_args", "step_model", "time_step", "torch_foreach",
    "torch_fused", "training_session",
]  # fmt: skip


def main(argv: list[str] | None = None, worker_script: str | None = None) -> int:
    """The command line (``python -m benchmarks``). ``worker_script``: the
    script the worker processes run (default: this package), for scripts that register
    extra contenders before calling ``main``."""
    ap = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    return run_from_args(args, ap, worker_script)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    """The bench's options on ``ap``."""
    ap.add_argument("--sizes", default=None, help="comma list (default 1e4,1e5,1e6,1e7; --quick: 1e4,1e5)")
    ap.add_argument("--ops", default=",".join(OPS),
                    help=f"comma list of optimizer steps to time, of: {', '.join(OPS)} (default: all)")
    ap.add_argument("--threads", type=int, default=None,
                    help="threads of every pool in every contender: torch, numba, onnxruntime intra-op "
                         "(default: the machine's cores; --quick: 1)")
    ap.add_argument("--contenders", default=None,
                    help=f"comma list of: {', '.join(CONTENDERS)} "
                         f"(default: {','.join(DEFAULT_CONTENDERS)})")  # fmt: skip
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
                         f"adds onnxruntime-training's AdamW step to the MLP table and, as the {ORTT} "
                         "contender (added to the default set), one Optimizer.step() per size")
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
    """Run what ``args`` ask (a worker's part, or the whole bench); the exit status."""
    if args.threads is not None and args.threads < 1:
        ap.error(f"--threads must be >= 1, found {args.threads}")
    threads.pin(args.threads or threads.requested() or (1 if args.quick else os.cpu_count()))
    sizes = [int(float(s)) for s in (args.sizes or ("1e4,1e5" if args.quick else ",".join(map(str, SIZES)))).split(",")]
    ops = args.ops.split(",")
    contenders = [c for c in (args.contenders or ",".join(DEFAULT_CONTENDERS)).split(",") if c]
    if args.ortt_python and not args.contenders and ORTT not in contenders:
        contenders.append(ORTT)
    min_time = args.min_time if args.min_time is not None else (0.05 if args.quick else 0.5)
    max_reps = args.max_reps if args.max_reps is not None else (20 if args.quick else 500)
    mlp_names = [] if args.mlp in ("", "none") else args.mlp.split(",")
    for c in contenders + ([args.worker] if args.worker else []):
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r}; known: {', '.join(CONTENDERS)}")
    if args.ortt_python and shutil.which(args.ortt_python) is None:
        ap.error(f"--ortt-python {args.ortt_python!r}: no such executable")
    for op in ops:
        if op not in OPS:
            ap.error(f"unknown op {op!r}; known: {', '.join(OPS)}")
    for m in mlp_names + ([args.mlp_worker] if args.mlp_worker else []):
        if m not in MLP_CONTENDERS:
            ap.error(f"unknown MLP contender {m!r}; known: {', '.join(MLP_CONTENDERS)}")
    for shape in args.mlp_shapes.split(";") + ([args.mlp_shape] if args.mlp_shape else []):
        try:
            parse_shape(shape)
        except ValueError:
            ap.error(f"--mlp-shapes: {shape!r} is not layer sizes x batch, e.g. {DEFAULT_SHAPES[0]!r}")
    if args.worker:
        print(json.dumps({**measure(args.worker, ops, sizes, min_time, max_reps), "threads": threads.in_use()}))
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
                 worker_script=worker_script, bandwidth_bytes=(64 if args.quick else 512) * 2**20,
                 ortt_python=args.ortt_python)  # fmt: skip
    report["flags"] = flags(report)
    print(format_table(report, contenders))
    for r in report["results"]:
        for c, why in r["n/a"].items():
            print(f"n/a: {r['op']} {r['n']} {c}: {why}")
    if "graph" in contenders and not args.no_breakdown:
        target = f"{'adam' if 'adam' in ops else ops[0]}/{max(sizes)}"
        print(f"measuring the graph path's breakdown ({target}, own process) ...")
        breakdown, reason = run_worker(["--breakdown-worker", target] + (["--quick"] if args.quick else []),
                                        worker_script)  # fmt: skip
        if breakdown is not None:
            bandwidth = report["copy_bandwidth_bytes_per_s"]["copy_1_thread"]
            breakdown["copies_at_bandwidth_s"] = 2 * breakdown["bytes_copied"] / bandwidth
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
    report["loadavg_end"] = loadavg()
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    if args.png:
        plot(report, args.png, stat)
        print(f"wrote {args.png}")
    return 0
