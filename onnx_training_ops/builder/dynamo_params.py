"""torch parameters the dynamo exporter's optimizer merged, folded or removed, given back.

``torch.onnx.export(..., dynamo=True, optimize=True)`` (torch's default) keeps torch's
parameter names but optimizes the graph as if the weights were constants: initializers of
equal value become one (fresh LayerNorm weights of 1, zero biases: BERT's query bias then
reads ``embeddings.LayerNorm.bias``), a ``Linear`` weight becomes a folded constant holding
its transpose (``val_51``), a tied weight read twice gets a folded copy for one of its uses
(GPT-2's ``lm_head``), and a zero bias disappears (a ``Gemm`` without ``C``). Trained as
exported, merged parameters would be one tensor and the others would not train at all.

The export says what torch had: the graph's ``pkg.torch.export.ExportedProgram.graph_signature``
metadata lists every parameter (placeholder and torch name), and each node's
``pkg.torch.onnx.fx_node`` metadata names the torch op it came from and the placeholders
that op read. :func:`restore_parameters` walks the nodes of each torch op that reads a
parameter (``linear``, ``addmm``, ``layer_norm``, ``embedding``, convolutions, batch norm),
finds the input slot that holds the parameter, and makes it read an initializer of the
parameter's own name (a copy of the value it reads; through a ``Transpose`` where the slot
holds the transpose; zeros where a zero bias was removed). A parameter that a torch op reads
but that cannot be found this way is an error naming it and the export options that keep it.
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ..errors import TrainingOpError

SIGNATURE_KEY = "pkg.torch.export.ExportedProgram.graph_signature"
FX_NODE_KEY = "pkg.torch.onnx.fx_node"
KEEP_HINT = ("export with torch.onnx.export(..., dynamo=True, optimize=False), or with "
             "dynamo=False and do_constant_folding=False, to keep one initializer per torch parameter")

# aten op -> {argument position: role}
_ROLES = {
    "linear": {1: "weight", 2: "bias"},
    "addmm": {0: "bias", 2: "weight"},
    "layer_norm": {2: "weight", 3: "bias"},
    "embedding": {0: "weight"},
    "conv1d": {1: "weight", 2: "bias"},
    "conv2d": {1: "weight", 2: "bias"},
    "conv3d": {1: "weight", 2: "bias"},
    "convolution": {1: "weight", 2: "bias"},
    "batch_norm": {1: "weight", 2: "bias"},
    "native_batch_norm": {1: "weight", 2: "bias"},
    "_native_batch_norm_legit_no_training": {1: "weight", 2: "bias"},
    "_native_batch_norm_legit": {1: "weight", 2: "bias"},
    "_native_batch_norm_legit_functional": {1: "weight", 2: "bias"},
}
# ONNX op -> {role: input index}
_SLOTS = {
    "Gemm": {"weight": 1, "bias": 2},
    "MatMul": {"weight": 1},
    "LayerNormalization": {"weight": 1, "bias": 2},
    "Gather": {"weight": 0},
    "Conv": {"weight": 1, "bias": 2},
    "BatchNormalization": {"weight": 1, "bias": 2},
}
_FX_HEAD = re.compile(r"^%(\w+) : .*?call_function\[target=torch\.ops\.aten\.(\w+)\.\w+\]\(args = \((.*)\), kwargs")


@dataclass
class Restored:
    """What :func:`restore_parameters` did: parameter names by kind of repair."""

    untied: list[tuple[str, str]] = field(default_factory=list)  # (parameter, initializer it shared)
    unfolded: list[tuple[str, str]] = field(default_factory=list)  # (parameter, folded constant)
    zero_bias: list[str] = field(default_factory=list)  # removed zero biases restored as zeros

    def __bool__(self) -> bool:
        return bool(self.untied or self.unfolded or self.zero_bias)

    def describe(self) -> str:
        """The build-time note: how many of each, and the first few."""
        parts = []
        if self.untied:
            parts.append(f"{len(self.untied)} merged with an equal initializer ({_few(self.untied)})")
        if self.unfolded:
            parts.append(f"{len(self.unfolded)} folded into constants ({_few(self.unfolded)})")
        if self.zero_bias:
            parts.append(f"{len(self.zero_bias)} zero bias(es) removed ({', '.join(self.zero_bias[:3])}"
                         f"{' ...' if len(self.zero_bias) > 3 else ''}), restored as zeros")
        return ("torch.onnx.export's dynamo exporter (optimize=True) had merged, folded or removed torch "
                "parameters; each is an initializer of its own again, as in torch: " + "; ".join(parts) +
                ". To skip this step, " + KEEP_HINT)


def _few(pairs: list[tuple[str, str]]) -> str:
    shown = ", ".join(f"{p} (was {s})" for p, s in pairs[:3])
    return shown + (f" and {len(pairs) - 3} more" if len(pairs) > 3 else "")


def exported_parameters(graph: onnx.GraphProto) -> dict[str, str] | None:
    """Placeholder -> torch name of every ``PARAMETER`` in a dynamo export's graph signature;
    None when the graph carries no signature (not a dynamo export)."""
    text = next((p.value for p in graph.metadata_props if p.key == SIGNATURE_KEY), None)
    if text is None:
        return None
    return dict(re.findall(r"^(\w+): PARAMETER target='([^']+)'", text, flags=re.M))


def _split_args(text: str) -> list[str]:
    """Top-level comma-separated arguments of an fx call (brackets nest)."""
    out, depth, start = [], 0, 0
    for i, ch in enumerate(text):
        if ch in "([{":
            depth += 1
        elif ch in ")]}":
            depth -= 1
        elif ch == "," and depth == 0:
            out.append(text[start:i].strip())
            start = i + 1
    if text[start:].strip():
        out.append(text[start:].strip())
    return out


def _fx_ops(graph: onnx.GraphProto, params: dict[str, str]):
    """Torch op name -> (aten op, {role: torch parameter name}, [ONNX nodes]) for each torch op
    that read a parameter, and the set of parameters some torch op read."""
    ops: dict[str, tuple[str, dict[str, str], list]] = {}
    read: set[str] = set()
    for node in graph.node:
        fx = next((p.value for p in node.metadata_props if p.key == FX_NODE_KEY), "")
        m = _FX_HEAD.match(fx)
        if not m:
            continue
        args = _split_args(m.group(3))
        used = [params[a[1:]] for a in args if a.startswith("%") and a[1:] in params]
        if not used:
            continue
        read.update(used)
        roles = {role: params[args[i][1:]] for i, role in _ROLES.get(m.group(2), {}).items()
                 if i < len(args) and args[i].startswith("%") and args[i][1:] in params}
        ops.setdefault(m.group(1), (m.group(2), roles, []))[2].append(node)
    return ops, read


def _attr(node, name: str, default: int = 0) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _holds_transpose(aten: str, node) -> bool:
    """Whether the node's weight slot holds the torch weight transposed."""
    if node.op_type == "MatMul":
        return aten == "linear"
    if node.op_type == "Gemm":
        return bool(_attr(node, "transB")) != (aten == "linear")
    return False


