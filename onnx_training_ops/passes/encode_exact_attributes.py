"""Pass: store each optimizer node's attributes exactly, in the one attribute the kernel reads.

The text also carries the node's name, so run-time errors of the kernel can name it.

onnxruntime-extensions hands float attributes to Python as 6-digit text; the
``exact_attributes`` string (float32 values as exact hex) lets the kernel use the
values the model holds. The spec attributes stay on the node untouched.
"""

from __future__ import annotations

import json
from functools import lru_cache

import onnx
from onnx import ModelProto

from ..schema import OPTIMIZERS
from ._graph import model_training_nodes

EXACT_ATTRIBUTE = "exact_attributes"  # the string attribute the PyOp kernels read


def encode_attributes(attributes: dict) -> str:
    """The text of the ``exact_attributes`` node attribute: floats as exact hex, strings as is."""
    floats = {k: float(v).hex() for k, v in sorted(attributes.items()) if isinstance(v, float)}
    strings = {k: v for k, v in sorted(attributes.items()) if not isinstance(v, float)}
    return json.dumps({"floats": floats, "strings": strings}, separators=(",", ":"))


@lru_cache(maxsize=256)
def decode_attributes(text: str) -> dict:
    """Inverse of :func:`encode_attributes` (cached: a node's text never changes)."""
    encoded = json.loads(text)
    return {**{k: float.fromhex(v) for k, v in encoded["floats"].items()}, **encoded["strings"]}


def node_attributes(node: onnx.NodeProto) -> dict:
    """The node's spec attributes as Python values (floats exact, strings decoded)."""
    values = {}
    for attr in node.attribute:
        if attr.name == EXACT_ATTRIBUTE:
            continue
        value = onnx.helper.get_attribute_value(attr)
        values[attr.name] = value.decode() if isinstance(value, bytes) else value
    return values


def encode_exact_attributes(model: ModelProto) -> ModelProto:
    """(Re)write ``exact_attributes`` on every optimizer node (in place; returns model)."""
    for _, node in model_training_nodes(model):
        if node.op_type not in OPTIMIZERS:
            continue
        text = encode_attributes({**node_attributes(node), "node": node.name or node.output[0]})
        kept = [a for a in node.attribute if a.name != EXACT_ATTRIBUTE]
        del node.attribute[:]
        node.attribute.extend(kept)
        node.attribute.append(onnx.helper.make_attribute(EXACT_ATTRIBUTE, text))
    return model
