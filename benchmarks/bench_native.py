"""Native kernels vs the PyOp bridge vs the TrainingSession fast path vs torch fused Adam.

    python benchmarks/bench_native.py [--sizes 1e5,1e6,1e7] [--rounds 5] [--min-time 0.3]

Table 1: one float32 Adam step (T=10) at each size, median of per-round medians over
interleaved rounds (each contender in its own process), and the median per-round ratio to
``torch.optim.Adam(fused=True)`` (the faster of its 2-thread and 1-thread runs that round):

* ``native``: the one-node model prepared with ``kernels="native"``, run with IOBinding
  (inputs zero-copy, outputs bound to preallocated buffers, two bindings swapping X/V/H
  sets: the layout of ``bench.graph_session``), 2 intra-op threads (the kernel splits the
  tensor over onnxruntime's pool), no spinning;
* ``native in-place``: the same, but each of X/V/H bound as both input and output (one
  OrtValue): the documented way to update state in place (bench's ``graph_native`` contender);
* ``pyop``: the same model and binding with ``kernels="pyop"`` (bench's GRAPH_OPTIONS);
* ``fast path``: ``TrainingSession`` fast path (bench's ``training_session`` contender);
* ``torch fused``: bench's ``torch_fused`` contender; ``torch fused t1``: the same with
  ``torch.set_num_threads(1)``.

Table 2: per-call cost of a 16-element Adam node (native) vs an onnxruntime ``Add`` node of
16 elements, each the only node of a plain ``onnxruntime.InferenceSession`` run with
IOBinding (preallocated outputs), same options; median over batches of calls.

Also prints the first-session latency of the native path in a fresh process (import,
numba cache load, probe, session creation, first run).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: `benchmarks`

import benchmarks as bench
from onnx_training_ops.runtime import native

CONTENDERS = {
    "native": lambda n: bench.graph_session("adam", n, bench.NATIVE_OPTIONS, kernels="native")[1],
    "native in-place": lambda n: bench.graph_native("adam", n),
    "pyop": lambda n: bench.graph_session("adam", n, kernels="pyop")[1],
    "fast path": lambda n: bench.training_session("adam", n),
    "torch fused": lambda n: bench.torch_fused("adam", n),
    "torch fused t1": lambda n: _torch_one_thread(n),
}
BASELINES = ("torch fused", "torch fused t1")


def _torch_one_thread(n: int):
    """torch fused Adam on one thread: on a loaded 2-core machine its 2-thread OpenMP
    barrier waits for a scheduler slice (8-16 ms per step whatever the size)."""
    import torch

    torch.set_num_threads(1)
    return bench.torch_fused("adam", n)


def worker(name: str, sizes, min_time: float) -> None:
    """Time one contender at each size in this process; print ``{n: median_s}`` as JSON."""
    result = {}
    for n in sizes:
        step = CONTENDERS[name](n)
        result[n] = bench.time_step(step, min_time, max_reps=2000)["median_s"]
        del step
    print(json.dumps(result))


def step_table(sizes, rounds: int, min_time: float) -> list[dict]:
    """Each contender in its own process (no thread pool of one contender spinning while
    another runs), the contenders interleaved round by round."""
    per_round = {name: {n: [] for n in sizes} for name in CONTENDERS}
    for _ in range(rounds):
        for name in CONTENDERS:
            out = subprocess.run([sys.executable, __file__, "--worker", name, "--sizes", ",".join(map(str, sizes)),
                                  "--min-time", str(min_time)], capture_output=True, text=True, check=True)
            for n, seconds in json.loads(out.stdout.strip().splitlines()[-1]).items():
                per_round[name][int(n)].append(seconds)
    rows = []
    for n in sizes:
        torch_times = [min(pair) for pair in zip(*(per_round[b][n] for b in BASELINES))]
        rows.append({
            "n": n,
            "median": {name: statistics.median(v[n]) for name, v in per_round.items()},
            "ratio": {name: statistics.median(a / b for a, b in zip(v[n], torch_times))
                      for name, v in per_round.items()},
        })
    return rows


def _single_node_session(kind: str, threads: int):
    import onnxruntime as ort
    from onnx import TensorProto, helper

    import onnx_training_ops as ot
    from onnx_training_ops.schema import DOMAIN

    f32 = lambda k, s=(16,): helper.make_tensor_value_info(k, TensorProto.FLOAT, s)  # noqa: E731
    if kind == "add":
        node = helper.make_node("Add", ["A", "B"], ["C"])
        inputs, outputs = [f32("A"), f32("B")], [f32("C")]
        feeds = {"A": np.ones(16, np.float32), "B": np.ones(16, np.float32)}
        opsets = [helper.make_opsetid("", 17)]
    else:
        names = ["R", "T", "X", "G", "V", "H"]
        node = helper.make_node("Adam", names, ["X_new", "V_new", "H_new"], domain=DOMAIN)
        inputs = [f32("R", ()), helper.make_tensor_value_info("T", TensorProto.INT64, ())] + [f32(k) for k in "XGVH"]
        outputs = [f32(k) for k in ("X_new", "V_new", "H_new")]
        feeds = {"R": np.array(1e-3, np.float32), "T": np.array(10, np.int64),
                 **{k: np.ones(16, np.float32) for k in "XGVH"}}
        opsets = [helper.make_opsetid("", 17), helper.make_opsetid(DOMAIN, 1)]
    model = helper.make_model(helper.make_graph([node], "g", inputs, outputs), opset_imports=opsets)
    model = ot.prepare(model, kernels="native")
    so = ot.session_options(ort.SessionOptions())
    so.intra_op_num_threads = threads
    so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    binding = sess.io_binding()
    for k, v in feeds.items():
        binding.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
    for o in outputs:
        binding.bind_ortvalue_output(o.name, ort.OrtValue.ortvalue_from_numpy(np.zeros(16, np.float32)))
    return sess, binding


def per_call_table(threads_options=(1, 2), batches: int = 30, calls: int = 2000) -> list[dict]:
    rows = []
    for threads in threads_options:
        runs = {kind: _single_node_session(kind, threads) for kind in ("add", "adam")}
        times = {kind: [] for kind in runs}
        for _ in range(batches):  # interleaved batches
            for kind, (sess, binding) in runs.items():
                run = sess.run_with_iobinding
                t0 = time.perf_counter()
                for _ in range(calls):
                    run(binding)
                times[kind].append((time.perf_counter() - t0) / calls)
        add, adam = statistics.median(times["add"]), statistics.median(times["adam"])
        rows.append({"threads": threads, "add_s": add, "adam_s": adam, "ratio": adam / add})
    return rows


FIRST_SESSION = """
import time; t0 = time.perf_counter()
import numpy as np, onnx_training_ops as ot
import benchmarks as bench
t1 = time.perf_counter()
s = ot.InferenceSession(bench.step_model("adam", 16), kernels="native")
s.run(None, {"R": np.array(1e-3, np.float32), "T": np.array(1, np.int64), **bench.make_state("adam", 16)})
t2 = time.perf_counter()
print(f"{t1 - t0:.3f} {t2 - t1:.3f}")
"""


def first_session() -> tuple[float, float]:
    out = subprocess.run([sys.executable, "-c", FIRST_SESSION], capture_output=True, text=True, check=True)
    import_s, session_s = map(float, out.stdout.split()[-2:])
    return import_s, session_s


def _ms(s: float) -> str:
    return f"{s * 1e3:9.3f}"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="1e5,1e6,1e7")
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--min-time", type=float, default=0.3)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    sizes = [int(float(s)) for s in args.sizes.split(",")]
    if args.worker:
        worker(args.worker, sizes, args.min_time)
        return 0
    ok, reason = native.availability()
    if not ok:
        print(f"native kernels unavailable: {reason}")
        return 1
    import_s, session_s = first_session()
    print(f"first session in a fresh process: import {import_s:.2f} s, then prepare + session + first run "
          f"{session_s:.2f} s")
    print()
    rows = step_table(sizes, args.rounds, args.min_time)
    names = list(CONTENDERS)
    print("float32 Adam, one step: ms (median per-round ratio to the faster torch fused, 2 threads or 1)")
    print(f"{'params':>8} " + " ".join(f"{n:>20}" for n in names))
    for row in rows:
        cells = [f"{_ms(row['median'][n])} ({row['ratio'][n]:5.2f}x)" for n in names]
        print(f"{row['n']:>8.0e} " + " ".join(f"{c:>20}" for c in cells))
    print()
    print("16-element node, per call (plain onnxruntime session, IOBinding): us")
    print(f"{'threads':>8} {'Add':>10} {'Adam':>10} {'Adam/Add':>9}")
    for row in per_call_table():
        print(f"{row['threads']:>8} {row['add_s'] * 1e6:10.2f} {row['adam_s'] * 1e6:10.2f} {row['ratio']:9.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
