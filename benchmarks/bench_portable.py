"""The portable form against the plugin graph path and TrainingSession's fast path (issue 10, part 3).

    python benchmarks/bench_portable.py [--sizes 1e5,1e6,1e7] [--ops adam,momentum,adagrad] [--rounds 3]

One optimizer step on n float32 parameters, median wall time per step; each contender's
median over ``--rounds`` interleaved rounds. Contenders:

* ``portable``: ``prepare(model, portable=True)`` (standard ONNX ops only) in a plain
  onnxruntime session, nothing registered, IOBinding with X/V/H bound as one OrtValue in and
  out (the state is updated in place, as the caller asks): bench's ``portable`` contender;
* ``portable_swap``: the same, outputs into a second set of buffers swapped every step (as
  the ``graph`` contender of ``benchmarks`` does);
* ``graph``: the one-node model in ``onnx_training_ops.InferenceSession`` (the PyOp plugin)
  with IOBinding, from ``benchmarks``;
* ``fast_path``: ``TrainingSession`` fast path (the fused kernel in place), from the same module;
* ``torch_fused``: ``torch.optim`` with ``fused=True`` when torch is installed.

It also prints what onnxruntime's graph optimizer made of the portable model (node counts
by op type before and after ``ORT_ENABLE_ALL``). Not part of the test suite.
"""

from __future__ import annotations

import argparse
import collections
import os
import statistics
import sys
import tempfile

import numpy as np
import onnx
import onnxruntime as ort

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: `benchmarks`

import benchmarks as bench
from benchmarks.contenders import session_options
from onnx_training_ops.runtime.pipeline import prepare


def _options(optimized_path: str) -> ort.SessionOptions:
    so = session_options(bench.PORTABLE_OPTIONS)
    so.optimized_model_filepath = optimized_path
    return so


CONTENDERS = {
    "portable": bench.portable,
    "portable_swap": lambda op, n: bench.portable_session(op, n, in_place=False)[1],
    "graph": bench.graph,
    "fast_path": bench.training_session,
    "torch_fused": bench.torch_fused,
}


def fusion_report(op: str, n: int = 1000) -> str:
    """Node counts of the portable model by op type, before and after onnxruntime's optimizer."""
    model = prepare(bench.step_model(op, n), portable=True)
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "optimized.onnx")
        so = _options(optimized_path=path)
        so.graph_optimization_level = ort.GraphOptimizationLevel.ORT_ENABLE_ALL
        ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
        optimized = onnx.load(path)
    count = lambda m: collections.Counter(nd.op_type for nd in m.graph.node)  # noqa: E731
    before, after = count(model), count(optimized)
    fmt = lambda c: ", ".join(f"{k} {v}" for k, v in sorted(c.items()))  # noqa: E731
    return (f"{op}: portable model {sum(before.values())} nodes ({fmt(before)}); after onnxruntime "
            f"ORT_ENABLE_ALL {sum(after.values())} nodes ({fmt(after)}), "
            f"{len(optimized.graph.initializer)} initializers")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--sizes", default="1e5,1e6,1e7")
    ap.add_argument("--ops", default="adam")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--min-time", type=float, default=0.5, help="seconds per contender and round")
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    args = ap.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    names = [c for c in args.contenders.split(",") if c]
    print(f"onnxruntime {ort.__version__}, onnx {onnx.__version__}, numpy {np.__version__}, {os.cpu_count()} cores")
    for op in args.ops.split(","):
        print(fusion_report(op))
        for n in sizes:
            steps, results = {}, collections.defaultdict(list)
            for name in names:
                try:
                    steps[name] = CONTENDERS[name](op, n)
                except bench.NotAvailable as error:
                    print(f"  {name}: not available ({error})")
            for _ in range(args.rounds):  # interleaved rounds: load changes hit every contender alike
                for name, step in steps.items():
                    results[name].append(bench.time_step(step, args.min_time, max_reps=2000)["median_s"])
            ms = {name: 1e3 * statistics.median(v) for name, v in results.items()}
            ref = "graph" if "graph" in ms else next(iter(ms))
            print(f"\n{op} n={n:.0e}: ms per step (median of {args.rounds} rounds), ratio to {ref}"
                  + (", to torch_fused" if "torch_fused" in ms else ""))
            for name, value in ms.items():
                extra = f"  {value / ms['torch_fused']:6.2f}x torch fused" if "torch_fused" in ms else ""
                print(f"  {name:<14} {value:9.3f} ms  {value / ms[ref]:6.2f}x {ref}{extra}")
            del steps
        print()
    return 0


if __name__ == "__main__":
    sys.exit(main())
