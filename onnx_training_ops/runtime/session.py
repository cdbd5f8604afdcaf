"""InferenceSession: a drop-in ``onnxruntime.InferenceSession`` that prepares training-domain graphs."""

from __future__ import annotations

import gc
import os
from collections.abc import Mapping, Sequence
from contextlib import contextmanager
from typing import Any

import numpy as np
import onnxruntime as ort

from ..errors import TrainingOpError
from ..interrupts import held_interrupts
from ..storage.large_model import LargeModel
from ..storage.model_files import ModelLike, as_model
from ..storage.tensors import location
from .native import native_error_message
from .options import session_options
from .pipeline import prepare_model
from .plugin import Interrupted, take_kernel_errors


def _collect_before_fork() -> None:
    """Collect garbage before the process forks. An onnxruntime session left in a reference
    cycle would otherwise be destroyed by the child's garbage collector, and its destructor
    waits on the thread pool's condition variables, whose threads the child does not have: a
    multiprocessing worker hung there for good (seen in test_process_pools_work_after_training)."""
    gc.collect()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(before=_collect_before_fork)


class InferenceSession(ort.InferenceSession):
    """``onnxruntime.InferenceSession`` for models that use ai.onnx.preview.training.

    Runs :func:`~.pipeline.prepare` on the model and registers the kernel library in ``sess_options``
    (a copy is not made: the options object gains the library). Everything else
    (``get_inputs``, ``get_outputs``, ``io_binding``...) is onnxruntime's own.

    A large model (a LargeModel, or a file past
    :func:`~onnx_training_ops.storage.large_model_bytes`) reaches onnxruntime as its small
    message plus its big tensors as OrtValues over the arrays
    (``SessionOptions.add_external_initializers``: no 2 GB limit, but onnxruntime copies
    them; a TrainingSession binds them as inputs instead. The options object gains them
    too, so give each large model options of its own).

    Args:
        model: a path, serialized bytes, a ModelProto or a
            :class:`~onnx_training_ops.storage.LargeModel`.
        sess_options: onnxruntime options to use (they gain the kernel library); None: new ones.
        providers: onnxruntime execution providers; default the CPU provider.
        kernels: ``"native"``, ``"pyop"`` or None for the default (see :func:`~.pipeline.prepare`).
        **kwargs: passed on to ``onnxruntime.InferenceSession``.

    Raises:
        TrainingOpError: an invalid training-domain node (from :func:`~.pipeline.prepare`).
    """

    def __init__(
        self,
        model: ModelLike,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[str | tuple[str, dict]] | None = None,
        kernels: str | None = None,
        **kwargs: Any,
    ) -> None:
        prepared = prepare_model(as_model(model, copy=False), kernels=kernels)
        self.prepared_model = prepared.model_proto
        options = session_options(sess_options)
        self._external = external_initializers(prepared, options)
        super().__init__(
            self.prepared_model.SerializeToString(),
            sess_options=options,
            providers=list(providers) if providers is not None else ["CPUExecutionProvider"],
            **kwargs,
        )

    def run(self, output_names, input_feed, run_options=None):
        """``onnxruntime.InferenceSession.run``, with training kernel failures raised.

        Arrays in a non-native byte order (``'>f4'``) are converted first: onnxruntime would
        read their bytes as native. The arrays fed are never modified.

        Args:
            output_names (Sequence[str] | None): the outputs to return; None for all.
            input_feed (Mapping[str, np.ndarray]): input name -> array.
            run_options (onnxruntime.RunOptions | None): onnxruntime's run options.

        Returns:
            The outputs' values, in the order asked for.

        Raises:
            TrainingOpError: ``input_feed`` is not a dict, or a training kernel failed (the
                message names the node).
        """
        if not isinstance(input_feed, Mapping):
            raise TrainingOpError(f"run: input_feed must be a dict of input name to array, found "
                                  f"{type(input_feed).__name__}")
        input_feed = {k: _native(k, v) for k, v in input_feed.items()}
        take_kernel_errors()
        with held_interrupts(), native_errors_raised():
            outputs = super().run(output_names, input_feed, run_options)
        raise_kernel_errors()
        return outputs

    def run_with_iobinding(self, iobinding, run_options=None):
        """``onnxruntime.InferenceSession.run_with_iobinding``, with training kernel failures raised.

        Args:
            iobinding (onnxruntime.IOBinding): the binding (``session.io_binding()``); an OrtValue bound as an input
                and as the matching output is updated in place.
            run_options (onnxruntime.RunOptions | None): onnxruntime's run options.

        Raises:
            TrainingOpError: a training kernel failed (the message names the node).
        """
        take_kernel_errors()
        with held_interrupts(), native_errors_raised():
            super().run_with_iobinding(iobinding, run_options)
        raise_kernel_errors()


def external_initializers(model: LargeModel, options: ort.SessionOptions) -> list:
    """Hand the main graph's detached tensors of ``model`` to onnxruntime through ``options``
    as OrtValues over the arrays (onnxruntime copies them; none for a model whose tensors are
    all in its message); returns what must outlive the session."""
    names, values, keep = [], [], []
    for tensor in model.model_proto.graph.initializer:
        if location(tensor) not in model.large_initializers:  # in the message, or in a file
            continue
        array = model.array(tensor)
        if not array.flags.c_contiguous:
            array = np.ascontiguousarray(array)  # a broadcast constant: onnxruntime needs the values
        value = ort.OrtValue.ortvalue_from_numpy(array)
        names.append(tensor.name)
        values.append(value)
        keep += [array, value]
    if names:
        options.add_external_initializers(names, values)
    return keep


@contextmanager
def native_errors_raised():
    """A native kernel's failure (an OrtStatus raised by onnxruntime) as TrainingOpError."""
    try:
        yield
    except Exception as error:
        message = native_error_message(error)
        if message is None:
            raise
        raise TrainingOpError(message) from error


def _native(name, value):
    if value is None:  # would reach a kernel as an unconstructed value and abort the process
        raise TrainingOpError(f"run: feed {name!r} is None; feed an array (or leave the "
                              "name out for an optional input)")
    if isinstance(value, np.ndarray) and not value.dtype.isnative:
        return value.astype(value.dtype.newbyteorder("="))
    return value


def raise_kernel_errors() -> None:
    """Raise the first kernel error recorded on this thread during the last run, if any; a
    Ctrl-C caught inside a kernel comes out as KeyboardInterrupt."""
    errors = take_kernel_errors()
    if any(isinstance(e, Interrupted) for e in errors):
        raise KeyboardInterrupt
    if errors:
        first = errors[0]
        if isinstance(first, TrainingOpError):
            raise TrainingOpError(str(first)) from first
        raise TrainingOpError(f"a training kernel failed: {first!r}") from first
