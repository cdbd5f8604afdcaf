"""InferenceSession: a drop-in ``onnxruntime.InferenceSession`` that prepares training-domain graphs."""

from __future__ import annotations

from typing import Any, Sequence

import onnxruntime as ort

from .passes import ModelLike, prepare
from .errors import TrainingOpError
from .plugin import session_options, take_kernel_errors


class InferenceSession(ort.InferenceSession):
    """``onnxruntime.InferenceSession`` for models that use ai.onnx.preview.training.

    Takes a path, serialized bytes or a ModelProto, runs :func:`prepare` on it and
    registers the kernel library in ``sess_options`` (a copy is not made: the options
    object gains the library). Everything else — ``run``, ``get_inputs``,
    ``get_outputs``, ``io_binding`` — is onnxruntime's own.
    """

    def __init__(
        self,
        model: ModelLike,
        sess_options: ort.SessionOptions | None = None,
        providers: Sequence[str | tuple[str, dict]] | None = None,
        **kwargs: Any,
    ) -> None:
        prepared = prepare(model)
        self.prepared_model = prepared
        super().__init__(
            prepared.SerializeToString(),
            sess_options=session_options(sess_options),
            providers=list(providers) if providers is not None else ["CPUExecutionProvider"],
            **kwargs,
        )

    def run(self, output_names, input_feed, run_options=None):
        """``onnxruntime.InferenceSession.run``; a failing training kernel raises TrainingOpError."""
        take_kernel_errors()
        outputs = super().run(output_names, input_feed, run_options)
        raise_kernel_errors()
        return outputs

    def run_with_iobinding(self, iobinding, run_options=None):
        """``onnxruntime.InferenceSession.run_with_iobinding`` with kernel errors raised."""
        take_kernel_errors()
        super().run_with_iobinding(iobinding, run_options)
        raise_kernel_errors()


def raise_kernel_errors() -> None:
    """Raise the first kernel error recorded during the last run, if any."""
    errors = take_kernel_errors()
    if errors:
        first = errors[0]
        if isinstance(first, TrainingOpError):
            raise TrainingOpError(str(first)) from first
        raise TrainingOpError(f"a training kernel failed: {first!r}") from first
