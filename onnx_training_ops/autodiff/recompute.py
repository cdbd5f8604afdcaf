"""Recomputation: cheap element-wise forward values made again in the backward pass instead of kept.

A rule reads forward values (``Mul``'s reads both operands), so onnxruntime keeps each of them
from the forward pass until the backward pass is done with it. Where such a value is one
cheap element-wise op (:data:`CHEAP`) of values the backward pass keeps anyway, making it
again where the backward pass needs it costs one pass over it and keeps nothing: SiLU's
``sigmoid(x)`` and ``x * sigmoid(x)``, and a gated MLP's ``silu(gate) * up`` (what the
down projection's weight gradient reads) come back from ``gate`` and ``up``, which the
backward pass keeps; a Llama layer at 256 tokens keeps 17 MB less (of 42). torch's
``checkpoint`` and the min-cut partitioner of ``torch.compile`` make the same choice for
pointwise ops.

:func:`recompute` runs after the rules have emitted the backward pass. A forward value ``v`` is
made again when its node is in :data:`CHEAP`, every input is a constant, a value no forward
node makes (a graph input, an initializer) or a value the backward pass reads too (kept
anyway, or made again itself), its non-constant inputs are shaped like ``v`` (no broadcast
makes an input bigger than what it saves), and it has at least :data:`MIN_ELEMENTS` elements
per example (dynamic dimensions counted as 1: small values are not worth their nodes).

The copy is made where the backward pass first reads ``v``, and is tied to the gradient of the
rule that reads it: a zero computed from that gradient's first element is subtracted from one
of its inputs (``x - 0`` is ``x``, ``-0`` and NaN included, where ``x + 0`` turns ``-0`` into
``+0``), so onnxruntime runs it no earlier than the backward pass needs it, and its
common-subexpression elimination cannot merge it back into the forward node.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping, Sequence

import numpy as np
import onnx
from onnx import helper

from .emitter import Emitter

CHEAP = frozenset({"Sigmoid", "Tanh", "Erf", "Neg", "Mul", "Add", "Sub", "Div"})  # default domain
MIN_ELEMENTS = 1 << 12


def _elements_per_example(shape) -> int | None:
    if shape is None:
        return None
    return int(np.prod([d if isinstance(d, int) else 1 for d in shape], dtype=np.int64))


def recompute(forward: Sequence[onnx.NodeProto], em: Emitter, start: int, gates: Sequence[tuple[int, str]],
              constants: Mapping[str, np.ndarray]) -> int:
    """Rewrite the backward nodes ``em.nodes[start:]`` (in place) to read copies of the
    recomputable forward values (module docstring); returns how many values are made again.

    ``gates``: ``(end, gradient)`` per rule applied, in emission order: the nodes before
    ``end`` (and after the previous entry's) were emitted by a rule given ``gradient``.
    """
    producer = {o: n for n in forward for o in n.output if o}
    backward = em.nodes[start:]
    read = {i for n in backward for i in n.input if i in producer}

    def available(name: str) -> bool:  # kept for (or made again in) the backward pass, or not made by the forward
        return name not in producer or name in read or name in constants

    chosen: set[str] = set()
    for v in read:
        node = producer[v]
        if node.op_type not in CHEAP or node.domain not in ("", "ai.onnx") or len(node.output) != 1:
            continue
        size = _elements_per_example(em.shape(v))
        if size is None or size < MIN_ELEMENTS or em.dtype(v) is None:
            continue
        varying = [i for i in node.input if i and i not in constants]
        if varying and all(available(i) and em.shape(i) == em.shape(v) for i in varying):
            chosen.add(v)
    if not chosen:
        return 0
    bounds = [end for end, _ in gates]
    made: dict[str, str] = {}
    zeros: dict[str, str] = {}
    out: list[onnx.NodeProto] = list(em.nodes[:start])
    for offset, node in enumerate(backward):
        wanted = [i for i in node.input if i in chosen and i not in made]
        if wanted:
            k = next((j for j, end in enumerate(bounds) if start + offset < end), None)
            gate = gates[k][1] if k is not None else None
            before = len(em.nodes)
            for v in wanted:
                made[v] = _make(v, producer, chosen, made, em, functools.partial(_zero, em, gate, cache=zeros),
                                constants)
            out.extend(em.nodes[before:])
            del em.nodes[before:]
        for j, name in enumerate(node.input):
            if name in made:
                node.input[j] = made[name]
        out.append(node)
    em.nodes[:] = out
    return len(made)


def _make(v: str, producer, chosen: set[str], made: dict[str, str], em: Emitter, zero, constants) -> str:
    """``v`` computed again from its inputs (those chosen too made again first)."""
    if v in made:
        return made[v]
    node = producer[v]
    inputs = [_make(i, producer, chosen, made, em, zero, constants) if i in chosen else i for i in node.input]
    if inputs == list(node.input):  # nothing made again below: tie one input to the gradient
        j = next(j for j, i in enumerate(inputs) if i and i not in constants)
        tied = em.op("Sub", [inputs[j], zero(inputs[j])], "tied")
        em.set_meta(tied, em.dtype(inputs[j]), em.shape(inputs[j]))
        inputs[j] = tied
    copy = em.fresh(f"again_{node.op_type}")
    em.add_node(helper.make_node(node.op_type, inputs, [copy], name=copy,
                                 **{a.name: helper.get_attribute_value(a) for a in node.attribute}))
    em.set_meta(copy, em.dtype(v), em.shape(v))
    made[v] = copy
    return copy


def _zero(em: Emitter, gradient: str | None, like: str, cache: dict[str, str]) -> str:
    """A ``[1]`` zero of ``like``'s element type that onnxruntime can only compute once
    ``gradient`` is (its first element compared with itself: false, NaN included)."""
    key = f"{gradient}|{em.dtype(like)}"
    if key not in cache:
        if gradient is None:
            raise AssertionError("a backward node outside every rule reads a forward value")
        first = em.op("Slice", [em.op("Reshape", [gradient, em.ints([-1])], "flat"), em.ints([0]), em.ints([1])],
                      "first")
        cache[key] = em.op("Cast", [em.op("Less", [first, first], "never")], "zero", to=em.dtype(like))
    return cache[key]
