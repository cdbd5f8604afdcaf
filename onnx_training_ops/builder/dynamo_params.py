"""Every torch parameter of a dynamo export accounted for: read where torch reads it, or named.

``torch.onnx.export(module, args, f)`` (dynamo, ``optimize=True``: torch's default) keeps
torch's parameter names but optimizes the graph as if the weights were constants:

* initializers of equal value become one (fresh LayerNorm weights of 1, zero biases: BERT's
  query bias then reads ``embeddings.LayerNorm.bias``; RMSNorm weights read by a ``Mul``);
* computations on parameters alone become constants: a ``Linear`` weight's transpose
  (``val_51``), a tied head's ``emb.weight.t()``, ``torch.exp(log_s)``, ``w.sum(0)``, an
  embedding looked up with constant ids (position ids from a buffer), a class token expanded
  to the batch;
* two torch ops computing the same thing on the same input become one node (two fresh
  LayerNorms of one input, GPT-NeoX's parallel residual), and a zero bias disappears.

Trained as exported, merged parameters would be one tensor and the others would not train.
The export says what torch had: the graph's ``pkg.torch.export.ExportedProgram.graph_signature``
metadata lists every parameter, each node's ``pkg.torch.onnx.fx_node`` names the torch op it
came from and the placeholders that op read (``pkg.torch.onnx.name_scopes`` the module), and
each folded constant's ``pkg.onnxscript.optimizer.folded_from`` the values it was computed
from. :func:`restore_parameters` makes every parameter an initializer of its own name read
where torch reads it:

1. in the input slot its torch op reads it (``linear``, ``addmm``, ``layer_norm``,
   ``embedding``, convolutions, norms by role; ``mul``/``add``/``sub``/``div`` by position):
   a copy of the merged value, the transposed constant back in torch's layout behind a
   ``Transpose``, zeros for a removed zero bias;
2. a node merged with another (common subexpressions): the node again, reading the
   parameters of the module nearest to where its output was used;
3. a folded constant computed from one parameter again (:mod:`.folded_params`: found by value
   from the parameter, or from the constant for one invertible op such as ``exp``);
4. a parameter no node reads: another name of one that is read (a tie: GPT-2's ``wte`` is
   ``lm_head``), or unused by ``forward``.

What cannot be restored (a constant computed from several parameters, an embedding table
of which the export holds only the looked-up rows, a BatchNorm folded into a convolution)
is listed in :attr:`Restored.lost` with why: the builder refuses to train it, naming it and
the export options that keep it, and builds when it is frozen (the export computes it right).
The torch-name record (:mod:`.torch_record`) gets every parameter's names, ties included.
"""

from __future__ import annotations

import ast
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .folded_params import Ambiguous, Recipe, Step, find_recipe, invert
from .graph_edit import GraphEdit
from .torch_record import KEY as RECORD_KEY
from .torch_record import read as read_record
from .torch_record import write as write_record

SIGNATURE_KEY = "pkg.torch.export.ExportedProgram.graph_signature"
FX_NODE_KEY = "pkg.torch.onnx.fx_node"
SCOPES_KEY = "pkg.torch.onnx.name_scopes"
FOLDED_KEY = "pkg.onnxscript.optimizer.folded_from"
KEEP_HINT = ("export with torch.onnx.export(..., dynamo=True, optimize=False) (or "
             "onnx_training_ops.export.from_torch.export_for_training), or with dynamo=False and "
             "do_constant_folding=False, to keep one initializer per torch parameter")

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
    "group_norm": {2: "weight", 3: "bias"},
    "native_group_norm": {1: "weight", 2: "bias"},
    "instance_norm": {1: "weight", 2: "bias"},
}
_VECTOR_ROLES = ("group_norm", "native_group_norm", "instance_norm", "batch_norm")  # 1-D weight and bias
# ONNX op -> {role: input index}
_SLOTS = {
    "Gemm": {"weight": 1, "bias": 2},
    "MatMul": {"weight": 1},
    "LayerNormalization": {"weight": 1, "bias": 2},
    "Gather": {"weight": 0},
    "Conv": {"weight": 1, "bias": 2},
    "BatchNormalization": {"weight": 1, "bias": 2},
}
_ELEMENTWISE = {"mul": "Mul", "add": "Add", "sub": "Sub", "div": "Div"}  # argument i is input i
# torch ops that only move or alias data: the optimizer removing one loses no parameter
_BENIGN = {"clone", "alias", "view", "_unsafe_view", "reshape", "contiguous", "detach", "dropout", "expand",
           "getitem", "_to_copy", "to", "type_as", "squeeze", "unsqueeze", "slice", "select", "permute",
           "transpose", "t", "flatten", "lift_fresh_copy", "copy", "alias_copy", "view_copy", "arange", "full",
           "ones", "zeros", "scalar_tensor", "sym_size", "cat", "index", "repeat"}
