"""Measure data-parallel training on this machine, and model it at scale (docs/distributed.md).

``torchrun --nproc-per-node P examples/bench_ddp.py`` prints (rank 0, one JSON line):
gloo all-reduce time and bandwidth for a few buffer sizes, and steps/s of two MLPs with
their time split into backward / gradient reduction / optimizer step / parameter all-gather,
unsharded and with the optimizer state sharded (ZeRO-1), and the optimizer state each rank
holds. The global batch is fixed, so more ranks means a smaller shard each (strong scaling).

``python examples/bench_ddp.py --table`` prints the modelled step time for 8-256 ranks on
10/25/100 Gb/s (ring all-reduce: ``2 (p-1)/p * bytes / bandwidth + 2 (p-1) * latency``).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np

SIZES = {"bytes": [2**12, 2**20, 2**24, 2**26]}
MLPS = {"mlp-small": ((64, 128, 10), 64), "mlp-2M": ((784, 1024, 1024, 10), 256)}  # sizes, global batch


def _timed(fn, repeats: int) -> float:
    for _ in range(5):
        fn()
    start = time.perf_counter()
    for _ in range(repeats):
        fn()
    return (time.perf_counter() - start) / repeats


def measure() -> dict:
    import onnxruntime as ort
    import torch
    import torch.distributed as dist

    from onnx_training_ops import Adam, TrainingSession, build_training_model
    from onnx_training_ops.demo import make_mlp
    from onnx_training_ops.distributed import DistributedTrainingSession, destroy_process_group, init_process_group
    from onnx_training_ops.training.state.shard import optimizer_state

    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    result: dict = {"ranks": world, "all_reduce": [], "models": []}
    for nbytes in SIZES["bytes"]:
        tensor = torch.from_numpy(np.ones(nbytes // 4, np.float32))
        seconds = _timed(lambda t=tensor: dist.all_reduce(t), 50 if nbytes < 2**24 else 5)
        bus = 2 * (world - 1) / world * nbytes / seconds if world > 1 else float("nan")
        result["all_reduce"].append({"bytes": nbytes, "ms": seconds * 1e3, "bus_GBps": bus / 1e9})
    for (name, (sizes, batch)), shard in ((m, z) for m in MLPS.items() for z in (False, True)):
        model = build_training_model(make_mlp(sizes, seed=0), "cross_entropy", Adam())
        per_param = optimizer_state(model)
        options = ort.SessionOptions()
        options.intra_op_num_threads = max(1, (os.cpu_count() or 1) // world)  # no oversubscription
        ddp = DistributedTrainingSession(TrainingSession(model, sess_options=options), shard_optimizer_state=shard)
        rows = batch // world
        rng = np.random.default_rng(rank)
        feeds = {"input": rng.standard_normal((rows, sizes[0])).astype(np.float32),
                 "labels": rng.integers(0, sizes[-1], rows).astype(np.int64)}
        steps = 200 if sizes[0] < 100 else 30
        parts = {"backward": 0.0, "reduce": 0.0, "apply": 0.0, "all_gather": 0.0}
        for k in range(steps + 5):
            t0 = time.perf_counter()
            ddp.backward(feeds)
            t1 = time.perf_counter()
            ddp.all_reduce_gradients()
            t2 = time.perf_counter()
            ddp.session.optimizer_step()
            t3 = time.perf_counter()
            if shard:
                ddp._all_gather_parameters()
            t4 = time.perf_counter()
            if k >= 5:
                for key, dt in zip(parts, (t1 - t0, t2 - t1, t3 - t2, t4 - t3)):
                    parts[key] += dt / steps
        params = sum(b.size for b in ddp.session.gradient_buffers())
        state = ddp.session.state_dict()
        held = sum(state[s].nbytes for states in per_param.values() for s in states if s in state)
        held_max = max(ddp._gather(held))
        result["models"].append({"model": name, "zero1": shard, "params": int(params), "global_batch": batch,
                                 "steps_per_s": 1 / sum(parts.values()), "optimizer_state_MB_max_rank": held_max / 1e6,
                                 **{f"{k}_ms": v * 1e3 for k, v in parts.items()}})
    destroy_process_group()
    return result if rank == 0 else {}


# ------------------------------------------------------------------ the model at scale

LATENCY_S = 20e-6  # per ring hop (TCP over Ethernet, order of magnitude)
BUCKET = 25 * 2**20
# compute per optimizer step and rank (forward + backward, per-rank batch 32): FLOPs / a node
# sustaining 1 TFLOP/s; the MLP's is measured on this machine (batch 64, 1 rank)
WORKLOADS = {
    "MLP 64-128-10 (9.6k)": (9_610, None),
    "ResNet-50-sized (25M)": (25_600_000, 32 * 3 * 4.1e9 / 1e12),
    "BERT-base-sized (110M)": (110_000_000, 32 * 3 * 2 * 110e6 * 128 / 1e12),
}


def ring_seconds(nbytes: float, ranks: int, gbps: float) -> float:
    """Ring all-reduce: 2(p-1)/p of the buffer through each link, 2(p-1) latency hops per bucket."""
    buckets = max(1, int(np.ceil(nbytes / BUCKET)))
    return 2 * (ranks - 1) / ranks * nbytes / (gbps * 1e9 / 8) + buckets * 2 * (ranks - 1) * LATENCY_S


def table(mlp_compute_s: float) -> str:
    lines = ["| model | compute/step | ranks | 10 Gb/s | 25 Gb/s | 100 Gb/s |", "|---|---|---|---|---|---|"]
    for name, (params, compute) in WORKLOADS.items():
        compute = mlp_compute_s if compute is None else compute
        for ranks in (8, 32, 256):
            cells = []
            for gbps in (10, 25, 100):
                comm = ring_seconds(4 * params, ranks, gbps)
                overlap = max(compute, comm) + ring_seconds(min(4 * params, BUCKET), ranks, gbps)
                cells.append(f"{comm * 1e3:.3g} ms comm; eff {compute / (compute + comm):.0%} / "
                             f"{compute / overlap:.0%}")
            lines.append(f"| {name} | {compute * 1e3:.3g} ms | {ranks} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--table", action="store_true", help="print the modelled table")
    parser.add_argument("--mlp-compute-ms", type=float, default=0.25)
    args = parser.parse_args()
    if args.table:
        print(table(args.mlp_compute_ms / 1e3))
        return 0
    try:
        result = measure()
    except ImportError as error:
        print(error, file=sys.stderr)
        return 2
    if result:
        print(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
