"""Runs ``node --test`` on the JavaScript suites (js/test/) against fixtures Python wrote."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


def node_test(files: list[str], fixtures: Path, timeout: float = 600) -> str:
    """Run ``node --test FILES`` in js/ with ``OTO_FIXTURES=fixtures``; fail the test unless every suite passes.

    Args:
        files: the test files, relative to js/.
        fixtures: the folder js_fixtures wrote.
        timeout: seconds before the run is stopped (a failure).

    Returns:
        node's standard output (its TAP report).
    """
    node = shutil.which("node")
    if node is None:
        pytest.fail("node is not installed (make test installs it with apt-get)")
    if not (REPO / "js" / "node_modules" / "onnxruntime-node").is_dir():
        pytest.fail("js/node_modules is missing: cd js && npm ci --ignore-scripts (make test does it)")
    env = {**os.environ, "OTO_FIXTURES": str(fixtures), "PYTHON": sys.executable}
    run = subprocess.run([node, "--test", *files], cwd=REPO / "js", env=env, capture_output=True, text=True,
                         timeout=timeout)
    assert run.returncode == 0, run.stdout[-6000:] + run.stderr[-3000:]
    return run.stdout
