"""``python -m benchmarks [NAME] ...`` from a checkout: the benchmarks by name, the optimizer
steps without one (the worker processes of that bench run this too).

    python -m benchmarks [--quick] ...          one optimizer step per contender, MLP steps/s (this package)
    python -m benchmarks embeddings ...         a 1M-row table: dense vs lazy Adam vs torch
    python -m benchmarks overhead ...           import and Gradient-expansion times, with the load
    python -m benchmarks memory ...             peak RSS of fine-tuning GPT-2/BERT: ours, torch, onnxruntime-training
    python -m benchmarks models ...             BERT, GPT-2, ResNet-18, MLP steps vs onnxruntime-training and torch
    python -m benchmarks gpu ...                on a GPU: ours (state on the device) vs torch fp32 and AMP bf16

``python -m benchmarks NAME --help`` lists each one's options.
"""

import importlib
import sys

NAMES = ("embeddings", "overhead", "memory", "models", "gpu")


def main(argv: list[str]) -> int:
    if argv[:1] and argv[0] in NAMES:
        return importlib.import_module(f"benchmarks.{argv[0]}").main(argv[1:])
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__)
    if not any(a in ("-h", "--help") for a in argv):
        from onnx_training_ops.cli.extras import MissingExtra, require

        try:
            for module in ("torch", "matplotlib"):
                require(module, "test")
        except MissingExtra as error:
            print(f"error: {error}", file=sys.stderr)
            return 2
    from benchmarks import main as optimizers_main

    return optimizers_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