_FX_HEAD = re.compile(r"^%(\w+) : .*?call_function\[target=torch\.ops\.aten\.(\w+)\.\w+\]\(args = \((.*)\), kwargs")


def _fx_prefix(name: str) -> str:
    return re.sub(r"_\d+$", "", name)


@dataclass
class Restored:
    """What :func:`restore_parameters` found: the parameters it gave back, by kind of repair,
    and those it could not."""

    untied: list[tuple[str, str]] = field(default_factory=list)  # (parameter, initializer it shared)
    unfolded: list[tuple[str, str]] = field(default_factory=list)  # (parameter, folded constant)
    zero_bias: list[str] = field(default_factory=list)  # removed zero biases restored as zeros
    computed: list[tuple[str, str, str]] = field(default_factory=list)  # (parameter, constant, how)
    twins: list[tuple[str, str]] = field(default_factory=list)  # (parameter, the one whose node it shared)
    aliases: dict[str, str] = field(default_factory=dict)  # another name of a parameter -> that parameter
    unused: list[str] = field(default_factory=list)  # read by no torch op (torch gives them no gradient)
    lost: dict[str, str] = field(default_factory=dict)  # not restored -> why
    stand_ins: dict[str, set[str]] = field(default_factory=dict)  # lost -> initializers read in its place
    by_value: set[str] = field(default_factory=set)  # lost ones that torch's values would give back

    def __bool__(self) -> bool:
        return bool(self.untied or self.unfolded or self.zero_bias or self.computed or self.twins or self.lost)

    def describe(self) -> str:
        """The build-time note: how many of each, and the first few."""
        parts = []
        if self.untied:
            parts.append(f"{len(self.untied)} merged with an equal initializer ({_few(self.untied)})")
        if self.unfolded:
            parts.append(f"{len(self.unfolded)} folded into constants ({_few(self.unfolded)})")
        if self.computed:
            parts.append(f"{len(self.computed)} computed into constants, computed from the parameter again ("
                         + _few([(p, f"{c}: {how}") for p, c, how in self.computed]) + ")")
        if self.twins:
            parts.append(f"{len(self.twins)} of a node merged with another, given its own node again "
                         f"({_few(self.twins)})")
        if self.zero_bias:
            parts.append(f"{len(self.zero_bias)} zero bias(es) removed ({', '.join(self.zero_bias[:3])}"
                         f"{' ...' if len(self.zero_bias) > 3 else ''}), restored as zeros")
        text = ("torch.onnx.export had merged, folded or removed torch parameters (dynamo: optimize=True; "
                "TorchScript: do_constant_folding=True); each is an initializer of its own again, read where "
                "torch reads it: " + "; ".join(parts) + ". To skip this step, " + KEEP_HINT) if parts else ""
        if self.lost:  # the builder let them through: frozen
            text += (" " if text else "") + (
                f"{len(self.lost)} frozen torch parameter(s) stay as the exporter folded or merged them (their "
                f"value there is right while they do not train): {', '.join(list(self.lost)[:4])}"
                f"{' ...' if len(self.lost) > 4 else ''}")
        return text

    def lost_message(self, names: list[str]) -> str:
        """The error for lost parameters that would train (grouped by why)."""
        by_why: dict[str, list[str]] = {}
        for n in names:
            by_why.setdefault(self.lost[n], []).append(n)
        shown = "; ".join(f"{', '.join(ns[:4])}{' ...' if len(ns) > 4 else ''}: {why}"
                          for why, ns in list(by_why.items())[:6]) + ("; ..." if len(by_why) > 6 else "")
        record = ("; or, on the exported model, call onnx_training_ops.training.state.torch_names.record_torch_names("
                  "model, module), which gives them back from the module's values"
                  if any(n in self.by_value for n in names) else "")
        return (f"torch parameter(s) {', '.join(names[:6])}{' ...' if len(names) > 6 else ''} of this export would "
                f"not train as in torch (the exporter folded or merged them and they cannot be restored from "
                f"the model): {shown}. {KEEP_HINT[0].upper()}{KEEP_HINT[1:]}{record}; or leave them frozen "
                "(trainable=[...] without them, or a frozen param group)")


