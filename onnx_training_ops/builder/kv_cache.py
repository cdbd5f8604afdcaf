"""A decoder's key/value cache left out of training: the past inputs removed, the present outputs dropped.

onnxruntime-genai's models (and onnxruntime's fused-attention graphs) read a cache of earlier
tokens' keys and values (``past_key_values.*`` inputs) and return it extended (``present.*``
outputs). A training step sees whole sequences: the cache is empty, so the builder removes
the graph inputs that only fill an attention node's past slots (the node then runs without a
past, as onnxruntime's kernels allow) and drops the present outputs from the graph's outputs
(the attention nodes still compute them; nothing reads them).

One exception: a ``GroupQueryAttention`` with ``sliding_window_cache=1`` (Gemma 2's windowed
layers) requires a past holding the window's capacity (``local_window_size`` positions), which
the prompt does not read. Its past becomes zeros of that capacity made in the graph
(``[batch, kv_num_heads, local_window_size, head_size]``, the batch and head size read from the
query), so the step takes no cache input either.
"""

from __future__ import annotations

import onnx
from onnx import TensorProto, helper

from ..walk import drop_named

MS_DOMAIN = "com.microsoft"
# com.microsoft attention ops: (past key/value input slots, present key/value output slots)
CACHE_SLOTS = {
    "GroupQueryAttention": ((3, 4), (1, 2)),
    "MultiHeadAttention": ((6, 7), (1, 2)),
}


def drop_kv_cache(model: onnx.ModelProto) -> list[str]:
    """Remove the key/value cache inputs and outputs of ``model``'s attention nodes (in place).

    Returns:
        The names of the graph inputs and outputs removed.
    """
    graph = model.graph
    inputs = {i.name for i in graph.input}
    past: set[str] = set()
    present: set[str] = set()
    other_uses: set[str] = set()
    for node in graph.node:
        slots = CACHE_SLOTS.get(node.op_type) if node.domain == MS_DOMAIN else None
        past_slots, present_slots = slots or ((), ())
        for k, name in enumerate(node.input):
            (past if k in past_slots and name in inputs else other_uses).add(name)
        present.update(node.output[k] for k in present_slots if k < len(node.output) and node.output[k])
    past -= other_uses
    if not past and not present:
        return []
    nodes: list[onnx.NodeProto] = []
    for node in graph.node:
        if node.domain == MS_DOMAIN and node.op_type in CACHE_SLOTS:
            window = _window_capacity(node)
            zeros = _zero_window_cache(node, window, nodes) if window else ""  # made just before the node
            for k, name in enumerate(node.input):
                if name in past:
                    node.input[k] = zeros
        nodes.append(node)
    del graph.node[:]
    graph.node.extend(nodes)
    dropped_outputs = [o.name for o in graph.output if o.name in present]
    if len(dropped_outputs) == len(graph.output):
        dropped_outputs = []  # a graph with nothing but the cache as outputs keeps it
    drop_named(graph.input, past)
    drop_named(graph.output, set(dropped_outputs))
    return sorted(past) + dropped_outputs


def _window_capacity(node: onnx.NodeProto) -> int:
    """The past length a ``sliding_window_cache=1`` GroupQueryAttention requires (0: none)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    if node.op_type != "GroupQueryAttention" or not attrs.get("sliding_window_cache"):
        return 0
    return int(attrs.get("local_window_size", -1)) if attrs.get("local_window_size", -1) > 0 else 0


def _zero_window_cache(node: onnx.NodeProto, window: int, made: list[onnx.NodeProto]) -> str:
    """Zeros ``[batch, kv_num_heads, window, head_size]`` for ``node``'s past (appended to ``made``);
    the batch and the head size come from the query (packed QKV when the key input is empty)."""
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    heads, kv_heads = int(attrs["num_heads"]), int(attrs["kv_num_heads"])
    packed = len(node.input) < 2 or not node.input[1]
    prefix = f"{node.name or node.output[0]}/window_cache"
    const = lambda name, values: helper.make_node(  # noqa: E731
        "Constant", [], [f"{prefix}/{name}"], value=helper.make_tensor(f"{prefix}/{name}", TensorProto.INT64,
                                                                       [len(values)], values))
    width_of = node.input[0] if packed else node.input[1]
    parts = heads + 2 * kv_heads if packed else kv_heads
    made += [
        const("zero", [0]), const("two", [2]), const("three", [3]),
        const("parts", [parts]), const("middle", [kv_heads, window]),
        helper.make_node("Shape", [node.input[0]], [f"{prefix}/query_shape"]),
        helper.make_node("Gather", [f"{prefix}/query_shape", f"{prefix}/zero"], [f"{prefix}/batch"], axis=0),
        helper.make_node("Shape", [width_of], [f"{prefix}/width_shape"], start=2, end=3),
        helper.make_node("Div", [f"{prefix}/width_shape", f"{prefix}/parts"], [f"{prefix}/head"]),
        helper.make_node("Concat", [f"{prefix}/batch", f"{prefix}/middle", f"{prefix}/head"], [f"{prefix}/shape"],
                         axis=0),
        helper.make_node("ConstantOfShape", [f"{prefix}/shape"], [f"{prefix}/zeros"],
                         value=helper.make_tensor(f"{prefix}/value", TensorProto.FLOAT, [1], [0.0])),
    ]
    return f"{prefix}/zeros"
