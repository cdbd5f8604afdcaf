"""Pass: fit the IR version and opset imports to what the installed onnxruntime reads.

onnx 1.23's ``make_model`` writes IR 14 and ai.onnx opset 28; onnxruntime 1.31 reads at
most IR 13 and opset 26. The limits are probed once from onnxruntime itself, so the pass
follows whichever versions are installed.
"""

from __future__ import annotations

from functools import lru_cache

import onnx
import onnxruntime as ort
from onnx import ModelProto

from ..errors import TrainingOpError
from ..schema import DOMAIN, OPSET_VERSION
from ..walk import all_graphs


def _loads(ir_version: int, opset: int) -> bool:
    x = onnx.helper.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [1])
    y = onnx.helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, [1])
    graph = onnx.helper.make_graph([onnx.helper.make_node("Identity", ["x"], ["y"])], "probe", [x], [y])
    model = onnx.helper.make_model(graph, opset_imports=[onnx.helper.make_opsetid("", opset)])
    model.ir_version = ir_version
    try:
        ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
        return True
    except Exception:
        return False


@lru_cache(maxsize=1)
def runtime_limits() -> tuple[int, int]:
    """(highest IR version, highest ai.onnx opset) the installed onnxruntime loads."""
    ir = int(onnx.IR_VERSION)
    while ir > 3 and not _loads(ir, 13):
        ir -= 1
    opset = onnx.defs.onnx_opset_version()
    while opset > 7 and not _loads(ir, opset):
        opset -= 1
    return ir, opset


def _lower_default_opset(model: ModelProto, target: int) -> None:
    """Lower the ai.onnx import to ``target`` if no op the model uses changed in between."""
    current = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    for graph in all_graphs(model.graph):
        for node in graph.node:
            if node.domain not in ("", "ai.onnx"):
                continue
            try:
                now = onnx.defs.get_schema(node.op_type, current, "").since_version
                then = onnx.defs.get_schema(node.op_type, target, "").since_version
            except onnx.defs.SchemaError:
                then, now = None, -1
            if now != then:
                raise TrainingOpError(
                    f"{node.op_type} node {node.name!r}: the model imports ai.onnx opset {current} and this op "
                    f"changed after opset {target}, the highest the installed onnxruntime {ort.__version__} runs; "
                    f"convert the model with onnx.version_converter or install a newer onnxruntime"
                )
    for o in model.opset_import:
        if o.domain in ("", "ai.onnx"):
            o.version = target


def fit_runtime(model: ModelProto) -> ModelProto:
    """Clamp IR version and ai.onnx opset to the runtime's limits; import the training domain if used."""
    max_ir, max_opset = runtime_limits()
    if model.ir_version > max_ir:
        model.ir_version = max_ir
    imports = {o.domain: o for o in model.opset_import}
    default = imports.get("") or imports.get("ai.onnx")
    if default is not None and default.version > max_opset:
        _lower_default_opset(model, max_opset)
    uses_domain = any(n.domain == DOMAIN for g in all_graphs(model.graph) for n in g.node)
    if uses_domain and DOMAIN not in imports:
        model.opset_import.append(onnx.helper.make_opsetid(DOMAIN, OPSET_VERSION))
    return model
