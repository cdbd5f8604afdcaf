"""One subcommand of the ``onnx-training-ops`` parser: its name, help, positional arguments and the function
it runs (the options each command adds itself)."""

from __future__ import annotations

import argparse
from collections.abc import Callable


def add_command(commands, name: str, run: Callable[[argparse.Namespace], int], help: str,
                description: str | None = None, **positionals: str) -> argparse.ArgumentParser:
    """Add the subcommand ``name``, which runs ``run``.

    Args:
        commands: the subparsers of the main parser.
        name: the subcommand's name.
        run: what the subcommand does, given the parsed command line; returns the exit status.
        help: the one line ``onnx-training-ops --help`` shows.
        description: what ``onnx-training-ops NAME --help`` shows (default: none).
        **positionals: the positional arguments, in order: name -> help.

    Returns:
        The subcommand's parser, to add options to.
    """
    parser = commands.add_parser(name, help=help, description=description)
    for argument, text in positionals.items():
        parser.add_argument(argument, help=text)
    parser.set_defaults(func=run)
    return parser