def _few(pairs: list[tuple[str, str]]) -> str:
    shown = ", ".join(f"{p} (was {s})" for p, s in pairs[:3])
    return shown + (f" and {len(pairs) - 3} more" if len(pairs) > 3 else "")


def _signature(graph: onnx.GraphProto) -> str | None:
    return next((p.value for p in graph.metadata_props if p.key == SIGNATURE_KEY), None)


def exported_parameters(graph: onnx.GraphProto) -> dict[str, str] | None:
    """Placeholder -> torch name of every ``PARAMETER`` in a dynamo export's graph signature;
    None when the graph carries no signature (not a dynamo export)."""
    text = _signature(graph)
    if text is None:
        return None
    return dict(re.findall(r"^(\w+): PARAMETER target='([^']+)'", text, flags=re.M))


def exported_buffers(graph: onnx.GraphProto) -> dict[str, tuple[str, bool]]:
    """Placeholder -> (torch name, persistent) of every ``BUFFER`` in the graph signature."""
    text = _signature(graph) or ""
    return {p: (name, rest.find("persistent=False") < 0)
            for p, name, rest in re.findall(r"^(\w+): BUFFER target='([^']+)'(.*)$", text, flags=re.M)}


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


@dataclass
class _FxOp:
    """One torch op of the exported program and the ONNX nodes made from it."""

    name: str  # its fx node name, also the name of its (first) output value
    aten: str
    args: list[str]
    module: str  # the qualified name of the module that ran it ("" for the root)
    nodes: list = field(default_factory=list)

    def param_args(self, params: dict[str, str]) -> list[tuple[int, str]]:
        return [(i, params[a[1:]]) for i, a in enumerate(self.args) if a.startswith("%") and a[1:] in params]

    def roles(self, params: dict[str, str]) -> dict[str, str]:
        return {role: params[self.args[i][1:]] for i, role in _ROLES.get(self.aten, {}).items()
                if i < len(self.args) and self.args[i].startswith("%") and self.args[i][1:] in params}

    def refs(self) -> list[str]:
        """The fx values it reads (``%name`` arguments, nested in lists too)."""
        return [r for a in self.args for r in re.findall(r"%(\w+)", a)]


def _fx_ops(graph: onnx.GraphProto) -> dict[str, _FxOp]:
    """Every torch op with the ONNX nodes made from it, by fx name."""
    ops: dict[str, _FxOp] = {}
    for node in graph.node:
        meta = {p.key: p.value for p in node.metadata_props}
        m = _FX_HEAD.match(meta.get(FX_NODE_KEY, ""))
        if not m:
            continue
        if m.group(1) not in ops:
            try:
                scopes = ast.literal_eval(meta.get(SCOPES_KEY, "[]"))
            except (ValueError, SyntaxError):
                scopes = []
            module = scopes[-2] if len(scopes) >= 2 and isinstance(scopes[-2], str) else ""
            ops[m.group(1)] = _FxOp(m.group(1), m.group(2), _split_args(m.group(3)), module)
        ops[m.group(1)].nodes.append(node)
    return ops


