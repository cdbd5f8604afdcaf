"""onnxruntime profiles summarized: nodes executed per run and time per op type.

Standard library only: onnxruntime-training's worker (another Python) loads this file by
path, so both sides of the real-model benchmark count nodes the same way.
"""

from __future__ import annotations

import json
from collections import defaultdict


def read_traces(path: str) -> list[list]:
    """The traces in one profile file: sessions that start profiling in the same
    millisecond (onnxruntime-training's training and optimizer sessions) write one file,
    one JSON array after the other."""
    with open(path) as f:
        text = f.read()
    decoder, traces, at = json.JSONDecoder(), [], 0
    while True:
        while at < len(text) and text[at] in " \t\r\n,":
            at += 1
        if at >= len(text):
            return traces
        trace, at = decoder.raw_decode(text, at)
        traces.append(trace)


def summarize(paths: list[str], top: int = 15, skip_runs: int = 1) -> dict:
    """Nodes executed per step and kernel milliseconds per step by op type, over the
    profiles in ``paths`` (one per onnxruntime session; a training step may run several
    sessions, e.g. onnxruntime-training's training and optimizer models). Per session, the
    first ``skip_runs`` runs (``model_run`` events: first-run allocations) are left out and
    the counts divided by the number of runs kept, then added up.

    Returns ``{"nodes_per_step", "kernel_ms_per_step", "sessions", "by_op": [[op, nodes,
    ms], ...] (the ``top`` costliest op types)}``.
    """
    nodes = 0.0
    by_op: dict[str, list[float]] = defaultdict(lambda: [0.0, 0.0])
    sessions = 0
    for events in (trace for path in paths for trace in read_traces(path)):
        starts = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
        skip = min(skip_runs, len(starts) - 1)
        runs = len(starts) - skip
        if runs <= 0:
            continue
        since = starts[skip] if skip > 0 else float("-inf")
        sessions += 1
        for e in events:
            if e.get("cat") == "Node" and e.get("name", "").endswith("_kernel_time") and e.get("ts", 0) >= since:
                op = e.get("args", {}).get("op_name", "?")
                by_op[op][0] += 1 / runs
                by_op[op][1] += e.get("dur", 0) / 1e3 / runs
                nodes += 1 / runs
    ranked = sorted(by_op.items(), key=lambda kv: -kv[1][1])
    return {"nodes_per_step": round(nodes, 1),
            "kernel_ms_per_step": round(sum(v[1] for v in by_op.values()), 2),
            "sessions": sessions,
            "by_op": [[op, round(n, 1), round(ms, 2)] for op, (n, ms) in ranked[:top]]}
