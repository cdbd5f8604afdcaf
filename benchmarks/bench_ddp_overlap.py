"""Where a data-parallel step's time goes for a GPT-2-small model, and what overlapping the
gradient all-reduce with the backward pass could win on this machine (docs/distributed.md §2.2).

    torchrun --nproc-per-node 2 benchmarks/bench_ddp_overlap.py [--layers 12] [--steps 5] [--engine host]

Each rank opens the zoo's GPT-2 (``benchmarks.zoo``: 12 layers x 768, vocab
50257, 124M parameters; ``--layers``/``--hidden`` shrink it) as a causal LM with AdamW, on
its share of a global batch of 4 x 128 tokens, with ``cores / ranks`` onnxruntime threads,
wrapped in :class:`~onnx_training_ops.distributed.DistributedTrainingSession` (``--engine``:
``host`` fused kernels, ``cpu`` the in-graph update on host arrays, ``device`` the same on
onnxruntime-allocated OrtValues shared with torch by DLPack). Rank 0 prints one JSON object:

* ``split_ms``: medians over ``--steps`` steps (after a warm-up) of backward (one onnxruntime
  run), the all-reduce of the flat gradient buffer (gloo, 25 MiB buckets all in flight), and
  the optimizer step; ``cpu_ms``: the CPU time this process spent in each (all its threads:
  gloo's loopback copies are CPU work, which load on the machine does not inflate);
* ``overlap_ms``: the bound on any overlap, measured: a buffer of the gradients' size is
  all-reduced while the backward runs (every bucket issued before the run starts: more
  overlap than any bucketing of a real backward can give), against the two one after the
  other, in interleaved pairs. If the concurrent pair is not faster than the sequential one,
  overlapping cannot pay here: on one machine the all-reduce's loopback TCP copies run on
  the cores the backward uses.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: `benchmarks`


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--hidden", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--batch", type=int, default=4, help="the global batch (sequences), split over the ranks")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--engine", choices=("host", "cpu", "device"), default="host")
    args = parser.parse_args(argv)

    import numpy as np
    import onnxruntime as ort
    import torch
    import torch.distributed as dist

    from benchmarks import zoo
    from onnx_training_ops import AdamW, TrainingSession, build_training_model
    from onnx_training_ops.distributed import DistributedTrainingSession, destroy_process_group, init_process_group

    init_process_group()
    rank, world = dist.get_rank(), dist.get_world_size()
    rows = args.batch // world
    whole = zoo.spec("gpt2-124m", layers=args.layers, hidden=args.hidden, heads=args.heads, batch=args.batch,
                     seq=args.seq)
    spec = zoo.spec("gpt2-124m", layers=args.layers, hidden=args.hidden, heads=args.heads, batch=rows,
                    seq=args.seq)  # the export's shapes are a rank's
    if rank == 0:
        zoo.export(spec)  # once, before the others read the cache
    dist.barrier()
    model = build_training_model(zoo.export(spec), zoo.loss(spec), AdamW(lr=1e-4))
    options = ort.SessionOptions()
    options.intra_op_num_threads = max(1, (os.cpu_count() or 1) // world)
    if args.engine == "host":
        session = TrainingSession(model, sess_options=options)
    elif args.engine == "cpu":
        session = TrainingSession(model, sess_options=options, device="cpu")
    else:  # OrtValues onnxruntime allocates (a GPU's memory strategy, on the CPU): a private option
        from onnx_training_ops.training.engine import checked_config

        session = TrainingSession._opened(model, checked_config(
            ["CPUExecutionProvider"], None, "raise", options, None, None, "cpu", 0, None, None, None, "device"))
    del model
    ddp = DistributedTrainingSession(session)
    feeds = [{k: v[rank * rows:(rank + 1) * rows] for k, v in b.items()} for b in zoo.batches(whole, 4)]
    params = sum(int(np.prod(shape)) for _, _, _, shape in session.gradient_layout())

    parts: dict[str, list[float]] = {"backward": [], "all_reduce": [], "optimizer_step": []}
    cpu: dict[str, list[float]] = {key: [] for key in parts}  # this process's CPU time, every thread
    for k in range(args.steps + 1):
        clocks = [(time.perf_counter(), time.process_time())]
        ddp.backward(feeds[k % len(feeds)])
        clocks.append((time.perf_counter(), time.process_time()))
        ddp.all_reduce_gradients()
        clocks.append((time.perf_counter(), time.process_time()))
        ddp.session.optimizer_step()
        clocks.append((time.perf_counter(), time.process_time()))
        if k:  # the first step opens the programs
            for i, key in enumerate(parts):
                parts[key].append(clocks[i + 1][0] - clocks[i][0])
                cpu[key].append(clocks[i + 1][1] - clocks[i][1])

    # the overlap bound: a buffer of the gradients' size all-reduced during the backward
    dummy = torch.ones(params, dtype=torch.float32)
    buckets = ddp._buckets(dummy)
    pairs: dict[str, list[float]] = {"sequential": [], "concurrent": []}
    for k in range(args.steps):
        for mode in (("sequential", "concurrent") if k % 2 == 0 else ("concurrent", "sequential")):
            dist.barrier()
            t0 = time.perf_counter()
            if mode == "sequential":
                ddp.backward(feeds[k % len(feeds)])
                works = [dist.all_reduce(b, async_op=True) for b in buckets]
            else:
                works = [dist.all_reduce(b, async_op=True) for b in buckets]
                ddp.backward(feeds[k % len(feeds)])
            for work in works:
                work.wait()
            pairs[mode].append(time.perf_counter() - t0)
            ddp.session.zero_grad()

    def ms(values: list[float]) -> float:
        return round(statistics.median(values) * 1e3, 1)

    peak = max(ddp._gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6))  # GB (ru_maxrss in KB)
    result = {"model": f"GPT-2 {args.layers}x{args.hidden}, vocab {spec.vocab}", "params": params,
              "ranks": world, "engine": args.engine, "rows_per_rank": rows, "seq": args.seq,
              "threads_per_rank": options.intra_op_num_threads, "gradient_MB": round(params * 4 / 1e6, 1),
              "split_ms": {key: ms(values) for key, values in parts.items()},
              "cpu_ms": {key: ms(values) for key, values in cpu.items()},
              "overlap_ms": {key: ms(values) for key, values in pairs.items()},
              "peak_rss_GB_max_rank": round(peak, 2), "load_average": os.getloadavg()}
    destroy_process_group()
    if rank == 0:
        print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
