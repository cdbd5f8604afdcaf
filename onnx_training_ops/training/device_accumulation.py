"""``backward``/``optimizer_step`` on a device: the stages of :mod:`.stages` over device state.

The backward stage adds each batch's gradients (times a scale) into accumulators that live on
the device beside the state; the apply stage runs clipping, weight decay, the optimizers and
``T + 1`` on them; a small session of ``ConstantOfShape`` nodes bound onto the accumulators
zeroes them after each optimizer step (a memset each, nothing uploaded). Gradients come to the
host only when asked (:meth:`DeviceAccumulation.gradients`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np
from onnx import helper, numpy_helper

from ..errors import TrainingOpError
from ..runtime.session import InferenceSession
from ..storage.tensors import tensor_value
from .program import combined_graph
from .stages import Stages, split_stages


class DeviceAccumulation:
    """``backward``/``optimizer_step`` on the device: the stages' programs and accumulators."""

    def __init__(self, programs: Any) -> None:
        """``programs``: the session's :class:`~.device_session.DevicePrograms` (their store,
        metadata, options and ``open_graph``)."""
        self._programs = programs
        self._built: tuple[Any, Any, Stages] | None = None
        self._zeros: Any = None  # the session that zeroes the accumulators (made with the stages)
        self.count = 0

    @property
    def built(self) -> bool:
        return self._built is not None

    def stages(self) -> tuple[Any, Any, Stages]:
        if self._built is None:
            programs, model = self._programs, self._programs.model
            arrays = dict(model.large_initializers)
            stages = split_stages(model.model_proto, arrays)
            protos = dict(programs.store.protos)
            for t in stages.backward.training_info[0].algorithm.initializer:
                if t.name in stages.buffers:
                    protos[t.name] = t
                    programs.store.values.add(t.name, tensor_value(t, arrays))
            meta = programs.meta
            apply_meta = {k: v for k, v in meta.items() if k not in ("loss", "eval_loss")}
            graphs = []
            for stage, stage_meta, where in ((stages.backward, meta, "backward"),
                                             (stages.apply, apply_meta, "optimizer_step")):
                combined = combined_graph(stage, 0, protos, stage_meta, prune_inputs=True)
                feedback = {e.key: e.value for e in stage.training_info[0].update_binding}
                returned = [o.name for o in combined.graph.output if o.name not in set(feedback.values())]
                backward = where == "backward"
                graphs.append(programs.open_graph(
                    model.with_proto(stage), combined, feedback, where,
                    programs._loss(returned) if backward else None,
                    programs.config.on_nonfinite if backward else "ignore"))
            self._built = (graphs[0], graphs[1], stages)
            self._zeros = _zeros_session(programs, stages.buffers)
        return self._built

    def zero(self) -> None:
        """Every accumulator to zero, on the device (a memset per accumulator, nothing uploaded)."""
        if self._built is not None:
            values = self._programs.store.values
            io = self._zeros.io_binding()
            for name in self._built[2].buffers:
                io.bind_ortvalue_output(f"{name}/zero", values.values[name])
            self._zeros.run_with_iobinding(io)
        self.count = 0

    def gradients(self) -> dict[str, np.ndarray]:
        _, _, stages = self.stages()
        values = self._programs.store.values
        return {param: values.download(acc) for param, acc in stages.gradients.items()}

    @property
    def buffers(self) -> list[np.ndarray]:
        raise TrainingOpError("gradient_buffers: the accumulated gradients live on the device "
                              f"({self._programs.store.device!r}); use gradients() for copies")

    def views(self) -> list[tuple[str, np.ndarray]]:
        raise TrainingOpError("gradient_views: the accumulated gradients live on the device "
                              f"({self._programs.store.device!r}); use gradients() for copies")

    def programs(self) -> tuple[Any, Any, Stages]:
        return self.stages()


def _zeros_session(programs: Any, names: Sequence[str]) -> Any:
    """A session with no inputs whose outputs ``<name>/zero`` are zeros shaped like ``names``."""
    values = programs.store.values
    nodes, initializers, outputs = [], [], []
    for name in names:
        dtype, shape = values.dtype(name), values.shape(name)
        elem = helper.np_dtype_to_tensor_dtype(dtype)
        initializers.append(numpy_helper.from_array(np.array(shape, np.int64), f"{name}/shape"))
        nodes.append(helper.make_node("ConstantOfShape", [f"{name}/shape"], [f"{name}/zero"],
                                      value=helper.make_tensor("zero", elem, [1], [0])))
        outputs.append(helper.make_tensor_value_info(f"{name}/zero", elem, list(shape)))
    graph = helper.make_graph(nodes, "zero_gradients", [], outputs, initializers)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 13)])
    return InferenceSession(model, sess_options=programs.options(), providers=programs.config.providers)


__all__ = ["DeviceAccumulation"]
