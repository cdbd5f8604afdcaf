"""The JavaScript trainer (onnxruntime-node) against Python's TrainingSession on the same step model.

    python benchmarks/bench_js_trainer.py [--models mlp,cnn,bert] [--threads 1,2] [--layouts plain,packed] [--rounds 5]

Each model (the test models of tests/js_fixtures.py) is exported once; both contenders run
the same step model of that export (``plain``: ``step.onnx``, one input and output per state
variable; ``packed``: ``step.packed.onnx``, one per dtype) with the same onnxruntime thread
count, each in its own process, cycling through the same 8 batches after a warm-up:

* ``js``: ``js/bench/step.js``: ``Trainer.step`` in onnxruntime-node (state kept as ORT tensors);
* ``python``: ``session_from_export(dir, fast=False)``, a TrainingSession running the step
  model (state zero-copy through IOBinding), ``step(feeds)``.

Each also times its binding's bare ``run`` of the step model on fixed feeds (onnxruntime-node's
``session.run``, Python's ``InferenceSession.run``): the columns "bare" tell the trainer's own
cost from the binding's.

Rounds interleave the contenders; the table gives each one's median time per step over the
rounds, the median of the per-round ratios js/python, and peak RSS. Not part of the tests.
Needs ``cd js && npm ci --ignore-scripts``.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO / "tests"))

PYTHON_CONTENDER = r"""
import json, resource, sys, time
import numpy as np
import onnxruntime as ort
from onnx_training_ops.storage import safetensors
from onnx_training_ops.export import session_from_export
from onnx_training_ops.export.importing import pack
directory, batch_file, threads, warmup, steps, layout, warmup_seconds = sys.argv[1:]
options = ort.SessionOptions()
options.intra_op_num_threads, options.inter_op_num_threads = int(threads), 1
packed = layout == "packed"
session = session_from_export(directory, packed=packed, fast=False, sess_options=options)
manifest = json.load(open(directory + "/manifest.json"))
rates = {e["name"]: np.array(e["base"], np.float32) for e in manifest["learning_rates"]}
stacked, _ = safetensors.read(batch_file)
cycle = next(iter(stacked.values())).shape[0]
batches = [{**{k: np.ascontiguousarray(v[i]) for k, v in stacked.items()}, **rates} for i in range(cycle)]
i, start = 0, time.perf_counter()
while i < int(warmup) or time.perf_counter() - start < float(warmup_seconds):
    session.step(batches[i % cycle]); i += 1
per = max(1, int(steps) // 5)
blocks = []
for _ in range(5):
    start = time.perf_counter_ns()
    for _ in range(per):
        session.step(batches[i % cycle]); i += 1
    blocks.append((time.perf_counter_ns() - start) / 1000 / per)
plain = ort.InferenceSession(directory + ("/step.packed.onnx" if packed else "/step.onnx"), options,
                             providers=["CPUExecutionProvider"])
state, _ = safetensors.read(directory + "/state.safetensors")
state = {k: v for k, v in state.items() if k in manifest["feedback"]}
feeds = {**batches[0], **(pack(state, manifest["packs"]) if packed else state)}
bare = []
for _ in range(5):
    start = time.perf_counter_ns()
    for _ in range(per):
        plain.run(None, feeds)
    bare.append((time.perf_counter_ns() - start) / 1000 / per)
print(json.dumps({"us_per_step": sorted(blocks)[2], "bare_us": sorted(bare)[2],
                  "rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}))
"""


def _run(command: list[str], cwd: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    out = subprocess.run(command, cwd=cwd, env=env, capture_output=True, text=True, check=True).stdout
    return json.loads(out.strip().splitlines()[-1])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--models", default="mlp,cnn,bert")
    parser.add_argument("--threads", default="1,2")
    parser.add_argument("--layouts", default="plain,packed")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--steps", type=int, default=1000, help="timed steps per contender and round")
    parser.add_argument("--warmup", type=int, default=200, help="at least this many warm-up steps...")
    parser.add_argument("--warmup-seconds", type=float, default=2.0,
                        help="...and at least this long (V8 needs a few thousand small steps to optimize)")
    args = parser.parse_args(argv)
    import js_fixtures

    out = Path(tempfile.mkdtemp(prefix="bench-js-"))
    rows = []
    for name in args.models.split(","):
        directory = js_fixtures.write_model(name, out, steps=1)
        steps = max(50, args.steps // (10 if name == "bert" else 1))
        for threads, layout in [(t, lay) for lay in args.layouts.split(",") for t in args.threads.split(",")]:
            times = {"js": [], "python": []}
            bare = {"js": [], "python": []}
            rss = {"js": 0.0, "python": 0.0}
            for _ in range(args.rounds):
                common = [str(directory / "export"), str(directory / "batches.safetensors"), threads,
                          str(args.warmup), str(steps), layout, str(args.warmup_seconds)]
                for contender, command, cwd in (
                        ("js", ["node", "bench/step.js", *common], REPO / "js"),
                        ("python", [sys.executable, "-c", PYTHON_CONTENDER, *common], REPO)):
                    result = _run(command, cwd)
                    times[contender].append(result["us_per_step"])
                    bare[contender].append(result["bare_us"])
                    rss[contender] = max(rss[contender], result["rss_mb"])
            ratios = [j / p for j, p in zip(times["js"], times["python"])]
            rows.append((name, layout, threads, statistics.median(times["js"]), statistics.median(times["python"]),
                         statistics.median(ratios), statistics.median(bare["js"]), statistics.median(bare["python"]),
                         rss["js"], rss["python"]))
    print(f"load average {os.getloadavg()[0]:.2f} {os.getloadavg()[1]:.2f} {os.getloadavg()[2]:.2f}")
    print("| model | step | threads | JS trainer, onnxruntime-node (us/step) "
          "| Python TrainingSession(fast=False) (us/step) "
          "| js/python (median of rounds) | bare run: node / Python (us) | peak RSS js / python (MB) |")
    print("| --- | --- | --- | --- | --- | --- | --- | --- |")
    for name, layout, threads, js, py, ratio, bare_js, bare_py, rss_js, rss_py in rows:
        print(f"| {name} | {layout} | {threads} | {js:.0f} | {py:.0f} | {ratio:.2f} | {bare_js:.0f} / {bare_py:.0f} "
              f"| {rss_js:.0f} / {rss_py:.0f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
