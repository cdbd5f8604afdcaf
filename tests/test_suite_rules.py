"""Rules the test suite keeps (issue 20 item 15): no assertion on wall-clock time. A bound on
seconds fails on a loaded machine (1.36 s for a "< 1 s" expansion on a busy 2-core box) and
proves nothing on an idle one; timings belong in ``python -m benchmarks``."""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parent
CLOCKS = {"perf_counter", "perf_counter_ns", "time", "monotonic", "monotonic_ns", "process_time"}
ORDER = (ast.Lt, ast.LtE, ast.Gt, ast.GtE)


def _reads_clock(node: ast.AST, timed: set[str]) -> bool:
    for sub in ast.walk(node):
        if isinstance(sub, ast.Call) and isinstance(sub.func, ast.Attribute) and sub.func.attr in CLOCKS \
                and isinstance(sub.func.value, ast.Name) and sub.func.value.id == "time":
            return True
        if isinstance(sub, ast.Name) and sub.id in timed:
            return True
        if isinstance(sub, ast.Subscript) and isinstance(sub.slice, ast.Constant) \
                and any(w in str(sub.slice.value) for w in ("second", "elapsed")):
            return True
    return False


def wall_clock_assertions(source: str) -> list[int]:
    """Line numbers of ``assert``s that order a value computed from a clock."""
    tree = ast.parse(source)
    timed: set[str] = set()
    for _ in range(3):  # names assigned from the clock, or from such names
        for node in ast.walk(tree):
            if isinstance(node, ast.Assign) and _reads_clock(node.value, timed):
                timed |= {t.id for t in node.targets if isinstance(t, ast.Name)}
    lines = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Assert):
            for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
                if any(isinstance(op, ORDER) for op in cmp.ops) and _reads_clock(cmp, timed):
                    lines.append(node.lineno)
    return lines


def test_the_rule_sees_the_forms_it_forbids():
    assert wall_clock_assertions("import time\ns = time.perf_counter()\nf()\ne = time.perf_counter() - s\n"
                                 "assert e < 1.0\n") == [5]
    assert wall_clock_assertions("assert result['seconds'] < 3.0, result\n") == [1]
    assert wall_clock_assertions("import time\nd = time.monotonic() + 5\nassert x < 3\n") == []


def test_no_test_asserts_on_wall_clock_time():
    found = {path.name: lines for path in sorted(TESTS.glob("*.py"))
             if path.name != Path(__file__).name and (lines := wall_clock_assertions(path.read_text()))}
    assert not found, f"wall-clock assertions (move them to the bench): {found}"
