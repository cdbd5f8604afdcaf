"""The onnx backend API over onnxruntime plus this package's kernels, as ``onnxruntime.backend`` does it.

Use it for conformance runs in any CI::

    import onnx.backend.test
    import onnx_training_ops.backend as backend
    backend_test = onnx.backend.test.BackendTest(backend, __name__)
    backend_test.include(r"(test_adam|test_adagrad|test_momentum|test_nesterov_momentum|test_gradient_of)")
    globals().update(backend_test.test_cases)

``PortableBackend`` runs the same cases on the portable form (``prepare(model, portable=True)``:
standard ONNX ops only) in a plain onnxruntime session, with nothing registered.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
import onnx
from onnx import ModelProto, NodeProto
from onnx.backend.base import Backend, BackendRep

from .runtime.session import InferenceSession
from .storage.tensors import whole_proto


class TrainingBackendRep(BackendRep):
    """A prepared model: ``run(inputs)`` takes a list (graph-input order) or a name->array dict."""

    def __init__(self, session: InferenceSession) -> None:
        self.session = session
        self._input_names = [i.name for i in session.get_inputs()]
        self._output_names = [o.name for o in session.get_outputs()]

    def run(self, inputs: Any, **kwargs: Any) -> tuple[np.ndarray, ...]:
        if isinstance(inputs, dict):
            feeds = dict(inputs)
        elif isinstance(inputs, (list, tuple)):
            if len(inputs) > len(self._input_names):
                raise ValueError(f"the model takes {len(self._input_names)} inputs, {len(inputs)} were given")
            feeds = dict(zip(self._input_names, inputs))
        else:
            feeds = {self._input_names[0]: inputs}
        return tuple(self.session.run(self._output_names, feeds))  # onnx's Backend API: a tuple


class TrainingBackend(Backend):
    """onnx ``Backend`` running ai.onnx.preview.training graphs on onnxruntime's CPU provider."""

    @classmethod
    def is_compatible(cls, model: ModelProto, device: str = "CPU", **kwargs: Any) -> bool:
        return cls.supports_device(device)

    @classmethod
    def supports_device(cls, device: str) -> bool:
        return device.upper().split(":")[0] == "CPU"

    @classmethod
    def prepare(cls, model: ModelProto | str | bytes, device: str = "CPU", **kwargs: Any) -> TrainingBackendRep:
        if not cls.supports_device(device):
            raise RuntimeError(f"onnx_training_ops runs on CPU only, not on {device!r}")
        options = kwargs.pop("sess_options", None)
        return TrainingBackendRep(InferenceSession(model, sess_options=options, **kwargs))

    @classmethod
    def run_model(cls, model: ModelProto, inputs: Any, device: str = "CPU", **kwargs: Any) -> tuple[np.ndarray, ...]:
        return cls.prepare(model, device, **kwargs).run(inputs)

    @classmethod
    def run_node(
        cls,
        node: NodeProto,
        inputs: Sequence[np.ndarray],
        device: str = "CPU",
        outputs_info: Sequence[tuple[np.dtype, tuple[int, ...]]] | None = None,
        **kwargs: Any,
    ) -> tuple[np.ndarray, ...]:
        """Run one node on ``inputs`` (in the node's input order)."""
        arrays = [np.asarray(a) for a in inputs]
        graph_inputs = [
            onnx.helper.make_tensor_value_info(name, onnx.helper.np_dtype_to_tensor_dtype(a.dtype), a.shape)
            for name, a in zip(node.input, arrays)
        ]
        graph_outputs = [onnx.helper.make_empty_tensor_value_info(name) for name in node.output if name]
        domains = {node.domain or ""} | {""}
        opset = kwargs.pop("opset_version", None)
        model = onnx.helper.make_model(
            onnx.helper.make_graph([node], f"run_node_{node.op_type}", graph_inputs, graph_outputs),
            opset_imports=[
                onnx.helper.make_opsetid(
                    d, opset if (d == "" and opset) else (1 if d else onnx.defs.onnx_opset_version()))
                for d in sorted(domains)
            ],
        )
        return cls.run_model(model, dict(zip(node.input, arrays)), device, **kwargs)


class PortableBackend(TrainingBackend):
    """The portable form in plain onnxruntime: optimizer nodes lowered to standard ops, no plugin."""

    @classmethod
    def prepare(cls, model: ModelProto | str | bytes, device: str = "CPU", **kwargs: Any) -> TrainingBackendRep:
        import onnxruntime as ort

        from .runtime.pipeline import prepare as prepare_model

        if not cls.supports_device(device):
            raise RuntimeError(f"onnx_training_ops runs on CPU only, not on {device!r}")
        options = kwargs.pop("sess_options", None)
        portable = prepare_model(model, portable=True)
        return TrainingBackendRep(ort.InferenceSession(whole_proto(portable).SerializeToString(), sess_options=options,
                                                       providers=["CPUExecutionProvider"], **kwargs))


prepare = TrainingBackend.prepare
run_model = TrainingBackend.run_model
run_node = TrainingBackend.run_node
supports_device = TrainingBackend.supports_device
is_compatible = TrainingBackend.is_compatible