class _Graph:
    """The graph being repaired: initializers by name, new nodes and names."""

    def __init__(self, graph: onnx.GraphProto, params: set[str]):
        self.graph = graph
        self.params = params
        self.replaced: set[str] = set()
        self.inits = {t.name: t for t in graph.initializer}
        self.transposed: dict[str, str] = {}
        self.before: dict[int, list] = {}  # a node's first output -> new nodes that go right before it
        self.after: dict[int, list] = {}
        self.taken = {n for node in graph.node for n in [*node.input, *node.output]} | set(self.inits) | \
            {v.name for v in [*graph.input, *graph.output]}

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name in self.taken:
            name, i = f"{base}_{i}", i + 1
        self.taken.add(name)
        return name

    def add_init(self, name: str, array: np.ndarray) -> None:
        t = numpy_helper.from_array(np.ascontiguousarray(array), name)
        self.graph.initializer.append(t)
        self.inits[name] = t
        self.taken.add(name)

    def insert_new_nodes(self) -> None:
        """Put the new nodes in place (one rebuild: node references stay valid until then)."""
        if not (self.before or self.after):
            return
        nodes = [new for node in self.graph.node for new in
                 [*self.before.get(node.output[0], []), node, *self.after.get(node.output[0], [])]]
        del self.graph.node[:]
        self.graph.node.extend(nodes)

    def transpose_of(self, param: str, before) -> str:
        """The name of ``Transpose(param)`` (one node per parameter, inserted before ``before``)."""
        if param not in self.transposed:
            out = self.fresh(f"{param}__transposed")
            node = helper.make_node("Transpose", [param], [out], perm=[1, 0], name=out)
            self.before.setdefault(before.output[0], []).append(node)
            self.transposed[param] = out
        return self.transposed[param]


