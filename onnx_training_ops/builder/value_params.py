"""Constants an exporter computed from parameters, found by value and computed from them again.

Two places know the values a folded constant was computed from without the dynamo export's
own record of it:

* :func:`restore_copies` (the builder, on any export without a dynamo signature): the
  TorchScript exporter's ``do_constant_folding=True`` (its default) turns ``Transpose``
  and ``Reshape`` of a weight into a new initializer (``onnx::MatMul_398``). Where the weight
  is read elsewhere too (a tied head: ``emb(ids) @ emb.weight.t()``, OPT's and GPT-2's
  ``lm_head``), the copy would train apart from it, or not at all. A float initializer named
  by the exporter that equals a transpose or reshape of an initializer named as a parameter
  is read as that computation on the parameter again.
* :func:`restore_from_values` (``record_torch_names(model, module)``, with torch's values):
  every parameter no initializer holds is searched for among the exporter's constants, by
  every recipe of :mod:`.folded_params` (embedding rows looked up with constant ids, a class
  token broadcast to the batch, ``exp(log_s)``...), and given back as an initializer of its
  own with the computation read from it. So are folded copies of the parameters the model
  holds.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import numpy as np
import onnx
from onnx import numpy_helper

from .folded_params import Ambiguous, Recipe, find_recipe
from .graph_edit import GraphEdit

FLOAT_TYPES = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16,
               onnx.TensorProto.BFLOAT16)


def exporter_named(name: str) -> bool:
    """A name the exporters make up (``onnx::MatMul_398``, ``/layer/Constant_output_0``, ``val_3``)."""
    return name.startswith(("/", "val_")) or "::" in name


def _could_be(c: np.ndarray, p: np.ndarray, numeric: bool) -> bool:
    """A cheap look at shapes (and one value) before :func:`find_recipe` looks closely."""
    if c.dtype != p.dtype or p.size == 0 or c.size == 0:
        return False
    row = int(np.prod(p.shape[1:], dtype=np.int64)) if p.ndim else 1
    if (c.size % max(row, 1) == 0 or c.size % p.size == 0) and bool((p == c.flat[0]).any()):
        return True  # rows of it, or all of it moved or broadcast
    return numeric and p.ndim <= 4 and (c.shape == p.shape or c.ndim <= p.ndim) and c.size <= p.size


def _fingerprint(a: np.ndarray) -> tuple[int, float, float, float]:
    """(size, min, max, sum): the same for tensors holding the same values in any order (the
    sum to float64 summation's rounding, :func:`_same_values`); cheap, no copy."""
    return a.size, float(a.min()), float(a.max()), float(a.sum(dtype=np.float64))


def _same_values(x: tuple, y: tuple) -> bool:
    scale = max(abs(x[1]), abs(x[2]), 1e-30) * x[0]
    return x[:3] == y[:3] and abs(x[3] - y[3]) <= 1e-9 * scale


def _search(c: np.ndarray, params: Mapping[str, np.ndarray], numeric: bool) -> tuple[str, Recipe] | None:
    """The one parameter ``c`` was computed from, and how (None: none; Ambiguous: several)."""
    found = []
    for name, p in params.items():
        if not _could_be(c, p, numeric):
            continue
        recipe = find_recipe(c, p)
        if recipe is not None and (numeric or recipe.kind == "select"):
            found.append((name, recipe))
    if len(found) > 1:
        raise Ambiguous(f"it can be computed from {', '.join(n for n, _ in found[:3])}")
    return found[0] if found else None


def restore_copies(model: onnx.ModelProto, value: Callable[[onnx.TensorProto], np.ndarray] | None = None
                   ) -> list[tuple[str, str, str]]:
    """In place: each exporter-named float initializer that is a transpose or reshape of an
    initializer named as a parameter is computed from that parameter (see the module doc).
    Returns ``(parameter, constant, how)`` for each; a constant whose parameter has repeated
    values (which element is which cannot be told) is left as it is."""
    graph = model.graph
    inits = [t for t in graph.initializer if t.data_type in FLOAT_TYPES and t.dims]
    params = [t for t in inits if not exporter_named(t.name)]
    constants = [t for t in inits if exporter_named(t.name)]
    if not params or not constants:
        return []
    g = GraphEdit(graph, {t.name for t in params}, value or numpy_helper.to_array)
    by_size: dict[int, list[str]] = {}
    for t in params:
        by_size.setdefault(int(np.prod(t.dims)), []).append(t.name)
    prints: dict[str, tuple] = {}
    done = []
    for t in constants:
        size = int(np.prod(t.dims))
        if size not in by_size or not g.readers(t.name):
            continue
        c = g.value(t.name)
        mark = _fingerprint(c)  # a transpose or reshape holds the same values: same sums
        for n in by_size[size]:
            if n not in prints:
                prints[n] = _fingerprint(g.value(n))
        candidates = {n: g.value(n) for n in by_size[size] if _same_values(prints[n], mark)}
        if not candidates:
            continue
        try:
            hit = _search(c, candidates, numeric=False)
        except Ambiguous:
            continue
        if hit is None or not hit[1].steps:  # an equal copy: the TorchScript exporter's aliases are untie's
            continue
        g.read_instead(t.name, g.computed(hit[1], hit[0], f"{t.name}__from_{hit[0]}"))
        done.append((hit[0], t.name, hit[1].text))
    g.drop_replaced()
    return done


def restore_from_values(model: onnx.ModelProto, values: Mapping[str, np.ndarray], missing: list[str],
                        constants: list[str], value: Callable[[onnx.TensorProto], np.ndarray] | None = None
                        ) -> tuple[list[tuple[str, str, str]], dict[str, str]]:
    """In place: the parameters ``missing`` (no initializer holds them) become initializers of
    their torch names with ``values``, and each of ``constants`` computed from one of
    ``values`` (missing or held) is computed from it again.

    Args:
        model: the exported model.
        values: torch's parameters, ``{torch name: array}`` (an initializer named as one holds it).
        missing: the names of ``values`` that no initializer holds.
        constants: the initializers the exporter made, to search.
        value: reads an initializer's values.

    Returns:
        ``([(parameter, constant, how)], {missing parameter not found: why})``.
    """
    graph = model.graph
    g = GraphEdit(graph, set(values), value or numpy_helper.to_array)
    arrays = {n: np.asarray(v) for n, v in values.items()}
    done, added = [], set()
    for name in constants:
        if name not in g.inits or not g.readers(name) or g.inits[name].data_type not in FLOAT_TYPES:
            continue
        try:
            hit = _search(g.value(name), arrays, numeric=True)
        except Ambiguous:
            continue
        if hit is None:
            continue
        param, recipe = hit
        if param not in g.inits:
            if param not in missing:
                continue  # held under another name (transposed by the exporter): torch_name_map's
            g.add_init(param, arrays[param])
            added.add(param)
        g.read_instead(name, g.computed(recipe, param, f"{name}__from_{param}"))
        done.append((param, name, recipe.text))
    g.drop_replaced()
    lost = {n: ("no initializer holds its values or a computation on them (unused by forward, or folded "
                "by the exporter into a constant with other values)") for n in missing if n not in added}
    return done, lost


def folded_conv_weights(model: onnx.ModelProto, record: Mapping[str, dict] | None) -> dict[str, str]:
    """``{initializer: why}`` for the weights and biases of ``Conv``/``ConvTranspose`` nodes that
    are initializers the exporter named and that no torch name is recorded for: a computation on
    torch's weights, not a parameter of torch's. The TorchScript exporter's
    ``do_constant_folding=True`` folds an eval-mode BatchNorm into the convolution before it
    (weight ``W * gamma / sigma``, a new bias), keeping neither the convolution's weight nor
    the BatchNorm's parameters; trained, the folded tensor would not train as torch's do."""
    inits = {t.name for t in model.graph.initializer}
    out = {}
    for node in model.graph.node:
        if node.op_type not in ("Conv", "ConvTranspose") or node.domain not in ("", "ai.onnx"):
            continue
        for name in node.input[1:3]:
            if name in inits and exporter_named(name) and name not in (record or {}):
                out[name] = (f"{node.op_type} node {node.name or node.output[0]!r} reads {name!r}, a tensor the "
                             "exporter computed from torch's weights (an eval-mode BatchNorm folded into the "
                             "convolution by do_constant_folding=True), not a torch parameter")
    return out