def _folded_from(graph: onnx.GraphProto) -> dict[str, list[str]]:
    """Folded constant -> the values it was computed from (the optimizer's record)."""
    out = {}
    for v in graph.value_info:
        for p in v.metadata_props:
            if p.key == FOLDED_KEY:
                try:
                    out[v.name] = list(ast.literal_eval(p.value))
                except (ValueError, SyntaxError):
                    pass
    return out


def _attr(node, name: str, default: int = 0) -> int:
    return next((a.i for a in node.attribute if a.name == name), default)


def _holds_transpose(aten: str, node) -> bool:
    """Whether the node's weight slot holds the torch weight transposed."""
    if node.op_type == "MatMul":
        return aten == "linear"
    if node.op_type == "Gemm":
        return bool(_attr(node, "transB")) != (aten == "linear")
    return False


def _slot(node, role: str, aten: str, g: GraphEdit) -> int | None:
    """The input index of ``node`` that plays ``role`` for the torch op (None: none here)."""
    if node.op_type == "Add" and role == "bias" and aten in ("linear", "addmm"):
        held = [i for i, n in enumerate(node.input) if n in g.inits]
        return held[0] if len(held) == 1 else None
    return _SLOTS.get(node.op_type, {}).get(role)


def _point_at(node, index: int, param: str, transpose: bool, g: GraphEdit, done: Restored) -> None:
    """Make input ``index`` of ``node`` read the parameter (creating it from the value the slot
    reads when the export lost it); a no-op when it already does. A kept parameter whose value
    differs from the slot's is lost (the slot stands in for it)."""
    source = node.input[index]
    if source == param:
        return
    value = g.value(source)
    value = value.T if transpose else value
    if param in g.inits:
        kept = g.value(param)
        if kept.shape != value.shape or not np.array_equal(kept, value):
            done.lost.setdefault(param, f"{node.op_type} node {node.name or node.output[0]!r} input {index} reads "
                                        f"{source!r} where torch reads it, and its value differs")
            done.stand_ins.setdefault(param, set()).add(source)
            return
    else:
        g.add_init(param, value)
        (done.untied if source in g.params else done.unfolded).append((param, source))
    g.replaced.add(source)
    node.input[index] = g.transpose_of(param) if transpose else param


def _zero_bias(aten: str, nodes: list, roles: dict[str, str], g: GraphEdit, done: Restored) -> bool:
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


def _folded_batch_norms(ops: dict[str, _FxOp], params: dict[str, str], g: GraphEdit, done: Restored) -> set[str]:
    """BatchNorms optimize=True folded into the convolution before them: the BatchNorm is gone and
    the convolution's weight (keeping torch's name) holds ``weight * gamma / sigma``; all lost."""
    folded = set()
    for op in ops.values():
        roles = op.roles(params)
        if "batch_norm" in op.aten and "weight" in roles and \
                not any(n.op_type == "BatchNormalization" for n in op.nodes):
            why = ("optimize=True folded this BatchNorm into the convolution before it: the BatchNorm is gone and "
                   "the convolution's weight holds weight * gamma / sigma")
            for name in [*roles.values(), *(i for n in op.nodes if n.op_type == "Conv" for i in n.input[1:]
                                             if i in g.params)]:
                done.lost.setdefault(name, why)
            folded.add(op.name)
    return folded


def _restore_slots(ops, params, skip: set[str], g: GraphEdit, done: Restored) -> None:
    """Step 1: each parameter back in the input slot its torch op reads it in."""
    for op in ops.values():
        if op.name in skip:
            continue
        roles = op.roles(params)
        for role, param in sorted(roles.items(), key=lambda kv: kv[0] != "weight"):  # weight first
            slots = [(n, i) for n in op.nodes for i in [_slot(n, role, op.aten, g)]
                     if i is not None and i < len(n.input) and n.input[i] in g.inits]
            for node, index in slots:
                _point_at(node, index, param, role == "weight" and _holds_transpose(op.aten, node), g, done)
            if not slots and role == "bias" and param not in g.inits:
                _zero_bias(op.aten, op.nodes, roles, g, done)
        if op.aten in _ELEMENTWISE and len(op.nodes) == 1 and op.nodes[0].op_type == _ELEMENTWISE[op.aten] \
                and len(op.nodes[0].input) == len(op.args):
            node = op.nodes[0]
            for i, param in op.param_args(params):
                if node.input[i] in g.inits and node.input[i] not in g.folded:
                    _point_at(node, i, param, False, g, done)


