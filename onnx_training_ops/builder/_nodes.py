"""What the train- and eval-mode rewrites say about a node: is it the standard op, and its label.

The training-mode copy of the forward pass (:mod:`.train_mode`) renames every node under
:data:`PREFIX`; errors name the node as the user's model does.
"""

from __future__ import annotations

import onnx

PREFIX = "train/"
STANDARD_DOMAINS = ("", "ai.onnx")


def is_standard(node: onnx.NodeProto, op_type: str) -> bool:
    """``node`` is the standard ONNX op ``op_type``."""
    return node.op_type == op_type and node.domain in STANDARD_DOMAINS


def label(node: onnx.NodeProto) -> str:
    """The node's name (without the copy's ``train/`` prefix), else its first output."""
    name = node.name or node.output[0]
    return name[len(PREFIX):] if name.startswith(PREFIX) else name
