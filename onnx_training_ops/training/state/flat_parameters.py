"""The parameters as one flat vector: onnxruntime-training's ``get_contiguous_parameters``,
``get_parameters_size`` and ``copy_buffer_to_parameters`` (federated averaging, shipping weights).

Order: the trainables in the model's trainable order (the builder's ``trainable`` metadata;
for an imported onnxruntime-training model the order its eval model declares them, which is
theirs), and with ``trainable_only=False`` every parameter, trainable or not, in the order of
the main graph's initializers (float initializers of rank >= 1: constants such as shapes and
scalars are not parameters). One dtype per vector.

Zero copy: :func:`lay_out_flat` re-homes the trainables as consecutive views of one buffer
when nothing laid them out yet (the fast path lays out each optimizer node's own), so
:func:`contiguous` finds that buffer and ``get_flat_parameters(copy=False)`` returns it live.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import onnx

from ...errors import TrainingOpError


def parameter_names(model: onnx.ModelProto, trainable: Sequence[str], trainable_only: bool) -> list[str]:
    """The names in the flat vector, in its order (see the module docstring)."""
    if trainable_only:
        return list(trainable)
    floats = (onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16)
    return [t.name for t in model.graph.initializer
            if t.name in trainable or (t.data_type in floats and len(t.dims) >= 1)]


def _dtype(arrays: Sequence[np.ndarray], names: Sequence[str], what: str) -> np.dtype:
    dtypes = {np.dtype(a.dtype) for a in arrays}
    if len(dtypes) != 1:
        kinds = {n: str(a.dtype) for n, a in zip(names, arrays)}
        raise TrainingOpError(f"{what}: the parameters have more than one dtype ({kinds}); a flat vector "
                              "holds one: take them by name (state_dict)")
    return dtypes.pop()


def contiguous(arrays: Sequence[np.ndarray]) -> np.ndarray | None:
    """The 1-D buffer ``arrays`` are consecutive views of, covering it exactly; or None."""
    if not arrays:
        return None
    base = arrays[0].base
    if base is None or base.ndim != 1 or not base.flags.c_contiguous or base.dtype != arrays[0].dtype:
        return None
    position = base.__array_interface__["data"][0]
    for a in arrays:
        if a.base is not base or not a.flags.c_contiguous or a.__array_interface__["data"][0] != position:
            return None
        position += a.nbytes
    return base if position == base.__array_interface__["data"][0] + base.nbytes else None


def flat_copy(arrays: Sequence[np.ndarray], names: Sequence[str], what: str) -> np.ndarray:
    """A new 1-D array: ``arrays`` raveled one after the other."""
    dtype = _dtype(arrays, names, what)
    out = np.empty(sum(a.size for a in arrays), dtype)
    position = 0
    for a in arrays:
        out[position:position + a.size] = a.reshape(-1)
        position += a.size
    return out


def split_into(buffer, targets: Mapping[str, np.ndarray], what: str) -> dict[str, np.ndarray]:
    """``buffer`` cut into arrays shaped like ``targets`` (in their order), checked: a 1-D
    vector of their dtype and total size. Returns name -> view of ``buffer``."""
    buffer = np.asarray(buffer)
    names, arrays = list(targets), list(targets.values())
    dtype = _dtype(arrays, names, what)
    size = sum(a.size for a in arrays)
    if buffer.ndim != 1 or buffer.size != size or buffer.dtype != dtype:
        raise TrainingOpError(f"{what}: expected a 1-D {dtype} vector of {size} elements "
                              f"({len(names)} parameters), found {buffer.dtype} of shape {list(buffer.shape)}")
    out, position = {}, 0
    for name, a in zip(names, arrays):
        out[name] = buffer[position:position + a.size].reshape(a.shape)
        position += a.size
    return out


def lay_out_flat(state: dict[str, np.ndarray], names: Sequence[str]) -> np.ndarray | None:
    """Re-home ``state[name]`` for ``names`` as consecutive views of one new buffer, when they
    share a dtype and none is a view of another buffer already (a fast-path layout is kept).
    Call before anything binds the arrays. Returns the buffer, or None when left as they were."""
    arrays = [state[n] for n in names]
    if not arrays or contiguous(arrays) is not None:
        return contiguous(arrays)
    if len({a.dtype for a in arrays}) != 1 or any(a.base is not None for a in arrays):
        return None
    buffer = flat_copy(arrays, names, "lay_out_flat")
    for name, view in split_into(buffer, dict(zip(names, arrays)), "lay_out_flat").items():
        state[name] = view
    return buffer

