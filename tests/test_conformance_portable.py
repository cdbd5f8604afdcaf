"""The domain's ONNX conformance cases on the portable form: optimizer nodes lowered to standard
ONNX ops, run in a plain onnxruntime session (onnx_training_ops.backend.PortableBackend)."""

import json
import subprocess
import sys
from pathlib import Path

from onnx_training_ops.conformance import CASES, NODE_CASES, backend_test_cases

globals().update(backend_test_cases(__name__, portable=True))

ROOT = Path(__file__).resolve().parents[1]


def test_every_node_case_is_collected_on_the_portable_backend():
    names = {test for case in backend_test_cases(__name__, portable=True).values() for test in dir(case)
             if test.startswith("test_")}
    for case in NODE_CASES:
        assert f"{case}_cpu" in names


def test_portable_conformance_passes_every_case_without_loading_the_plugin():
    code = """
import json, sys
from onnx_training_ops.conformance import run_conformance
results = run_conformance(portable=True)
print(json.dumps({"passed": [r.name for r in results if r.passed],
                  "failed": {r.name: r.detail for r in results if not r.passed},
                  "plugin": "onnxruntime_extensions._ocos" in sys.modules}))
"""
    done = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["failed"] == {}
    assert sorted(result["passed"]) == sorted(CASES)
    assert result["plugin"] is False


def test_cli_conformance_portable():
    from onnx_training_ops.cli import main

    assert main(["conformance", "--portable"]) == 0