def _restore_vectors(ops, params, g: GraphEdit, done: Restored) -> None:
    """A norm's 1-D weight or bias folded into a reshaped constant inside the norm's own nodes
    (GroupNorm's ``[C, 1, 1]``): the parameter is that constant's values, reshaped back."""
    for op in ops.values():
        if not op.aten.startswith(_VECTOR_ROLES):
            continue
        for param in op.roles(params).values():
            if param in g.inits:
                continue
            for node in op.nodes:
                for i, name in enumerate(node.input):
                    if name in g.inits and [x for x in g.folded.get(name, ()) if not x.startswith("val_")] == [param]:
                        value = g.value(name)
                        if sum(d != 1 for d in value.shape) > 1:
                            continue
                        if param not in g.inits:
                            g.add_init(param, value.reshape(-1))
                            done.unfolded.append((param, name))
                        reshape = Recipe("select", (Step("Reshape", (np.asarray(value.shape, np.int64),)),), "reshaped")
                        node.input[i] = g.computed(reshape, param, f"{param}__reshaped")
                        g.replaced.add(name)


def _module_of(name: str) -> tuple[str, str]:
    module, _, leaf = name.rpartition(".")
    return module, leaf


def _common(a: str, b: str) -> int:
    n = 0
    for x, y in zip(a.split("."), b.split(".")):
        if x != y:
            break
        n += 1
    return n


def _restore_twins(ops, params, accounted: set[str], g: GraphEdit, done: Restored) -> set[str]:
    """Step 2: torch ops the optimizer merged into another node computing the same thing on the
    same input (their parameters were equal, so merged first). Their fx names still appear in
    the arguments of the ops that read them. Each gets a copy of the surviving node, reading the
    parameters of the module nearest to where it was read. Returns the fx names explained."""
    values = {n for node in g.graph.node for n in [*node.input, *node.output]} | set(g.inits) | \
        {v.name for v in g.graph.input}
    explained: set[str] = set()
    for consumer in list(ops.values()):
        for ref in consumer.refs():
            if ref in values or ref in explained or ref in params:
                continue
            survivor = next((s for s in ops.values() if s.aten == _fx_prefix(ref) and s.param_args(params)
                             and any(s.name in n.input for n in consumer.nodes)), None)
            if survivor is None or survivor.name in consumer.refs():
                continue
            module = _twin_module(survivor, consumer, params, accounted, g)
            if module is None:
                continue
            readers = [n for n in consumer.nodes if survivor.name in n.input]
            renamed = _add_twins(survivor, ref, module, accounted, g, done)
            for node in readers:
                for i, name in enumerate(node.input):
                    if name == survivor.name:
                        node.input[i] = renamed[survivor.name]
            explained.add(ref)
    return explained


def _twin_module(survivor, consumer, params, accounted: set[str], g: GraphEdit) -> str | None:
    """The module whose parameters a twin of ``survivor`` read where ``consumer`` reads it: the one
    nearest ``consumer``'s module among those holding every parameter leaf unaccounted for (None: no
    single one)."""
    leaves = {_module_of(p)[1] for _, p in survivor.param_args(params)}
    found = {_module_of(u)[0] for u in params.values() if u not in accounted and u not in g.inits
             and _module_of(u)[1] in leaves}
    modules = [m for m in found if all(f"{m}.{leaf}" in params.values() and f"{m}.{leaf}" not in accounted
                                       for leaf in leaves)]
    if not modules:
        return None
    best = max(_common(m, consumer.module) for m in modules)
    chosen = [m for m in modules if _common(m, consumer.module) == best]
    return chosen[0] if len(chosen) == 1 else None