def _slot(node, role: str, aten: str, g: _Graph) -> int | None:
    """The input index of ``node`` that plays ``role`` for the torch op (None: none here)."""
    if node.op_type == "Add" and role == "bias" and aten in ("linear", "addmm"):
        held = [i for i, n in enumerate(node.input) if n in g.inits]
        return held[0] if len(held) == 1 else None
    return _SLOTS.get(node.op_type, {}).get(role)


def _point_at(node, index: int, param: str, transpose: bool, g: _Graph, done: Restored) -> None:
    """Make input ``index`` of ``node`` read the parameter (creating it from the value the slot
    reads when the export lost it); a no-op when it already does."""
    source = node.input[index]
    if source == param:
        return
    if g.inits[source].data_location == onnx.TensorProto.EXTERNAL:
        raise TrainingOpError(
            f"{node.op_type} node {node.name or node.output[0]!r} reads {source!r} where torch reads parameter "
            f"{param!r} (the dynamo exporter merged or folded it), and its value lies in an external data file "
            f"that this step does not read; {KEEP_HINT}")
    value = numpy_helper.to_array(g.inits[source])
    value = value.T if transpose else value
    if param in g.inits:
        kept = numpy_helper.to_array(g.inits[param])
        if kept.shape != value.shape or not np.array_equal(kept, value):
            raise TrainingOpError(
                f"{node.op_type} node {node.name or node.output[0]!r} input {index} ({source!r}) should hold "
                f"torch parameter {param!r} (the export's fx_node metadata says so) but its value differs; "
                f"{KEEP_HINT}")
    else:
        g.add_init(param, value)
        (done.untied if source in g.params else done.unfolded).append((param, source))
    g.replaced.add(source)
    node.input[index] = g.transpose_of(param, node) if transpose else param


def _zero_bias(aten: str, nodes: list, roles: dict[str, str], g: _Graph, done: Restored) -> bool:
    """Give a removed zero bias back to the op's nodes (a third input of Gemm/Conv/LayerNormalization,
    or an Add after a MatMul). Returns False when the op's form is not one of these."""
    bias, weight = roles["bias"], roles.get("weight")
    if bias in g.inits or weight not in g.inits:
        return False
    dims = list(g.inits[weight].dims)
    dtype = helper.tensor_dtype_to_np_dtype(g.inits[weight].data_type)
    size = {"linear": dims[0], "addmm": dims[-1], "layer_norm": int(np.prod(dims))}.get(
        aten, dims[0] if aten.startswith("conv") else None)
    if size is None:
        return False
    main = [n for n in nodes if n.op_type in ("Gemm", "Conv", "LayerNormalization", "MatMul")]
    if len(main) != 1:
        return False
    node = main[0]
    if node.op_type == "MatMul":
        if any(n.op_type == "Add" for n in nodes):
            return False
        g.add_init(bias, np.zeros(size if aten != "layer_norm" else dims, dtype))
        out = node.output[0]
        node.output[0] = g.fresh(f"{out}__without_bias")
        add = helper.make_node("Add", [node.output[0], bias], [out], name=g.fresh(f"{out}__bias"))
        g.after.setdefault(out, []).append(add)
    else:
        if len(node.input) > 2 and node.input[2]:
            return False
        g.add_init(bias, np.zeros(dims if aten == "layer_norm" else size, dtype))
        if len(node.input) == 2:
            node.input.append(bias)
        else:
            node.input[2] = bias
    done.zero_bias.append(bias)
    return True


