"""Optimizer benchmarks (``make bench``): the same as ``python -m onnx_training_ops bench``.

    python benchmarks/bench_optimizers.py [--sizes 1e4,1e5,1e6,1e7] [--ops adam,momentum,nesterov,adagrad]
                                          [--contenders graph,graph_native,portable,training_session,...]
                                          [--quick] [--ortt-python PATH]
                                          [--json benchmarks/results/bench.json] [--png benchmarks/results/bench.png]

The harness lives in :mod:`onnx_training_ops.bench` (see its docstring for what is
measured, and how to add a contender).
"""

import sys

from onnx_training_ops.bench import main

if __name__ == "__main__":
    sys.exit(main())
