"""Child process of test_fault_threads: each case trains one session per thread, at once,
then again one after another, and prints one line per case: its name and ``same`` when
every threaded run ended in the state of its sequential twin. A crash kills this process
(numba's workqueue aborts), so the parent runs it apart."""

from __future__ import annotations

import sys
import threading

import numpy as np
from onnx import TensorProto, helper, numpy_helper

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp

THREADS, STEPS = 4, 12


def _embedding_model(seed: int):
    rng = np.random.default_rng(seed)
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"], axis=0),
             helper.make_node("ReduceSum", ["e", "axis1"], ["y"], keepdims=0)]
    graph = helper.make_graph(
        nodes, "emb", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", 8])],
        [numpy_helper.from_array(rng.standard_normal((4096, 8)).astype(np.float32), "E"),
         numpy_helper.from_array(np.array([1], np.int64), "axis1")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _case(name: str, seed: int):
    """(session, batch) for one thread of case ``name``."""
    rng = np.random.default_rng(seed)
    if name == "embedding-lazy":
        model = ot.build_training_model(_embedding_model(seed), "mse", ot.Adam(lr=1e-2),
                                        trainable=["E"], sparse_updates={"E": "lazy"})
        batch = {"ids": rng.integers(0, 4096, (16, 3)), "target": rng.standard_normal((16, 8)).astype(np.float32)}
        return ot.TrainingSession(model), batch
    optimizer = {"adam": ot.Adam(lr=1e-3), "momentum": ot.Momentum(lr=1e-2, momentum=0.9),
                 "adagrad": ot.Adagrad(lr=1e-2), "rmsprop": ot.RMSProp(lr=1e-3)}[name.split("-")[1]]
    # 64 x 512 = 32k weights: above every parallel threshold, so steps launch numba's pool
    model = ot.build_training_model(make_mlp((64, 512, 10), seed=seed), "cross_entropy", optimizer)
    batch = {"input": rng.standard_normal((16, 64)).astype(np.float32),
             "labels": rng.integers(0, 10, 16).astype(np.int64)}
    return ot.TrainingSession(model, fast=not name.endswith("-graph")), batch


def _train(name: str, seed: int, out: dict) -> None:
    session, batch = _case(name, seed)
    for _ in range(STEPS):
        session.step(batch)
    out[seed] = session.state_dict()


def run(name: str) -> bool:
    threaded: dict = {}
    threads = [threading.Thread(target=_train, args=(name, seed, threaded)) for seed in range(THREADS)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    same = len(threaded) == THREADS
    for seed in range(THREADS):
        alone: dict = {}
        _train(name, seed, alone)
        same = same and all(np.array_equal(v, threaded[seed][k]) for k, v in alone[seed].items())
    return same


if __name__ == "__main__":
    for case in sys.argv[1:]:
        print(case, "same" if run(case) else "differs", flush=True)
