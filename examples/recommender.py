"""A matrix-factorization recommender trained with dense vs lazy (sparse-row) Adam.

Data: an implicit-feedback matrix synthesized with a fixed seed — users and items get
hidden taste vectors, and each user "clicks" the items that score highest for them plus a
little noise. One click per user is held out for evaluation.

Model (``onnx.helper``): ``logit = sum(P[user] * Q[item])``, two embedding tables read by
``Gather``; loss ``bce_with_logits`` against 1 for clicks and 0 for sampled negatives.
``build_training_model(..., sparse_updates={"P": "lazy", "Q": "lazy"})`` keeps the tables'
gradients as (unique rows, summed rows) and updates only the rows a batch touched (torch
``SparseAdam`` semantics); the dense build rewrites every row of both tables each step.
Printed: recall@k of the held-out clicks and the time per step, for both.

Run: ``python examples/recommender.py [--users 20000] [--items 5000] [--dim 32] [--epochs 2]``.
"""

from __future__ import annotations

import argparse
import sys
import time

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

from onnx_training_ops import Adam, TrainingSession, build_training_model


def synthesize(users: int, items: int, clicks: int, seed: int = 0):
    """(train pairs [n, 2], held-out item per user): each user's top-``clicks`` items under
    hidden factors with noise; one of them held out."""
    rng = np.random.default_rng(seed)
    taste_u, taste_i = rng.standard_normal((users, 8)), rng.standard_normal((items, 8))
    popularity = rng.standard_normal(items)
    liked = np.empty((users, clicks), np.int64)
    for a in range(0, users, 1000):  # 1,000 users at a time: no users x items matrix
        scores = taste_u[a:a + 1000] @ taste_i.T + popularity + rng.gumbel(size=(len(taste_u[a:a + 1000]), items))
        liked[a:a + 1000] = np.argpartition(-scores, clicks, axis=1)[:, :clicks]
    held_out = liked[np.arange(users), rng.integers(0, clicks, users)]
    pairs = np.array([(u, i) for u in range(users) for i in liked[u] if i != held_out[u]], np.int64)
    return pairs, held_out


def factorization_model(users: int, items: int, dim: int, seed: int = 0) -> onnx.ModelProto:
    rng = np.random.default_rng(seed)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["P", "user"], ["p"], axis=0),
         helper.make_node("Gather", ["Q", "item"], ["q"], axis=0),
         helper.make_node("Mul", ["p", "q"], ["pq"]),
         helper.make_node("ReduceSum", ["pq", "axis"], ["logit"], keepdims=0)],
        "factorization",
        [helper.make_tensor_value_info("user", TensorProto.INT64, ["N"]),
         helper.make_tensor_value_info("item", TensorProto.INT64, ["N"])],
        [helper.make_tensor_value_info("logit", TensorProto.FLOAT, ["N"])],
        [numpy_helper.from_array((0.1 * rng.standard_normal((users, dim))).astype(np.float32), "P"),
         numpy_helper.from_array((0.1 * rng.standard_normal((items, dim))).astype(np.float32), "Q"),
         numpy_helper.from_array(np.array([1], np.int64), "axis")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def recall_at_k(P: np.ndarray, Q: np.ndarray, pairs: np.ndarray, held_out: np.ndarray, k: int) -> float:
    """Share of users whose held-out item ranks in their top k (training clicks excluded)."""
    hits = 0
    seen = pairs[np.argsort(pairs[:, 0], kind="stable")]
    bounds = np.searchsorted(seen[:, 0], np.arange(len(P) + 1))
    for a in range(0, len(P), 1000):
        scores = P[a:a + 1000] @ Q.T
        rows = seen[bounds[a]:bounds[min(a + 1000, len(P))]]
        scores[rows[:, 0] - a, rows[:, 1]] = -np.inf
        top = np.argpartition(-scores, k, axis=1)[:, :k]
        hits += int((top == held_out[a:a + 1000, None]).any(axis=1).sum())
    return hits / len(P)


def train(model, mode: str, pairs, items: int, epochs: int, batch: int, seed: int = 1):
    """(session, seconds per step) after ``epochs`` passes; one sampled negative per click."""
    from tqdm import tqdm

    training = build_training_model(model, "bce_with_logits", Adam(lr=0.01),
                                    sparse_updates={"P": mode, "Q": mode})
    session = TrainingSession(training)
    rng = np.random.default_rng(seed)
    steps, seconds = 0, 0.0
    for epoch in range(epochs):
        order = rng.permutation(len(pairs))
        bar = tqdm(range(0, len(order), batch), desc=f"{mode} epoch {epoch + 1}", unit="step",
                   disable=not sys.stderr.isatty(), leave=False)
        for start in bar:
            pos = pairs[order[start:start + batch]]
            neg_items = rng.integers(0, items, len(pos))
            feeds = {"user": np.concatenate([pos[:, 0], pos[:, 0]]),
                     "item": np.concatenate([pos[:, 1], neg_items]),
                     "target": np.concatenate([np.ones(len(pos)), np.zeros(len(pos))]).astype(np.float32)}
            begin = time.perf_counter()
            loss = session.step(feeds)["loss"]
            seconds += time.perf_counter() - begin
            steps += 1
            bar.set_postfix(loss=f"{float(loss):.3f}")
        print(f"  {mode:<5} epoch {epoch + 1}: loss {float(loss):.4f}")
    return session, seconds / steps


def main(users: int = 20000, items: int = 5000, dim: int = 32, epochs: int = 2, batch: int = 256,
         k: int = 20) -> dict:
    pairs, held_out = synthesize(users, items, clicks=12)
    model = factorization_model(users, items, dim)
    init = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    result = {"untrained": recall_at_k(init["P"], init["Q"], pairs, held_out, k)}
    print(f"{users} users, {items} items, {len(pairs)} training clicks; recall@{k} untrained: "
          f"{result['untrained']:.3f}")
    for mode in ("dense", "lazy"):
        session, per_step = train(model, mode, pairs, items, epochs, batch)
        state = session.state_dict()
        result[mode] = recall_at_k(state["P"], state["Q"], pairs, held_out, k)
        result[f"{mode}_ms_per_step"] = 1e3 * per_step
        print(f"{mode:<5}: recall@{k} {result[mode]:.3f}, {1e3 * per_step:.2f} ms/step")
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--users", type=int, default=20000)
    parser.add_argument("--items", type=int, default=5000)
    parser.add_argument("--dim", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--k", type=int, default=20)
    args = parser.parse_args()
    main(args.users, args.items, args.dim, args.epochs, k=args.k)
