"""State variables: find them in ``training_info``; assign them with dtype and shape checks;
run the initialization graphs."""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np
import onnx
from onnx import helper, numpy_helper

from ...errors import TrainingOpError
from ...storage.checkpoint import damaged
from ...storage.external_data import digest, read_into
from ...storage.large_model import LargeModel
from ...storage.tensors import graphs_with_tensors, is_constant_fill, location
from ..arrays import dtype_name, owned


def collect_state_protos(model: onnx.ModelProto) -> dict[str, onnx.TensorProto]:
    """The initializer of every state variable (a key of an update or initialization binding).

    Checks each binding as the spec asks: the key is an initializer, the value an output, and
    no key is updated twice.
    """
    state_protos: dict[str, onnx.TensorProto] = {}
    main_inits = {t.name: t for t in model.graph.initializer}
    keys_seen: dict[str, str] = {}
    for i, info in enumerate(model.training_info):
        algo_inits = {t.name: t for t in info.algorithm.initializer}
        algo_outputs = {o.name for o in info.algorithm.output} | {o.name for o in model.graph.output}
        init_outputs = {o.name for o in info.initialization.output}
        for kind, binding, values in (
            ("update_binding", info.update_binding, algo_outputs),
            ("initialization_binding", info.initialization_binding, init_outputs),
        ):
            for entry in binding:
                where = f"training_info[{i}].{kind}"
                if entry.key in main_inits:
                    proto = main_inits[entry.key]
                elif entry.key in algo_inits:
                    proto = algo_inits[entry.key]
                else:
                    raise TrainingOpError(
                        f"{where}: key {entry.key!r} is not an initializer of the main graph or of "
                        f"training_info[{i}].algorithm; a state variable must be one"
                    )
                if entry.value not in values:
                    graph = "algorithm graph or the main graph" if kind == "update_binding" else "initialization graph"
                    raise TrainingOpError(
                        f"{where}: {entry.key!r} <- {entry.value!r}: {entry.value!r} is not an output of the {graph}"
                    )
                if kind == "update_binding":
                    if entry.key in keys_seen:
                        raise TrainingOpError(
                            f"{where}: state variable {entry.key!r} is bound twice (also in {keys_seen[entry.key]}); "
                            "the spec allows each key once"
                        )
                    keys_seen[entry.key] = where
                state_protos.setdefault(entry.key, proto)
    return state_protos


def assign(state: dict[str, np.ndarray], name: str, value: np.ndarray, what: str) -> None:
    """Copy ``value`` into the state variable ``name`` (same dtype and shape required)."""
    target = state[name]
    value = np.asarray(value)
    if value.dtype != target.dtype or value.shape != target.shape:
        raise TrainingOpError(
            f"{what}: state variable {name!r} is {dtype_name(target.dtype)} {list(target.shape)}, "
            f"the value is {dtype_name(value.dtype)} {list(value.shape)}"
        )
    np.copyto(target, value)



def state_array(name: str, proto: onnx.TensorProto, model: LargeModel | None = None,
                expected: str | None = None, where: str = "the model") -> np.ndarray:
    """A new array the session owns holding the value of state variable ``name`` (a
    TrainingOpError when its data is malformed or, with ``expected``, does not match that
    SHA-256). Values outside the message (``model``'s arrays) are read once: a
    memory-mapped file by ``readinto`` into the new array, hashed on the way (its pages are
    never mapped into the process, so this array is the one copy); a constant fill (a
    builder's optimizer state) as ``np.full`` (zeros: pages the OS gives on first write)."""
    try:
        if model is None or location(proto) is None:
            value, got = owned(numpy_helper.to_array(proto)), expected  # checked with the message
        else:
            source = model.array(proto)
            if isinstance(source, np.memmap) and source.filename is not None:
                hasher = hashlib.sha256() if expected else None
                value = read_into(source.filename, source.offset, np.empty(source.shape, source.dtype), hasher)
                got = hasher.hexdigest() if hasher is not None else None
            elif is_constant_fill(source):
                fill = source.reshape(-1)[0]
                value = np.zeros(source.shape, source.dtype) if not fill else np.full(source.shape, fill, source.dtype)
                got = digest(value) if expected else None
            else:
                value = owned(source)
                got = digest(value) if expected else None
    except (ValueError, TypeError) as error:  # e.g. raw data of the wrong size for its dims
        raise TrainingOpError(f"state variable {name!r}: its stored data does not match its "
                              f"type and shape {list(proto.dims)}: {error}") from None
    if expected and got != expected:
        raise damaged(where, name)
    return value


def run_initialization(model: onnx.ModelProto, state: dict[str, np.ndarray],
                       sessions: list, open_session: Callable[[onnx.ModelProto], Any]) -> None:
    """Run every TrainingInfoProto's initialization graph and assign its outputs by
    ``initialization_binding``. ``sessions`` caches the opened sessions (filled on first call)."""
    if not sessions:
        for info in model.training_info:
            if not info.initialization_binding:
                sessions.append(None)
                continue
            init = helper.make_model(info.initialization, opset_imports=list(model.opset_import))
            init.ir_version = model.ir_version
            init.functions.extend(model.functions)
            sessions.append(open_session(init))
    for info, session in zip(model.training_info, sessions):
        if session is None:
            continue
        names = [e.value for e in info.initialization_binding]
        for entry, value in zip(info.initialization_binding, session.run(names, {})):
            assign(state, entry.key, value, f"initialization_binding {entry.key!r} <- {entry.value!r}")


def state_tensors(model: LargeModel, protos: Mapping[str, onnx.TensorProto], expected: Mapping[str, str],
                  where: str) -> dict[str, np.ndarray]:
    """Every state variable as an array the session owns (:func:`state_array`), and the
    detached constants of ``model`` checked against ``expected`` (name -> SHA-256 of the
    values, from the checkpoint's record) as they stay: read where they lie, once."""
    state = {name: state_array(name, proto, model, expected.get(name), where) for name, proto in protos.items()}
    for graph in graphs_with_tensors(model.model_proto):
        for tensor in graph.initializer:
            if tensor.name not in protos and tensor.name in expected and \
                    digest(model.array(tensor)) != expected[tensor.name]:
                raise damaged(where, tensor.name)
    return state


def reset_state(state: dict[str, np.ndarray], name: str, proto: onnx.TensorProto, model: LargeModel) -> None:
    """Write the initial value of state variable ``name`` (its tensor in ``model``) into its
    array, in place (a memory-mapped source is read straight into it)."""
    source = model.array(proto)
    target = state[name]
    if isinstance(source, np.memmap) and source.filename is not None and target.flags.c_contiguous:
        read_into(source.filename, source.offset, target)
    else:
        np.copyto(target, source)


def zero_fill(model: LargeModel, proto: onnx.TensorProto) -> bool:
    """True for a state tensor that is a constant fill of zeros (a builder's fresh V or H):
    its array is zeros the OS has not given pages to yet."""
    if location(proto) is None:
        return False
    source = model.array(proto)
    return is_constant_fill(source) and not source.reshape(-1)[0]