def restore_parameters(model: onnx.ModelProto) -> Restored:
    """In place: every torch parameter of a dynamo export that its torch ops read becomes an
    initializer of its own name read where torch reads it (see the module doc).

    Args:
        model: an inference model; untouched unless it is a dynamo export
            (``pkg.torch.export.ExportedProgram.graph_signature`` metadata).

    Returns:
        What was restored (empty for other models or a dynamo export with optimize=False).

    Raises:
        TrainingOpError: a parameter that a torch op reads is not in the model and cannot be
            restored (named, with the export options that keep it); or a slot that should hold
            a kept parameter holds another value.
    """
    graph = model.graph
    params = exported_parameters(graph)
    done = Restored()
    if not params:
        return done
    g = _Graph(graph, set(params.values()))
    ops, read = _fx_ops(graph, params)
    if not ops:  # no fx_node metadata (another torch version): say what is missing, if anything
        missing = sorted(set(params.values()) - set(g.inits))
        if missing:
            warnings.warn(f"torch parameter(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} of this "
                          "dynamo export are not initializers of the model and its nodes do not say which torch op "
                          "read them: unused by the module, or merged/removed by the exporter's optimize=True (they "
                          f"would not train); {KEEP_HINT}", stacklevel=3)
        return done
    folded = sorted(roles["weight"] for aten, roles, nodes in ops.values()
                    if "batch_norm" in aten and "weight" in roles
                    and not any(n.op_type == "BatchNormalization" for n in nodes))
    if folded:
        raise TrainingOpError(
            f"torch.onnx.export's optimize=True folded {len(folded)} BatchNorm layer(s) into the convolution before "
            f"them ({', '.join(folded[:3])}{' ...' if len(folded) > 3 else ''}): the BatchNorm is gone and the "
            f"convolution's weight holds weight * gamma / sigma, so neither trains as in torch; {KEEP_HINT}")
    for aten, roles, nodes in ops.values():
        for role, param in sorted(roles.items(), key=lambda kv: kv[0] != "weight"):  # weight first
            slots = [(n, i) for n in nodes for i in [_slot(n, role, aten, g)]
                     if i is not None and i < len(n.input) and n.input[i] in g.inits]
            for node, index in slots:
                _point_at(node, index, param, role == "weight" and _holds_transpose(aten, node), g, done)
            if not slots and role == "bias" and param not in g.inits:
                _zero_bias(aten, nodes, roles, g, done)
    g.insert_new_nodes()
    _drop_unused(graph, g.replaced)
    lost = sorted(p for p in read if p not in g.inits)
    if lost:
        raise TrainingOpError(
            f"torch parameter(s) {', '.join(lost)} of this dynamo export are read by the model's torch ops "
            f"but are not initializers of the ONNX model (torch.onnx.export's optimize=True merged, folded "
            f"or removed them) and could not be restored: they would not train; {KEEP_HINT}")
    return done


def _drop_unused(graph: onnx.GraphProto, replaced: set[str]) -> None:
    """Remove the initializers of ``replaced`` that no node, subgraph or output reads any more
    (the folded copies)."""
    used = {o.name for o in graph.output}
    stack = list(graph.node)
    while stack:
        node = stack.pop()
        used.update(node.input)
        for a in node.attribute:
            for sub in [a.g] if a.HasField("g") else list(a.graphs):
                stack.extend(sub.node)
                used.update(o.name for o in sub.output)
    keep = [t for t in graph.initializer if t.name in used or t.name not in replaced]
    if len(keep) != len(graph.initializer):
        del graph.initializer[:]
        graph.initializer.extend(keep)