def _add_twins(survivor, ref: str, module: str, accounted: set[str], g: GraphEdit, done: Restored) -> dict[str, str]:
    """Copies of ``survivor``'s nodes reading ``module``'s parameters (added as initializers),
    scheduled after it; the survivor's outputs -> the copies'."""
    renamed = {}
    for node in survivor.nodes:
        for out in node.output:
            renamed[out] = g.fresh(f"{ref}__restored" if out == survivor.name else f"{out}__{ref}")
    twins = []
    for node in survivor.nodes:
        twin = onnx.NodeProto()
        twin.CopyFrom(node)
        del twin.metadata_props[:]  # its fx_node names the survivor's parameters, not these
        twin.name = g.fresh(f"{node.name or node.output[0]}__{ref}")
        for i, name in enumerate(twin.input):
            if name in renamed:
                twin.input[i] = renamed[name]
            elif name in g.params:
                leaf = _module_of(name)[1]
                twin.input[i] = f"{module}.{leaf}"
                if twin.input[i] not in g.inits:
                    g.add_init(twin.input[i], g.value(name))
                    done.twins.append((twin.input[i], name))
                    accounted.add(twin.input[i])
        for i, name in enumerate(twin.output):
            twin.output[i] = renamed.get(name, name)
        twins.append(twin)
    g.after.setdefault(survivor.nodes[-1].output[0], []).extend(twins)
    return renamed


def _restore_folded(params: dict[str, str], buffers, g: GraphEdit, done: Restored) -> None:
    """Step 3: each folded constant computed from one parameter, computed from it again."""
    names = set(params.values())
    others = names | {b for b, _ in buffers.values()}
    for constant, sources in g.folded.items():
        if constant not in g.inits or not g.readers(constant):
            continue
        used = [s for s in sources if s in names]
        if not used:
            continue
        value = g.value(constant)
        shape = list(value.shape)
        if len(used) > 1:
            for p in used:
                done.lost.setdefault(p, f"folded with {', '.join(q for q in used if q != p)} into the constant "
                                        f"{constant!r} {shape}")
            continue
        param = used[0]
        try:
            if param in g.inits:
                recipe = find_recipe(value, g.value(param))
                why = "which no single computation on it gives"
            else:
                steps = [s for s in sources if not s.startswith("val_") and s not in others and s != constant]
                found = invert(value, constant) if not steps else None
                recipe = None
                if found is not None:
                    g.add_init(param, found[0])
                    recipe = found[1]
                why = ("the export holds no other copy of it" + (f" (it was computed with {', '.join(steps[:4])})"
                                                                  if steps else ""))
        except Ambiguous as error:
            recipe, why = None, f"computing it from the parameter is ambiguous: {error}"
        if recipe is None:
            done.lost.setdefault(param, f"folded into the constant {constant!r} {shape}, {why}")
            done.by_value.add(param)
            continue
        g.read_instead(constant, g.computed(recipe, param, f"{constant}__from_{param}"))
        done.computed.append((param, constant, recipe.text))


