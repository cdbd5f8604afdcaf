"""A decoder's key/value cache left out of training: the past inputs removed, the present outputs dropped.

onnxruntime-genai's models (and onnxruntime's fused-attention graphs) read a cache of earlier
tokens' keys and values (``past_key_values.*`` inputs) and return it extended (``present.*``
outputs). A training step sees whole sequences: the cache is empty, so the builder removes
the graph inputs that only fill an attention node's past slots (the node then runs without a
past, as onnxruntime's kernels allow) and drops the present outputs from the graph's outputs
(the attention nodes still compute them; nothing reads them).
"""

from __future__ import annotations

import onnx

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
    past, present, other_uses = set(), set(), set()
    for node in graph.node:
        slots = CACHE_SLOTS.get(node.op_type) if node.domain == MS_DOMAIN else None
        past_slots, present_slots = slots or ((), ())
        for k, name in enumerate(node.input):
            (past if k in past_slots and name in inputs else other_uses).add(name)
        present.update(node.output[k] for k in present_slots if k < len(node.output) and node.output[k])
    past -= other_uses
    if not past and not present:
        return []
    for node in graph.node:
        if node.domain == MS_DOMAIN and node.op_type in CACHE_SLOTS:
            for k, name in enumerate(node.input):
                if name in past:
                    node.input[k] = ""
    dropped_outputs = [o.name for o in graph.output if o.name in present]
    if len(dropped_outputs) == len(graph.output):
        dropped_outputs = []  # a graph with nothing but the cache as outputs keeps it
    drop_named(graph.input, past)
    drop_named(graph.output, set(dropped_outputs))
    return sorted(past) + dropped_outputs
