"""Steps per second of one training step: TrainingSession fast path, full graph (plugin), torch eager.

MLP 64-128-10 (ReLU), batch 64, cross-entropy, Adam — the same model and data in each.
Run: ``python examples/benchmark_step.py [--steps N] [--threads T]``. Prints one line per
contender and the ratios; the contenders run interleaved in rounds so machine load hits
them alike.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import onnxruntime as ort


def _ours(fast: bool, threads: int | None):
    from onnx_training_ops import Adam, TrainingSession, build_training_model
    from onnx_training_ops.demo import make_mlp

    so = None
    if threads:
        so = ort.SessionOptions()
        so.intra_op_num_threads = threads
    session = TrainingSession(build_training_model(make_mlp((64, 128, 10)), "cross_entropy", Adam(lr=1e-3)),
                              fast=fast, sess_options=so)
    rng = np.random.default_rng(0)
    feeds = {"input": rng.standard_normal((64, 64)).astype(np.float32),
             "labels": rng.integers(0, 10, 64).astype(np.int64)}
    step = session.step

    def run(n):
        for _ in range(n):
            step(feeds)

    return run


def _torch(threads: int | None):
    import torch

    if threads:
        torch.set_num_threads(threads)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 128), torch.nn.ReLU(), torch.nn.Linear(128, 10))
    opt = torch.optim.Adam(net.parameters(), lr=1e-3)
    x, y = torch.randn(64, 64), torch.randint(0, 10, (64,))
    loss_fn = torch.nn.CrossEntropyLoss()

    def run(n):
        for _ in range(n):
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()

    return run


def measure(steps: int = 1000, rounds: int = 5, threads: int | None = None) -> dict[str, float]:
    contenders = {
        "fast path (in-place fused optimizer)": _ours(True, threads),
        "full graph (optimizer via PyOp plugin)": _ours(False, threads),
        "torch eager (torch.optim.Adam)": _torch(threads),
    }
    for run in contenders.values():
        run(50)  # warm up
    best = {name: 0.0 for name in contenders}
    for _ in range(rounds):
        for name, run in contenders.items():
            start = time.perf_counter()
            run(steps)
            best[name] = max(best[name], steps / (time.perf_counter() - start))
    return best


def main(argv=None) -> dict[str, float]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--threads", type=int, default=None, help="intra-op threads (default: runtime's)")
    args = parser.parse_args(argv)
    results = measure(args.steps, args.rounds, args.threads)
    torch_rate = results["torch eager (torch.optim.Adam)"]
    for name, rate in results.items():
        print(f"{name:42s} {rate:8.0f} steps/s   {rate / torch_rate:5.2f}x torch")
    return results


if __name__ == "__main__":
    main()
