"""Fixed costs: importing the package, and expanding a Gradient node (a 100-layer MLP).

    python -m benchmarks overhead [--rounds 7] [--layers 100] [--width 64] [--json PATH]

Each import is timed in a fresh interpreter (the cost a script pays once); the expansion
(:func:`onnx_training_ops.passes.expand_gradient.expand_gradient`) in this process, after one
warm-up. Prints the median and the best of ``--rounds`` with the machine's load average before
and after: on a shared 2-core machine a loaded round can take 3x an idle one, which is why
these numbers live here and not in ``make test``.
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
import onnx
from onnx import TensorProto, helper, numpy_helper

from .measure import loadavg

DOMAIN = "ai.onnx.preview.training"


def deep_mlp_gradient_model(layers: int = 100, width: int = 64, seed: int = 13) -> onnx.ModelProto:
    """``layers`` x (MatMul, Add, Relu) of ``width``, ReduceSum, and one Gradient node
    (named ``grad``) of the sum with respect to every weight and bias (outputs ``d_<name>``)."""
    rng = np.random.default_rng(seed)
    nodes, inits, xs, h = [], [], [], "x"
    for i in range(layers):
        inits += [numpy_helper.from_array(rng.normal(size=(width, width)).astype(np.float32) / 8, f"W{i}"),
                  numpy_helper.from_array(np.zeros(width, np.float32), f"b{i}")]
        nodes += [helper.make_node("MatMul", [h, f"W{i}"], [f"m{i}"]),
                  helper.make_node("Add", [f"m{i}", f"b{i}"], [f"a{i}"]),
                  helper.make_node("Relu", [f"a{i}"], [f"h{i}"])]
        h = f"h{i}"
        xs += [f"W{i}", f"b{i}"]
    nodes.append(helper.make_node("ReduceSum", [h], ["y"], keepdims=0))
    nodes.append(helper.make_node("Gradient", xs, [f"d_{x}" for x in xs], name="grad", domain=DOMAIN, xs=xs, y="y"))
    graph = helper.make_graph(nodes, "deep_mlp", [helper.make_tensor_value_info("x", TensorProto.FLOAT, ["N", width])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [])]
                              + [helper.make_tensor_value_info(f"d_{x}", TensorProto.FLOAT, None) for x in xs], inits)
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18), helper.make_opsetid(DOMAIN, 1)])


def expansion_seconds(model: onnx.ModelProto, rounds: int) -> list[float]:
    """Seconds of each of ``rounds`` expansions of ``model`` (after one warm-up)."""
    from onnx_training_ops.passes.expand_gradient import expand_gradient

    expand_gradient(model)
    times = []
    for _ in range(rounds):
        start = time.perf_counter()
        expand_gradient(model)
        times.append(time.perf_counter() - start)
    return times


def import_seconds(rounds: int) -> list[float]:
    """Seconds of ``import onnx_training_ops`` in each of ``rounds`` fresh interpreters."""
    code = "import time; s = time.perf_counter(); import onnx_training_ops; print(time.perf_counter() - s)"
    return [float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                 cwd=os.getcwd()).stdout.strip().splitlines()[-1]) for _ in range(rounds)]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks overhead", description=__doc__.split("\n\n")[0])
    ap.add_argument("--rounds", type=int, default=7, help="timed rounds of each (default %(default)s)")
    ap.add_argument("--layers", type=int, default=100, help="MLP depth for the expansion (default %(default)s)")
    ap.add_argument("--width", type=int, default=64, help="MLP width (default %(default)s)")
    ap.add_argument("--json", default="", help="also write the results here")
    args = ap.parse_args(argv)
    load_before = loadavg()
    results = {"import_s": import_seconds(args.rounds),
               f"expand_{args.layers}_layer_mlp_s": expansion_seconds(
                   deep_mlp_gradient_model(args.layers, args.width), args.rounds)}
    report = {"cpus": os.cpu_count(), "loadavg_before_after": [load_before, loadavg()], "results": results}
    for name, times in results.items():
        print(f"{name:28s} median {statistics.median(times):.3f} s  best {min(times):.3f} s  ({len(times)} rounds)")
    print(f"load average before {load_before}, after {report['loadavg_before_after'][1]}; {os.cpu_count()} cpus")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
    return 0
