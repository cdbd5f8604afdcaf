"""The one error type users of this package see for bad models and bad input."""

from __future__ import annotations


class TrainingOpError(ValueError):
    """A model, node or input does not follow the ``ai.onnx.preview.training`` spec.

    The message names the node (and input) at fault, what was expected and what
    was found.
    """


class FileWriteError(TrainingOpError, OSError):
    """A file could not be written (read-only directory, disk full): names the path the
    caller gave, never a temporary; an ``OSError`` too, for code that catches those."""


def node_label(node) -> str:
    """``Adam node 'opt'`` — how messages name a node (its name, else its first output)."""
    name = node.name or (node.output[0] if len(node.output) else "")
    return f"{node.op_type} node {name!r}"
