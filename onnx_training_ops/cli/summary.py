"""``onnx-training-ops summary MODEL.onnx``: what a training (or inference) model trains."""

from __future__ import annotations

import argparse
import json

from ._command import add_command


def add_parser(commands) -> None:
    """Add the ``summary`` subcommand to ``commands``, the subparsers of the main parser."""
    s = add_command(
        commands, "summary", run,
        help="list a model's trainable and frozen tensors, optimizer, state size, loss, gradient ops",
        description="Print what a training model trains (trainable and frozen tensors with shapes, parameter "
                    "counts, the optimizer and its state size, the loss, the ops the gradient flows through); "
                    "for an inference model, its initializers and the ops without a derivative rule.",
        input="a training model, checkpoint or inference model (.onnx)")
    s.add_argument("--json", action="store_true", help="print the summary as JSON")


def run(args: argparse.Namespace) -> int:
    """The ``summary`` command.

    Args:
        args: the parsed command line.

    Returns:
        The exit status (0).
    """
    from ..training.summary import summary

    result = summary(args.input)
    print(json.dumps(result.to_dict(), indent=1) if args.json else str(result))
    return 0
