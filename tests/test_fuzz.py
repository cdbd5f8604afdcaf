"""The fuzz suite (issue 9): seeded mutations of graphs, feeds and checkpoint bytes, each
category in its own subprocess (tests/fuzz_cases.py). Every case must end in a result equal
to the reference or one of our clean errors — never a crash, a hang, a raw exception, a
changed state after a failed step, or a damaged checkpoint loading different values."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

CASES = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fuzz_cases.py")


@pytest.mark.parametrize("category,n", [("graphs", 160), ("feeds", 120), ("checkpoints", 120)])
def test_fuzz(category, n):
    proc = subprocess.run([sys.executable, CASES, category, "20261122", str(n)],
                          capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, f"crashed ({proc.returncode}): {proc.stderr[-2000:]}"
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["ran"] + result["clean"] + result["wrong"] == n
    assert result["wrong"] == 0, result["examples"]
    assert result["clean"] > 0  # the mutations do reach the error paths
