"""The step graphs a device-resident session runs, made without opening one.

``TrainingSession(model, device=..., input_shapes=...)`` builds its step programs with the
in-graph engine (:class:`~...graph.GraphUpdate`): for each TrainingInfoProto, the main
graph + algorithm prepared to standard ops by the pass pipeline of the device's execution
provider (on CUDA: Conv gradients as Conv/ConvTranspose, float32 GroupQueryAttention in
standard ops), the optimizer flat, inputs with stored defaults made plain inputs, the data
inputs' shapes fixed and folded, the new state guarded (and gated by the capture's warm-up
input), frozen tensors as inputs. :func:`device_step_graphs` runs that very building
(:meth:`~...graph.GraphUpdate.plan_steps`) on any machine, so that what a GPU would run
can be checked on the CPU (which nodes have no CUDA kernel at their types:
:func:`~onnx_training_ops.runtime.kernel_table.cpu_nodes`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

from ...builder.metadata import TrainingMetadata
from ...runtime.kernel_table import CUDA
from ...storage.large_model import LargeModel, detach
from ...storage.model_files import ModelLike, as_model
from ..graphs.static_shapes import checked_input_shapes
from ..options.providers import CPU, DEVICE_OF
from ..state.state import collect_state_protos
from .graph import GraphUpdate, ProgramPlan, StateNames


def device_step_plans(model: ModelLike, input_shapes: Mapping[str, Sequence[int]] | None = None,
                      provider: str = CUDA, on_nonfinite: str = "raise", cuda_graph: bool | None = None,
                      in_place: bool | None = None) -> list[ProgramPlan]:
    """The step programs' plans (one per TrainingInfoProto) of ``TrainingSession(model,
    device=<provider's device>, input_shapes=input_shapes, on_nonfinite=..., cuda_graph=...)``:
    each with the graph onnxruntime opens (``plan.model``) and the nodes ``provider`` has no
    kernel for (``plan.off_device``)."""
    shapes = checked_input_shapes(input_shapes, "input_shapes") if input_shapes is not None else None
    opened = detach(as_model(model))  # as a session reads it
    proto = opened.model_proto
    protos = collect_state_protos(proto)
    state = StateNames(frozenset(protos), DEVICE_OF.get(provider, "cpu"))
    update = GraphUpdate(state, protos, TrainingMetadata.from_model(proto), on_nonfinite, None, [provider, CPU],
                         shapes, cuda_graph, in_place, provider=provider)
    return update.plan_steps(opened)


def device_step_graphs(model: ModelLike, input_shapes: Mapping[str, Sequence[int]] | None = None,
                       provider: str = CUDA) -> list[LargeModel]:
    """The step graphs (one per TrainingInfoProto) of ``TrainingSession(model, device=...,
    input_shapes=input_shapes)`` on ``provider``'s device, as onnxruntime receives them;
    ``input_shapes=None``: the graphs with symbolic dims.

    Raises:
        TrainingOpError: ``input_shapes`` invalid or not fitting the step's data inputs.
    """
    return [plan.model for plan in device_step_plans(model, input_shapes, provider)]
