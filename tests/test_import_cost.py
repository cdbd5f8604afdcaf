"""Importing the package is cheap and has no global side effects (issue 10, part 4).

onnxruntime-extensions' package ``__init__`` imports its ``cvt`` module, which imports torch
and transformers when installed and sets PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python in
os.environ. We load only its PyOp module, and only when a session needs the kernels.
Each check runs in a fresh interpreter (the test process has long imported everything).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
VAR = "PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION"


def _run(code: str, env_var: str | None = None) -> dict:
    env = dict(os.environ)
    env.pop(VAR, None)
    if env_var is not None:
        env[VAR] = env_var
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    return json.loads(done.stdout.strip().splitlines()[-1])


REPORT = """
import json, os, sys, time
start = time.perf_counter()
import onnx_training_ops
seconds = time.perf_counter() - start
{after}
print(json.dumps({{"seconds": seconds, "file": onnx_training_ops.__file__,
    "modules": [m for m in ("torch", "transformers", "onnxruntime_extensions",
                            "onnxruntime_extensions.cvt") if m in sys.modules],
    "var": os.environ.get("{var}")}}))
"""


def test_import_loads_neither_torch_nor_the_extensions_and_leaves_the_environment_alone():
    pytest.importorskip("torch")  # the point: torch is installed, and still not imported
    result = _run(REPORT.format(after="", var=VAR))
    assert result["file"].startswith(str(ROOT))
    assert result["modules"] == []
    assert result["var"] is None  # the import's time: `python -m benchmarks overhead`


def test_an_environment_value_set_before_is_kept():
    result = _run(REPORT.format(after="onnx_training_ops.session_options()", var=VAR), env_var="upb")
    assert result["var"] == "upb"


def test_making_a_session_loads_only_the_pyop_module_of_the_extensions():
    after = """
import numpy as np
import onnxruntime as ort
sys.path.insert(0, "tests")
from model_factory import optimizer_model
session = onnx_training_ops.InferenceSession(optimizer_model("Adam", n=1, shapes=[[3]]))
feeds = {i.name: np.ones(i.shape, np.float32) for i in session.get_inputs()}
feeds["T"] = np.array(1, np.int64)
session.run(None, feeds)
"""
    result = _run(REPORT.format(after=after, var=VAR))
    assert "torch" not in result["modules"] and "onnxruntime_extensions.cvt" not in result["modules"]
    assert result["var"] is None


def test_the_users_own_import_of_the_extensions_after_ours_shares_one_pyop_registry():
    code = """
import json, sys
import numpy as np
import onnxruntime as ort
from onnx import TensorProto, helper as h
import onnx_training_ops as ot
ot.session_options()                      # our kernels: the PyOp module only
import onnxruntime_extensions             # the user's: the real package __init__
from onnxruntime_extensions import PyCustomOpDef, onnx_op, _ocos
assert _ocos is sys.modules["onnxruntime_extensions._ocos"]

@onnx_op(op_type="test.user::Twice", inputs=[PyCustomOpDef.dt_float], outputs=[PyCustomOpDef.dt_float])
def twice(x):
    return x * 2

graph = h.make_graph([h.make_node("Twice", ["x"], ["y"], domain="test.user")], "g",
                     [h.make_tensor_value_info("x", TensorProto.FLOAT, [2])],
                     [h.make_tensor_value_info("y", TensorProto.FLOAT, [2])])
model = h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid("test.user", 1)])
model.ir_version = 10
so = ort.SessionOptions()
so.register_custom_ops_library(onnxruntime_extensions.get_library_path())
(y,) = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"]).run(
    None, {"x": np.array([1.0, 2.0], np.float32)})
print(json.dumps({"y": y.tolist()}))
"""
    assert _run(code)["y"] == [2.0, 4.0]
