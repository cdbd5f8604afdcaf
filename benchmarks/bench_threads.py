"""Intra-op threads by measurement: our fast-path step with 1 and with 2 onnxruntime threads.

Each (model, threads) pair runs in its own process (the real-model benchmark's worker,
``python -m benchmarks.models --worker ours_fast``); rounds are interleaved and
the table gives the median ms/step and the median per-round ratio 1 thread / 2 threads.
The default of :class:`onnx_training_ops.TrainingSession` (``training.options.options``) follows this
table; see README, "Performance".

Run: ``python benchmarks/bench_threads.py [--models mlp,mlp_large,bert,resnet18] [--rounds 7]``
(under ``flock /tmp/heavy.lock`` on a shared machine).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: `benchmarks`

from benchmarks.measure import loadavg
from benchmarks.rounds import interleaved, median_ratio


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="mlp,mlp_large,bert,resnet18")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--round-seconds", type=float, default=2.0)
    ap.add_argument("--threads", default="1,2")
    args = ap.parse_args(argv)
    threads = [int(t) for t in args.threads.split(",")]
    print(f"load average before: {loadavg()}")
    print("| model | " + " | ".join(f"{t} thread(s), ms/step" for t in threads) + f" | {threads[0]} / {threads[-1]} |")
    print("|---|" + "---|" * (len(threads) + 1))
    for model in args.models.split(","):
        commands = {t: [sys.executable, "-m", "benchmarks.models", "--worker", "ours_fast", "--model",
                        model, "--threads", str(t), "--warmup-seconds", "1"] for t in threads}
        out = interleaved(commands, lambda name, ready: max(1, round(args.round_seconds / ready["step_s"])),
                          args.rounds)
        cells = [f"{statistics.median(out[t].seconds_per_step) * 1e3:.3f}" if out[t].na is None else "n/a"
                 for t in threads]
        ratio = median_ratio(out[threads[0]], out[threads[-1]])
        print(f"| {model} | " + " | ".join(cells) + f" | {'n/a' if ratio is None else f'{ratio:.2f}'} |", flush=True)
    print(f"load average after: {loadavg()}")
    return 0


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
