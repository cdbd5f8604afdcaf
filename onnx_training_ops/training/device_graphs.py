"""The step graphs a device-resident session runs, made without opening one.

``TrainingSession(model, device=..., input_shapes=...)`` runs, for each TrainingInfoProto, the
main graph + algorithm (:func:`~.program.combined_graph`, the state as inputs) prepared to
standard ops with the optimizer flat (``portable=True, flat=True``), its inputs with stored
defaults made plain inputs, and its data inputs' shapes fixed and folded
(:func:`~.static_shapes.static_graph`). :func:`device_step_graphs` builds those graphs on any
machine, so that what a GPU would run can be checked on the CPU (which nodes have no CUDA
kernel at their types: :func:`~onnx_training_ops.runtime.kernel_table.cpu_nodes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ..builder.model_metadata import metadata
from ..runtime.pipeline import prepare_model
from ..storage.large_model import LargeModel
from ..storage.model_files import ModelLike, as_model
from ..walk import drop_named
from .program import combined_graph, learning_rate_inputs
from .state import collect_state_protos
from .static_shapes import checked_input_shapes, static_graph


def device_step_graphs(model: ModelLike, input_shapes: Mapping[str, Sequence[int]] | None = None
                       ) -> list[LargeModel]:
    """The step graphs (one per TrainingInfoProto) of ``TrainingSession(model, device=...,
    input_shapes=input_shapes)``, before onnxruntime sees them; ``input_shapes=None``: the
    graphs with symbolic dims.

    Raises:
        TrainingOpError: ``input_shapes`` invalid or not fitting the step's data inputs.
    """
    shapes = checked_input_shapes(input_shapes, "input_shapes") if input_shapes is not None else None
    model = as_model(model, copy=False)
    proto = model.model_proto
    meta = metadata(proto)
    protos = collect_state_protos(proto)
    named = tuple(filter(None, [meta.get("learning_rate")]))
    graphs = []
    for index in range(len(proto.training_info)):
        combined = combined_graph(proto, index, protos, meta)
        graph = combined.graph
        initial = {t.name: t for t in graph.initializer}
        types = {vi.name: vi for vi in graph.input}
        _, rate_defaults = learning_rate_inputs(graph, {n: None for n in protos}, types, initial, named)
        defaults = {vi.name for vi in graph.input if vi.name in initial and vi.name not in protos}
        portable = prepare_model(model.with_proto(combined), portable=True, flat=True)
        drop_named(portable.model_proto.graph.initializer, set(rate_defaults) | defaults)
        if shapes is not None:
            data = [vi.name for vi in portable.model_proto.graph.input if vi.name not in protos]
            portable = portable.with_proto(static_graph(portable.model_proto, data, shapes, "input_shapes"))
        graphs.append(portable)
    return graphs
