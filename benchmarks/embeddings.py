"""Embedding-table training steps: dense Adam vs lazy Adam (this package) vs torch.

    python -m benchmarks embeddings [--rows 1000000] [--dim 64] [--lookups 4096]
                                                 [--duplicates 0.25] [--steps 30] [--dense-steps 6]
                                                 [--threads 1]

One step of ``y = E[ids] @ w`` with an MSE loss, only the table E (rows x dim float32)
trained, ``lookups`` ids per step of which a ``duplicates`` fraction repeat an id of the
same batch. Contenders, each timed over the same batches in one run (median step), in
steady state: after two warm-up steps every table and optimizer state is rewritten once, so
its pages are resident (the first touch of a fresh table's page costs a page fault, which
a long training run pays once):

* ``onnx dense Adam``: ``build_training_model(..., Adam())``, TrainingSession (fast path):
  the Gather gradient is a table-sized ScatterND, the fused Adam rewrites every row;
* ``onnx lazy Adam``: ``sparse_updates={"E": "lazy"}``: unique rows + summed gradients,
  in-place update of the touched rows of E, V, H;
* ``torch SparseAdam``: ``nn.Embedding(sparse=True)`` + ``torch.optim.SparseAdam``;
* ``torch dense Adam``: ``nn.Embedding`` + ``torch.optim.Adam`` (default foreach).
"""

from __future__ import annotations

import argparse
import statistics
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper


def embedding_model(rows: int, dim: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    table = (rng.standard_normal((rows, dim), dtype=np.float32) * 0.1)
    w = rng.standard_normal((dim, 1), dtype=np.float32)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["e"], axis=0),
         helper.make_node("MatMul", ["e", "w"], ["y"])],
        "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["N", 1])],
        [numpy_helper.from_array(table, "E"), numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def batches(rows: int, lookups: int, duplicates: float, count: int, seed: int = 1):
    """``count`` (ids, target): ``lookups`` ids, a ``duplicates`` share repeating earlier ones."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(count):
        distinct = lookups - int(lookups * duplicates)
        ids = rng.choice(rows, distinct, replace=False)
        ids = np.concatenate([ids, rng.choice(ids, lookups - distinct)])
        rng.shuffle(ids)
        out.append((ids.astype(np.int64), rng.standard_normal((lookups, 1)).astype(np.float32)))
    return out


def _time(step, data, warmup: int = 2) -> float:
    for ids, target in data[:warmup]:
        step(ids, target)
    step.resident()
    times = []
    for ids, target in data[warmup:]:
        start = time.perf_counter()
        step(ids, target)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def onnx_contender(model, mode: str, threads: int):
    import onnxruntime as ort

    from onnx_training_ops.builder import Adam, build_training_model
    from onnx_training_ops.training import TrainingSession

    training = build_training_model(model, "mse", Adam(lr=1e-3), trainable=["E"],
                                    sparse_updates={"E": mode})
    options = ort.SessionOptions()
    options.intra_op_num_threads = threads
    session = TrainingSession(training, sess_options=options)

    def step(ids, target):
        session.step({"ids": ids, "target": target})

    step.resident = lambda: session.load_state_dict(session.state_dict())
    return step


def torch_contender(model, sparse: bool, threads: int):
    import torch

    if threads:
        torch.set_num_threads(threads)
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    emb = torch.nn.Embedding.from_pretrained(torch.from_numpy(init["E"].copy()), freeze=False,
                                             sparse=sparse)
    w = torch.from_numpy(init["w"].copy())
    opt = (torch.optim.SparseAdam if sparse else torch.optim.Adam)(emb.parameters(), lr=1e-3)

    def step(ids, target):
        opt.zero_grad()
        torch.nn.functional.mse_loss(emb(torch.from_numpy(ids)) @ w, torch.from_numpy(target)).backward()
        opt.step()

    def resident():
        with torch.no_grad():
            for tensor in [emb.weight, *(t for s in opt.state.values() for t in s.values()
                                         if torch.is_tensor(t) and t.dim())]:
                tensor.copy_(tensor.clone())

    step.resident = resident
    return step


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks embeddings",
                                     description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--dim", type=int, default=64)
    parser.add_argument("--lookups", type=int, default=4096)
    parser.add_argument("--duplicates", type=float, default=0.25)
    parser.add_argument("--steps", type=int, default=30, help="timed steps of the sparse contenders")
    parser.add_argument("--dense-steps", type=int, default=6, help="timed steps of the dense contenders")
    parser.add_argument("--threads", type=int, default=1,
                        help="intra-op threads of onnxruntime and torch (default 1: steady numbers "
                             "on a shared machine; 0 = their defaults)")
    args = parser.parse_args(argv)
    model = embedding_model(args.rows, args.dim)
    data = batches(args.rows, args.lookups, args.duplicates, args.steps + 2)
    contenders = [
        ("onnx lazy Adam", lambda: onnx_contender(model, "lazy", args.threads), data),
        ("onnx dense Adam", lambda: onnx_contender(model, "dense", args.threads), data[:args.dense_steps + 2]),
    ]
    try:
        import torch  # noqa: F401
        contenders += [
            ("torch SparseAdam", lambda: torch_contender(model, True, args.threads), data),
            ("torch dense Adam", lambda: torch_contender(model, False, args.threads), data[:args.dense_steps + 2]),
        ]
    except ImportError:
        print("torch not installed: torch contenders skipped", file=sys.stderr)
    print(f"table {args.rows:,} x {args.dim} float32, {args.lookups:,} lookups/step "
          f"({args.duplicates:.0%} duplicates), median step, "
          f"{args.threads or 'default'} intra-op thread(s)")
    results = {}
    for name, make, subset in contenders:
        step = make()
        results[name] = _time(step, subset)
        del step
    lazy = results["onnx lazy Adam"]
    print(f"{'contender':<20}{'ms/step':>10}{'vs lazy':>10}")
    for name, seconds in results.items():
        print(f"{name:<20}{seconds * 1e3:>10.2f}{seconds / lazy:>9.1f}x")
    dense = results["onnx dense Adam"]
    print(f"lazy vs dense (onnx): {dense / lazy:.1f}x faster (target >= 20x)")
    if "torch SparseAdam" in results:
        print(f"lazy / torch SparseAdam: {lazy / results['torch SparseAdam']:.2f} (target <= 1.5)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