def restore_parameters(model: onnx.ModelProto, value: Callable[[onnx.TensorProto], np.ndarray] | None = None
                       ) -> Restored:
    """In place: every torch parameter of a dynamo export becomes an initializer of its own name
    read where torch reads it, where the export allows (see the module doc).

    Args:
        model: an inference model; untouched unless it is a dynamo export
            (``pkg.torch.export.ExportedProgram.graph_signature`` metadata).
        value: reads an initializer's values (a large model's detached arrays); default
            ``numpy_helper.to_array``.

    Returns:
        What was restored, and the parameters that could not be (``lost``, with why): the
        builder refuses to train those.
    """
    graph = model.graph
    params = exported_parameters(graph)
    done = Restored()
    if not params:
        return done
    g = GraphEdit(graph, set(params.values()), value or numpy_helper.to_array, _folded_from(graph))
    ops = _fx_ops(graph)
    if not ops:  # no fx_node metadata (another torch version): say what is missing, if anything
        missing = sorted(set(params.values()) - set(g.inits))
        if missing:
            warnings.warn(f"torch parameter(s) {', '.join(missing[:5])}{' ...' if len(missing) > 5 else ''} of this "
                          "dynamo export are not initializers of the model and its nodes do not say which torch op "
                          "read them: unused by the module, or merged/removed by the exporter's optimize=True (they "
                          f"would not train); {KEEP_HINT}", stacklevel=3)
        return done
    buffers = exported_buffers(graph)
    read = {p for op in ops.values() for _, p in op.param_args(params)}
    skip = _folded_batch_norms(ops, params, g, done)
    _restore_slots(ops, params, skip, g, done)
    _restore_vectors(ops, params, g, done)
    folded_params = {s for sources in g.folded.values() for s in sources if s in g.params}
    accounted = read | folded_params | set(g.inits)
    explained = _restore_twins(ops, params, accounted, g, done)
    _restore_folded(params, buffers, g, done)
    g.drop_replaced()
    _account_unread(ops, params, accounted, explained, g, done)
    for p in sorted(read):
        if p not in g.inits and p not in done.lost:
            done.lost[p] = "read by a torch op whose node does not take it in a slot this step knows"
            done.stand_ins.setdefault(p, set()).update(  # another parameter's initializer, merged
                i for op in ops.values() if p in dict(op.param_args(params)).values()
                for n in op.nodes for i in n.input if i in g.params and i in g.inits
                and i not in dict(op.param_args(params)).values())
    _record_names(model, params, buffers, done)
    return done


def _account_unread(ops, params, accounted: set[str], explained: set[str], g: GraphEdit, done: Restored) -> None:
    """Step 4: a parameter no node reads is another name of one that is read (a tie: the module
    that owns it ran its op on the other), or unused by forward; or, where the optimizer removed
    torch ops it cannot account for, possibly merged away: lost."""
    unread = [p for p in params.values() if p not in accounted and p not in g.inits]
    if not unread:
        return
    for op in ops.values():
        for role, param in op.roles(params).items():
            alias = f"{op.module}.{role}" if op.module else role
            if alias in unread and alias != param and param in g.inits:
                done.aliases[alias] = param
    values = {n for node in g.graph.node for n in [*node.input, *node.output]} | set(g.inits) | \
        {v.name for v in g.graph.input}
    folded = {s for sources in g.folded.values() for s in sources} | set(g.folded)
    removed = sorted({r for op in ops.values() for r in op.refs()
                      if r not in values and r not in params and r not in folded and r not in explained
                      and _fx_prefix(r) not in _BENIGN})
    for p in unread:
        if p in done.aliases or p in done.lost:
            continue
        if removed:
            done.lost[p] = (f"no node of the export reads it, and the exporter's optimizer removed torch op(s) "
                            f"{', '.join(removed[:4])} that may have read it (merged with an equal one)")
        else:
            done.unused.append(p)


def _record_names(model: onnx.ModelProto, params: dict[str, str], buffers, done: Restored) -> None:
    """The torch-name record (:mod:`.torch_record`) gets every parameter and persistent buffer
    the model holds, under its own name, with the other names of a tie."""
    inits = {t.name for t in model.graph.initializer}
    record = read_record(model)
    made = record is None
    record = {k: v for k, v in (record or {}).items() if k in inits or v.get("alias_of") in inits}
    known = {n for entry in record.values() for n in entry["torch"]}
    keep = [*params.values(), *(name for name, persistent in buffers.values() if persistent)]
    for name in keep:
        if name in inits and name not in known:  # restored here (the record's entry was the folded copy's)
            record[name] = {"torch": [name], "transpose": False}
            known.add(name)
    for alias, param in done.aliases.items():
        entry = next((e for k, e in record.items() if param in e["torch"]), None)
        if entry is not None and alias not in entry["torch"]:
            entry["torch"].append(alias)
    if made or record != read_record(model):
        write_record(model, record, RECORD_KEY)
