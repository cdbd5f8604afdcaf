"""Opening the engine: the model read and checked, then its parts made in order.

:func:`open_parts` is everything ``TrainingSession(...)`` does after checking its arguments, and
what it does again when new constant values reopen it: state store (in the memory the
configuration selects), programs (through its update strategy), loop, checkpointer.
"""

from __future__ import annotations

import os
from dataclasses import replace

import numpy as np
import onnx

from ...builder.metadata import TrainingMetadata
from ...errors import TrainingOpError
from ...kernels.compile_notice import announce_compiles
from ...runtime.options import default_intra_op_threads
from ...runtime.session import InferenceSession
from ...storage import checkpoint
from ...storage.large_model import detach
from ...storage.model_files import ModelLike, as_model
from ..options.precision import check_precision
from ..state.nominal import materialize, nominal_names
from ..state.state import collect_state_protos, state_tensors
from .config import RuntimeConfig
from .files import Checkpointer
from .loop import TrainingLoop
from .programs import SessionPrograms
from .store import StateStore

# float TensorProto types (a hand-written model's trainables: its float state variables)
_FLOATS = {onnx.TensorProto.FLOAT, onnx.TensorProto.DOUBLE, onnx.TensorProto.FLOAT16, onnx.TensorProto.BFLOAT16}


def check_threads(threads, sess_options) -> None:
    """``threads``: None or an int >= 0 that ``sess_options`` does not contradict."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 0:
        raise TrainingOpError(f"threads must be a whole number >= 0 (0: onnxruntime's choice), found {threads!r}")
    given = sess_options.intra_op_num_threads if sess_options is not None else 0
    if given not in (0, threads):
        raise TrainingOpError(f"threads={threads} but sess_options.intra_op_num_threads is {given}: "
                              "pass one of them")


def open_parts(model_or_path: ModelLike, config: RuntimeConfig
               ) -> tuple[StateStore, SessionPrograms, TrainingLoop, Checkpointer]:
    """Read, check and open a training model or checkpoint into a session's parts.

    Args:
        model_or_path: a ModelProto, LargeModel, path or bytes of a training model or checkpoint.
        config: the caller's runtime choices (providers already checked).

    Returns:
        (state store, programs, loop, checkpointer), the state at the model's initializers (a
        nominal checkpoint's: optimizer state initialized, parameters waiting for values).

    Raises:
        TrainingOpError: a model without ``training_info``, or a damaged or mismatched checkpoint.
    """
    path = model_or_path if isinstance(model_or_path, (str, os.PathLike)) else None
    opened = as_model(model_or_path)
    # values outside the message are checked as they are read (each once): state_tensors
    expected = checkpoint.verify(opened, path, data=False)
    if not opened.proto.training_info:
        raise TrainingOpError(
            "the model has no training_info: build one with onnx_training_ops.build_training_model, or use "
            "TrainingSession.from_graph for a plain graph with explicit state inputs and outputs"
        )
    meta = TrainingMetadata.from_model(opened.proto)  # parsed (and checked) once
    empty = nominal_names(meta)
    if empty:  # a nominal checkpoint: zeros until the parameters are loaded
        opened = opened.with_proto(materialize(opened.to_proto()))
    large = opened.remeasured().large
    # the session's own message stays small: every big tensor is an array beside it
    model = detach(opened)
    del opened
    meta = replace(meta, nominal=())  # materialized
    check_precision(meta, [p[0] if isinstance(p, tuple) else p for p in config.providers])
    protos = collect_state_protos(model.model_proto)
    arrays = state_tensors(model, protos, expected, f"checkpoint {os.fspath(path)!r}" if path else "the model")
    # host arrays kept as they are; on a device copied up, no host copy kept
    store = StateStore.open(model, arrays, protos, meta, config.host_memory, config.device or "cpu", config.device_id)
    del arrays
    sizes = {n: int(np.prod(p.dims, dtype=np.int64)) for n, p in protos.items()}
    trainable = [n for n in meta.trainable if n in sizes] or \
        [n for n, p in protos.items() if p.data_type in _FLOATS]
    threads = config.threads if config.threads is not None else \
        default_intra_op_threads(sum(sizes[n] for n in trainable))
    with announce_compiles():  # the first session after an install compiles the kernels
        programs = SessionPrograms(store, meta, config, large, threads)
    loop = TrainingLoop(programs)
    files = Checkpointer(store, loop.rates, meta)
    if empty:  # the optimizer state at its initial values
        store.reset(lambda init: InferenceSession(init, providers=config.providers))
        store.unfilled = set(store.parameters(trainable_only=False)) & set(empty)
    return store, programs, loop, files
