"""First use vs later use: the README's two examples in a fresh process with an empty numba cache
(what a new install runs first) and again with the cache that run filled.

Each example runs as its own script (the README's ```python blocks, as tests/test_readme.py reads
them) in a new interpreter; NUMBA_CACHE_DIR points at a new empty folder for the cold run and at
the same folder for the warm one. Cold and warm alternate (cold, warm, cold, warm...), each
repeat with a new folder; the report gives the median wall time and the median CPU time (user +
system of the child process: on a machine shared with other work, the better measure of what a
quiet machine's wall time would be), with the load average before and after.

    python benchmarks/bench_first_run.py [--repeats 3] [--pythonpath TREE] [--json out.json]

``--pythonpath`` runs another checkout's package (e.g. the main branch's, for a before/after).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def readme_examples() -> list[str]:
    blocks = re.findall(r"```python\n(.*?)```", (ROOT / "README.md").read_text(), re.S)
    return blocks[:2]


def run(code: str, cache: str, cwd: str, pythonpath: str) -> dict:
    """One example in a new interpreter: wall and CPU seconds, and what it wrote on stderr."""
    env = {**os.environ, "NUMBA_CACHE_DIR": cache, "PYTHONPATH": pythonpath}
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-c", code], cwd=cwd, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode:
        raise SystemExit(f"the example failed:\n{done.stderr}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    return {"wall": wall, "cpu": cpu, "stderr": done.stderr.strip()}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--pythonpath", default=str(ROOT), help="the checkout whose package runs (default: this one)")
    parser.add_argument("--json", default=None, help="also write the results here")
    args = parser.parse_args(argv)
    results = {"load_before": os.getloadavg(), "pythonpath": args.pythonpath, "examples": []}
    for index, code in enumerate(readme_examples(), 1):
        runs: dict[str, list[dict]] = {"cold": [], "warm": []}
        for _ in range(args.repeats):
            with tempfile.TemporaryDirectory() as cache, tempfile.TemporaryDirectory() as cwd:
                runs["cold"].append(run(code, cache, cwd, args.pythonpath))
                runs["warm"].append(run(code, cache, cwd, args.pythonpath))
        summary = {kind: {m: statistics.median(r[m] for r in rs) for m in ("wall", "cpu")} for kind, rs in runs.items()}
        summary["stderr_cold"] = runs["cold"][0]["stderr"]
        results["examples"].append(summary)
        cold, warm = summary["cold"], summary["warm"]
        print(f"README example {index}: cold {cold['wall']:.1f} s wall / {cold['cpu']:.1f} s CPU, "
              f"warm {warm['wall']:.1f} s / {warm['cpu']:.1f} s; cold - warm "
              f"{cold['wall'] - warm['wall']:.1f} s wall, "
              f"{cold['cpu'] - warm['cpu']:.1f} s CPU (medians of {args.repeats})")
        print(f"  stderr of a cold run: {summary['stderr_cold'] or '(nothing)'}")
    results["load_after"] = os.getloadavg()
    print(f"load average: before {results['load_before'][0]:.1f}, after {results['load_after'][0]:.1f}")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
