"""Embedding-table benchmark: the same as ``python -m onnx_training_ops bench embeddings``.

    python benchmarks/bench_embeddings.py [--rows 1000000] [--dim 64] [--lookups 4096]
                                          [--duplicates 0.25] [--steps 30] [--dense-steps 6] [--threads 1]

The harness lives in :mod:`onnx_training_ops.bench.embeddings`.
"""

import sys

from onnx_training_ops.bench.embeddings import main

if __name__ == "__main__":
    sys.exit(main())
