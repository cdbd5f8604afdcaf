"""Small edits to a graph by the builder's restoring steps: new initializers and nodes, names.

:class:`GraphEdit` collects what a step adds (nodes before or after a node, or first: nodes
that read initializers only), hands out unused names, computes a constant from a parameter by
a :class:`~.folded_params.Recipe`, and drops the initializers it replaced once nothing reads
them.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .folded_params import Recipe, emit


class GraphEdit:
    """A graph being repaired: its initializers by name, the nodes to add, fresh names."""

    def __init__(self, graph: onnx.GraphProto, params: set[str],
                 value: Callable[[onnx.TensorProto], np.ndarray] = numpy_helper.to_array,
                 folded: dict[str, list[str]] | None = None):
        self.graph = graph
        self.params = params  # the torch parameters' names
        self.folded = folded or {}  # folded constant -> what it was computed from
        self.inits = {t.name: t for t in graph.initializer}
        self.value = lambda name: value(self.inits[name])
        self.replaced: set[str] = set()
        self.transposed: dict[str, str] = {}
        self.prologue: list = []  # new nodes that read initializers only: they go first
        self.before: dict[str, list] = {}  # a node's first output -> new nodes that go right before it
        self.after: dict[str, list] = {}
        self.taken = {n for node in graph.node for n in [*node.input, *node.output]} | set(self.inits) | \
            {v.name for v in [*graph.input, *graph.output]}

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def add_init(self, name: str, array: np.ndarray) -> None:
        t = numpy_helper.from_array(np.asarray(array, order="C"), name)  # a 0-d array stays 0-d
        self.graph.initializer.append(t)
        self.inits[name] = t
        self.taken.add(name)

    def insert_new_nodes(self) -> None:
        """Put the new nodes in place (one rebuild: node references stay valid until then)."""
        if not (self.prologue or self.before or self.after):
            return
        nodes = [*self.prologue, *(new for node in self.graph.node for new in
                                   [*self.before.get(node.output[0], []), node,
                                    *self.after.get(node.output[0], [])])]
        del self.graph.node[:]
        self.graph.node.extend(nodes)
        self.prologue, self.before, self.after = [], {}, {}

    def transpose_of(self, param: str) -> str:
        """The name of ``Transpose(param)`` (one node per parameter)."""
        if param not in self.transposed:
            out = self.fresh(f"{param}__transposed")
            self.prologue.append(helper.make_node("Transpose", [param], [out], perm=[1, 0], name=out))
            self.transposed[param] = out
        return self.transposed[param]

    def computed(self, recipe: Recipe, param: str, base: str) -> str:
        """The name of ``recipe`` run on ``param`` (new nodes in the prologue)."""
        out = self.fresh(base)
        nodes, inits = emit(recipe, param, out, self.fresh)
        for t in inits:
            self.graph.initializer.append(t)
            self.inits[t.name] = t
        self.prologue.extend(nodes)
        return out

    def readers(self, name: str) -> list:
        return [n for n in self.graph.node if name in n.input]

    def read_instead(self, old: str, new: str) -> None:
        """Every node that reads ``old`` reads ``new``; ``old`` is dropped once nothing reads it."""
        for node in self.readers(old):
            node.input[:] = [new if n == old else n for n in node.input]
        self.replaced.add(old)

    def drop_replaced(self) -> None:
        """Put the new nodes in place, and remove the initializers replaced that nothing reads any
        more (the folded copies)."""
        self.insert_new_nodes()
        graph, replaced = self.graph, self.replaced
        used = {o.name for o in graph.output}
        stack = list(graph.node)
        while stack:
            node = stack.pop()
            used.update(node.input)
            for a in node.attribute:
                for sub in [a.g] if a.HasField("g") else list(a.graphs):
                    stack.extend(sub.node)
                    used.update(o.name for o in sub.output)
        for i in reversed(range(len(graph.initializer))):  # in place: no copy of the big tensors
            name = graph.initializer[i].name
            if name in replaced and name not in used:
                del graph.initializer[i]
                self.inits.pop(name, None)
