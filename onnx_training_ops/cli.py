"""Command line: ``python -m onnx_training_ops {prepare,conformance,train,bench} ...`` (also ``onnx-training-ops``)."""

from __future__ import annotations

import argparse
import sys
from typing import Sequence


def _prepare(args: argparse.Namespace) -> int:
    import onnx

    from .passes import prepare

    model = prepare(args.input)
    onnx.save(model, args.output)
    print(f"prepared {args.input} -> {args.output}")
    return 0


def _conformance(args: argparse.Namespace) -> int:
    from .conformance import format_table, run_conformance

    results = run_conformance()
    print(format_table(results))
    return 0 if all(r.passed for r in results) else 1


def _train(args: argparse.Namespace) -> int:
    from .demo import train

    result = train(
        out_dir=args.out, epochs=args.epochs, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
        batch_size=args.batch_size, progress=not args.no_progress,
    )
    return 0 if result.accuracy >= args.min_accuracy else 1


def _bench(args: argparse.Namespace) -> int:
    from .bench import main as bench_main

    return bench_main(args.bench_args)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="onnx-training-ops", description="Run ONNX training-domain graphs in onnxruntime."
    )
    commands = parser.add_subparsers(dest="command", required=True)
    p = commands.add_parser("prepare", help="rewrite a model so that onnxruntime runs it")
    p.add_argument("input", help="input .onnx file")
    p.add_argument("output", help="output .onnx file")
    p.set_defaults(func=_prepare)
    c = commands.add_parser("conformance", help="run the domain's ONNX conformance cases")
    c.set_defaults(func=_conformance)
    t = commands.add_parser(
        "train", aliases=["demo"],  # `make demo` runs `python -m onnx_training_ops demo --out out/demo`
        help="demo: train an MLP on scikit-learn's digits with a training model in onnxruntime",
    )
    t.add_argument("--out", default="out/", help="output folder (default: out/)")
    t.add_argument("--epochs", type=int, default=30, help="epochs (default: 30)")
    t.add_argument("--optimizer", choices=("adam", "momentum", "adagrad"), default="adam")
    t.add_argument("--lr", type=float, default=None, help="learning rate (default: per optimizer)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--batch-size", type=int, default=64)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 1 when the held-out accuracy is below this")
    t.set_defaults(func=_train)
    b = commands.add_parser(
        "bench", add_help=False,  # every argument, --help included, goes to onnx_training_ops.bench.main
        help="benchmark the optimizers (one step at 1e4..1e7 parameters, MLP steps/s); see `bench --help`",
    )
    b.set_defaults(func=_bench)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    from .errors import TrainingOpError

    parser = build_parser()
    args, rest = parser.parse_known_args(argv)
    if args.command == "bench":
        args.bench_args = rest
    elif rest:
        parser.error(f"unrecognized arguments: {' '.join(rest)}")
    try:
        return args.func(args)
    except (TrainingOpError, FileNotFoundError) as error:
        print(f"error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
