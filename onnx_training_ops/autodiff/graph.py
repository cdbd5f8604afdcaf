"""The reverse-mode walk: which nodes lie between xs and y, and gradient accumulation.

1. *Ancestors*: the nodes needed to compute ``y``, walking producers back from ``y`` and
   stopping at the cut (the xs and zs names) and at values no node produces (graph inputs,
   initializers, outer-scope values).
2. *Activity*: forward over those nodes, a value is active when it is an xs or a
   floating-point output of a node with an active input. Integer/bool values, outputs of
   shape-only ops (``Shape``, ``Size``...) and everything not downstream of xs are
   constants. The *gradient path* is the active nodes with an output from which ``y``
   depends through active values; every one of them needs a derivative rule (checked
   before anything is emitted, all missing ones listed at once; the builder runs the same
   check through :mod:`.coverage`).
3. *Accumulation*: backward over the ancestors, each node whose active outputs received a
   gradient applies its rule; contributions to a value are summed (``Sum``) when its
   producer is reached (or at the end, for the xs).
4. *Recomputation* (:mod:`.recompute`): forward values the rules read that one cheap
   element-wise op makes from values the backward pass keeps anyway are made again there.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence

import numpy as np
import onnx

from ..errors import TrainingOpError
from .emitter import FLOAT_TYPES, Emitter
from .recompute import recompute
from .registry import RULES, RuleContext, RuleError, describe_missing, has_rule, missing_rules_of, rule_key

# Ops whose outputs never carry a gradient even when their inputs are float (comparisons
# and logic give bool whatever their inputs, also where a value's type is not known yet).
NON_DIFFERENTIABLE = frozenset({
    "Shape", "Size", "Floor", "Ceil", "Round", "Sign", "RandomNormalLike", "RandomUniformLike",
    "EyeLike", "ConstantOfShape", "Range", "NonZero", "ArgMax", "ArgMin", "OneHot",
    "Bernoulli", "Multinomial",
    "Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual", "Not", "And", "Or", "Xor",
    "IsNaN", "IsInf",
})


def subgraph_free_names(node: onnx.NodeProto) -> set[str]:
    """Names that the graph attributes of ``node`` read from the enclosing scope."""
    free: set[str] = set()
    for attr in node.attribute:
        graphs = list(attr.graphs) + ([attr.g] if attr.HasField("g") else [])
        for g in graphs:
            defined = {v.name for v in g.input} | {t.name for t in g.initializer}
            defined |= {t.name for t in g.sparse_initializer}
            for n in g.node:
                free |= {i for i in n.input if i and i not in defined}
                free |= subgraph_free_names(n) - defined
                defined |= {o for o in n.output if o}
            free |= {o.name for o in g.output if o.name not in defined}
    return free


def node_reads(node: onnx.NodeProto) -> list[str]:
    """Explicit inputs plus, for control-flow nodes, the outer names their bodies read."""
    reads = [i for i in node.input if i]
    if any(a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS)
           for a in node.attribute):
        reads += sorted(subgraph_free_names(node))
    return reads


def producer_map(nodes: Sequence[onnx.NodeProto]) -> dict[str, int]:
    return {o: i for i, n in enumerate(nodes) for o in n.output if o}


def ancestors(nodes: Sequence[onnx.NodeProto], producers: Mapping[str, int],
              targets: Iterable[str], cut: set[str]) -> list[int]:
    """Indices (ascending) of the nodes needed to compute ``targets``, not looking past ``cut``."""
    seen: set[int] = set()
    stack = [t for t in targets if t not in cut]
    visited_names: set[str] = set()
    while stack:
        name = stack.pop()
        if name in visited_names:
            continue
        visited_names.add(name)
        idx = producers.get(name)
        if idx is None or idx in seen:
            continue
        seen.add(idx)
        stack.extend(i for i in node_reads(nodes[idx]) if i not in cut)
    return sorted(seen)


def topological_sort(nodes: Sequence[onnx.NodeProto]) -> list[onnx.NodeProto]:
    """Stable topological order (a node moves only as far as a dependency forces it)."""
    producers = producer_map(nodes)
    order: list[int] = []
    state = [0] * len(nodes)  # 0 new, 1 in progress, 2 done
    for root in range(len(nodes)):
        if state[root]:
            continue
        stack = [(root, iter(node_reads(nodes[root])))]
        state[root] = 1
        while stack:
            idx, it = stack[-1]
            for name in it:
                dep = producers.get(name)
                if dep is not None and state[dep] == 0:
                    state[dep] = 1
                    stack.append((dep, iter(node_reads(nodes[dep]))))
                    break
            else:
                stack.pop()
                state[idx] = 2
                order.append(idx)
    return [nodes[i] for i in order]


def active_values(nodes: Sequence[onnx.NodeProto], order: Iterable[int], leaves: Iterable[str],
                  is_float: Callable[[str], bool]) -> set[str]:
    """Activity (step 2): ``leaves`` plus the float outputs of every node of ``order`` that
    reads an active value, except the :data:`NON_DIFFERENTIABLE` ops."""
    active = set(leaves)
    for idx in order:
        node = nodes[idx]
        if node.op_type in NON_DIFFERENTIABLE and node.domain in ("", "ai.onnx"):
            continue
        if any(i in active for i in node_reads(node)):
            active.update(o for o in node.output if o and is_float(o))
    return active


def gradient_path(nodes: Sequence[onnx.NodeProto], order: Sequence[int], y: str,
                  active: set[str]) -> tuple[list[int], set[str]]:
    """The nodes of ``order`` a gradient of ``y`` flows through (ascending) and the active
    names it reaches: backward from ``y`` over active nodes, through active values only."""
    wanted = {y} if y in active else set()
    path: list[int] = []
    for idx in reversed(order):
        node = nodes[idx]
        if not any(o in wanted for o in node.output if o):
            continue
        reads = [i for i in node_reads(node) if i in active]
        if reads and not (node.op_type in NON_DIFFERENTIABLE and node.domain in ("", "ai.onnx")):
            path.append(idx)
            wanted.update(reads)
    return path[::-1], wanted


def _is_float(em: Emitter, name: str) -> bool:
    dt = em.dtype(name)
    return dt is None or dt in FLOAT_TYPES


def _differentiable(node: onnx.NodeProto, active: set[str]) -> bool:
    """A rule exists and no control-flow body reads an active value (bodies are not
    differentiated)."""
    return has_rule(node) and not any(i in active for i in node_reads(node)[len(node.input):])


def _total(em: Emitter, parts: list[str]) -> str:
    return parts[0] if len(parts) == 1 else em.op("Sum", parts, "accumulate")


def backprop(nodes: Sequence[onnx.NodeProto], y: str, leaves: Sequence[str], cut: set[str],
             em: Emitter, constants: Mapping[str, np.ndarray], label: str) -> dict[str, str | None]:
    """Emit the reverse pass of ``y`` over ``nodes``; return ``{leaf: gradient name or None}``.

    ``leaves`` are the differentiated names (xs as the forward nodes see them); ``cut`` adds
    the zs. A leaf that y does not depend on maps to None. ``label`` names the Gradient node
    in errors.
    """
    producers = producer_map(nodes)
    needed = ancestors(nodes, producers, [y], cut)
    active = active_values(nodes, needed, leaves, lambda name: _is_float(em, name))
    if y not in active:
        raise TrainingOpError(
            f"{label}: y {y!r} is not reachable from xs {list(leaves)} "
            "(it does not depend on any of them through differentiable values)")
    path, _ = gradient_path(nodes, needed, y, active)
    missing = missing_rules_of(nodes[i] for i in path if not _differentiable(nodes[i], active))
    if missing:
        raise TrainingOpError(f"{label}: {describe_missing(missing, 'from xs to y')}")

    acc: dict[str, list[str]] = defaultdict(list)
    start = len(em.nodes)
    gates: list[tuple[int, str]] = []  # per rule applied: (end of its nodes, the gradient it was given)
    try:
        acc[y].append(em.filled_like(1.0, y))  # the seed: d sum(y) / dy = ones
    except LookupError as e:
        raise TrainingOpError(f"{label}: cannot build the seed for y {y!r}: {e}") from None
    for idx in reversed(needed):
        node = nodes[idx]
        grads = [(_total(em, acc.pop(o)) if o in acc else None) if o else None
                 for o in node.output]
        if not any(grads):
            continue
        reads = node_reads(node)
        if not any(i in active for i in reads):
            continue
        rule = RULES[rule_key(node)]  # the path check above found one for every node here
        needs = [bool(i) and i in active for i in node.input]
        ctx = RuleContext(node, grads, needs, em, constants)
        try:
            result = rule(ctx)
        except (RuleError, LookupError) as e:
            raise TrainingOpError(
                f"{label}: cannot differentiate {node.op_type} node "
                f"{node.name or node.output[0]!r}: {e}") from None
        gates.append((len(em.nodes), next(g for g in grads if g)))
        for name, g, need in zip(node.input, result, needs):
            if need and g is not None:
                acc[name].append(g)
    recompute(nodes, em, start, gates, constants)
    return {leaf: (_total(em, acc[leaf]) if acc.get(leaf) else None) for leaf in leaves}
