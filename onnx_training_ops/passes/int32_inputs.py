"""Pass: int64 graph inputs that only index or get cast become int32 inputs.

onnxruntime-web's WebGPU execution provider runs no int64 arithmetic (1.30: int64 nodes fall
back to the CPU, or run in 32 bits when int64 is switched on). Labels read only by a Cast (the
lowered OneHot casts them to float32) and token ids read only as Gather/GatherElements indices
need no int64: the input is declared int32 and the trainer converts the batch (an id or label
outside the int32 range is refused there).
"""

from __future__ import annotations

from typing import Iterable

from onnx import ModelProto, TensorProto


def _indexing_only(name: str, readers: list) -> bool:
    for node in readers:
        if node.op_type == "Cast" and node.domain in ("", "ai.onnx"):
            continue
        if node.op_type in ("Gather", "GatherElements") and list(node.input).index(name) == 1 \
                and node.input[0] != name:
            continue
        return False
    return bool(readers)


def int32_inputs(model: ModelProto, skip: Iterable[str] = ()) -> list[str]:
    """Retype the int64 inputs of ``model`` (in place) that only index or get cast.

    Args:
        model: the model to rewrite.
        skip: inputs left as they are (the state).

    Returns:
        The names of the inputs now int32.
    """
    graph = model.graph
    skip = set(skip)
    outputs = {o.name for o in graph.output}
    changed = []
    for vi in graph.input:
        tt = vi.type.tensor_type
        if vi.name in skip or vi.name in outputs or tt.elem_type != TensorProto.INT64:
            continue
        if _indexing_only(vi.name, [n for n in graph.node if vi.name in n.input]):
            tt.elem_type = TensorProto.INT32
            changed.append(vi.name)
    return changed
