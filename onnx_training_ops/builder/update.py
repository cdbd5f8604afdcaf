"""The update in the algorithm graph: learning rates, T + 1, one Gradient node, clipping, the optimizers."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
from onnx import TensorProto, helper, numpy_helper

from ..errors import TrainingOpError
from ..schema import DOMAIN
from . import sparse_updates as sparse_updates_
from .algorithm import Algorithm, tensor_vi
from .emit_update import emit_update
from .grad_clip import clip_by_global_norm, clip_by_value
from .loss_scaling import LossScaler
from .ops import Ops
from .padding_rows import mask_lookup
from .param_groups import Group


def add_learning_rates(groups: list[Group], params, algo: Algorithm) -> None:
    """R of each group: a scalar input whose initializer holds the group's ``lr`` (schedules
    feed it); double when every trainable is double (exact float64 learning rates), else float."""
    r_double = all(p.data_type == TensorProto.DOUBLE for p in params)
    r_type, r_dtype = (TensorProto.DOUBLE, np.float64) if r_double else (TensorProto.FLOAT, np.float32)
    for group in groups:
        if group.learning_rate in algo.taken:
            raise TrainingOpError(f"the learning-rate input name {group.learning_rate!r} is already "
                                  "used in the model")
        algo.taken.add(group.learning_rate)
        algo.inputs.append(tensor_vi(group.learning_rate, r_type, []))
        algo.inits.append(numpy_helper.from_array(np.array(group.optimizer.lr, r_dtype),
                                                  group.learning_rate))


def _clip(grads: list[str], params, clip_grad_norm, clip_grad_value, algo: Algorithm) -> tuple[list[str], str]:
    """Clipping between the Gradient node and the optimizers (:mod:`.grad_clip`): by value,
    then by global norm (an output, ``grad_norm``, as torch's return value)."""
    dtypes = [helper.tensor_dtype_to_np_dtype(p.data_type) for p in params]
    if clip_grad_value is not None:
        nodes, grads = clip_by_value(grads, dtypes, clip_grad_value, algo.name)
        algo.nodes += nodes
    norm_name = ""
    if clip_grad_norm is not None:
        norm_name = algo.name("grad_norm")
        nodes, grads = clip_by_global_norm(grads, dtypes, clip_grad_norm, algo.name, norm_name)
        algo.nodes += nodes
        algo.outputs.append(tensor_vi(norm_name, params[0].data_type, []))
    return grads, norm_name


def _decoupled_decay(group: Group, params, r_type: int, algo: Algorithm) -> list[str]:
    """AdamW: ``X * (1 - R*w)`` for each parameter of ``group`` (the Adam node reads these)."""
    w = group.optimizer.decoupled_weight_decay
    r_dtype = helper.tensor_dtype_to_np_dtype(r_type)
    one, decay = algo.name(f"{group.learning_rate}.one"), algo.name(f"{group.learning_rate}.weight_decay")
    rw, keep = algo.name(f"{group.learning_rate}.decay"), algo.name(f"{group.learning_rate}.keep")
    algo.inits += [numpy_helper.from_array(np.array(1.0, r_dtype), one),
                   numpy_helper.from_array(np.array(w, r_dtype), decay)]
    algo.nodes += [helper.make_node("Mul", [group.learning_rate, decay], [rw], name=rw),
                   helper.make_node("Sub", [one, rw], [keep], name=keep)]
    by_name = {p.name: p for p in params}
    out = []
    for p in group.params:
        factor = keep
        if by_name[p].data_type != r_type:
            factor = algo.name(f"{keep}.{p}")
            algo.nodes.append(helper.make_node("Cast", [keep], [factor], to=by_name[p].data_type, name=factor))
        decayed = algo.name(f"{p}.decayed")
        algo.nodes.append(helper.make_node("Mul", [p, factor], [decayed], name=decayed))
        out.append(decayed)
    return out


def add_update(params, groups: list[Group], loss_name: str, t_name: str, clip_grad_norm,
            clip_grad_value, algo: Algorithm,
            tables: Sequence[sparse_updates_.Table] = (),
            scaler: LossScaler | None = None,
            padding: Mapping[str, int] | None = None) -> tuple[dict[str, dict[str, str]], str]:
    """T <- T + 1, one Gradient node for all ``params``, clipping, and one optimizer update
    per group (:func:`.emit_update.emit_update`: one multi-tensor node of the domain, or
    standard ops for RMSProp); every new value bound to its state. ``tables``
    (:mod:`.sparse_updates`) are differentiated at their lookups and updated by rows, the
    ``padding`` row of a table (:mod:`.padding_rows`) with a zero gradient.
    Returns each parameter's optimizer state variables (``{param: {state: name}}``, in the
    optimizer's state order) and the name of
    the norm before clipping ("" without clip_grad_norm). With a ``scaler``
    (:mod:`.loss_scaling`) the Gradient differentiates the scaled loss, the gradients are
    unscaled before clipping and every new state value is kept only when they are finite."""
    t_new, one = algo.name("optimizer.T.new"), algo.name("optimizer.one")
    algo.inits.append(numpy_helper.from_array(np.array(0, np.int64), t_name))
    algo.inits.append(numpy_helper.from_array(np.array(1, np.int64), one))
    algo.nodes.append(helper.make_node("Add", [t_name, one], [t_new],
                                       name=algo.name("optimizer/T_increment")))

    by_rows = {tb.name: tb for tb in tables}
    if by_rows and (clip_grad_norm is not None or clip_grad_value is not None):
        raise TrainingOpError("gradient clipping with sparse_updates is not supported: the table "
                              f"gradients of {sorted(by_rows)} are rows, not tensors")
    p_names = [p.name for p in params]
    xs = [n for n in p_names if n not in by_rows] + [o for tb in tables for _, o in tb.lookups]
    raw = {x: algo.name(f"{x}.grad") for x in xs}
    if scaler is not None and by_rows:
        raise TrainingOpError(f"loss scaling with sparse_updates is not supported: the table gradients of "
                              f"{sorted(by_rows)} are rows; build with loss_scaling=False or without sparse_updates")
    y = loss_name if scaler is None else scaler.scaled_loss(loss_name)
    algo.nodes.append(helper.make_node("Gradient", xs, list(raw.values()), domain=DOMAIN, xs=xs,
                                       y=y, name=algo.name("gradient")))
    dense = [p for p in params if p.name not in by_rows]
    grads = [raw[p.name] for p in dense]
    if scaler is not None:
        grads = scaler.unscale(grads, [p.data_type for p in dense])
    clipped, norm_name = _clip(grads, dense, clip_grad_norm, clip_grad_value, algo)
    grad_of = dict(zip((p.name for p in dense), clipped))
    by_name = {p.name: p for p in params}
    r_type = next(vi for vi in algo.inputs if vi.name == groups[0].learning_rate).type.tensor_type.elem_type
    t_input = {True: t_new, False: t_name}

    def bind(state: str, new: str, elem_type: int, dims) -> None:
        algo.bind(state, new if scaler is None else scaler.gated(state, new), elem_type, dims)

    state_names: dict[str, dict[str, str]] = {p: {} for p in p_names}
    for group in groups:
        optimizer, names = group.optimizer, group.params
        states = {s: [algo.name(f"{p}.{s}") for p in names] for s in optimizer.states}
        new_params = {p: algo.name(f"{p}.new") for p in names}
        new_states = {s: [algo.name(f"{p}.{s}.new") for p in names] for s in optimizer.states}
        ops = Ops(algo.name, algo.nodes, "optimizer")
        label = "" if len(groups) == 1 else f"/{group.name}"
        t = t_input[bool(optimizer.t_offset)]
        rows = [i for i, p in enumerate(names) if p in by_rows]
        cols = [i for i, p in enumerate(names) if p not in by_rows]
        if cols:
            dense_names = [names[i] for i in cols]
            decoupled = getattr(optimizer, "decoupled_weight_decay", 0.0)
            sub = Group(group.name, optimizer, dense_names, group.learning_rate)
            xs_in = _decoupled_decay(sub, params, r_type, algo) if decoupled else dense_names
            emit_update(ops, optimizer, group.learning_rate, t, xs_in, [grad_of[p] for p in dense_names],
                        {s: [v[i] for i in cols] for s, v in states.items()},
                        [new_params[p] for p in dense_names],
                        {s: [v[i] for i in cols] for s, v in new_states.items()},
                        [helper.tensor_dtype_to_np_dtype(by_name[p].data_type) for p in dense_names],
                        label=label)
        for i in rows:
            tb = by_rows[names[i]]
            if getattr(optimizer, "decoupled_weight_decay", 0.0):
                raise TrainingOpError(f"sparse_updates of {tb.name!r}: AdamW's decoupled weight decay "
                                      "is not supported on row updates; use Adam(weight_decay=...)")
            row = (padding or {}).get(tb.name)
            grads = [raw[o] if row is None else mask_lookup(ops, ids, raw[o], row, tb.dims, tb.dtype)
                     for ids, o in tb.lookups]
            unique, grad_rows = sparse_updates_.gradient_rows(ops, tb, grads)
            sparse_updates_.emit_table_update(ops, optimizer, tb, group.learning_rate, t, unique, grad_rows,
                                              {s: v[i] for s, v in states.items()}, new_params[names[i]],
                                              {s: v[i] for s, v in new_states.items()})
        for p in names:
            bind(p, new_params[p], by_name[p].data_type, by_name[p].dims)
        for s in optimizer.states:
            for p, state, new in zip(names, states[s], new_states[s]):
                bind(state, new, by_name[p].data_type, by_name[p].dims)
                state_names[p][s] = state
    bind(t_name, t_new, TensorProto.INT64, [])
    if scaler is not None:
        scaler.finish()
    return state_names, norm_name
