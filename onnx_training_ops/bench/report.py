"""The report: the table of times and ratios, the JSON and the plot."""

from __future__ import annotations

import json
import os

CELL = 27


def format_header(contenders) -> str:
    """The table's header line."""
    return f"{'op':9s} {'n':>9s} " + " ".join(f"{c:>{CELL}s}" for c in contenders) + f" {'floor':>10s}"


def format_row(row: dict, contenders, stat: str = "median_s") -> str:
    """One (op, n) row: per contender the time, its ratio to torch_fused (xT) and to the floor (xF)."""
    ref = row["times"].get("torch_fused", {}).get(stat)
    cells = []
    for c in contenders:
        tm = row["times"].get(c)
        if tm is None:
            cells.append(f"{'n/a':>{CELL}s}")
            continue
        vs_torch = f"{tm[stat] / ref:5.2f}xT" if ref else "   -   "
        cells.append(f"{_ms(tm[stat])} {vs_torch} {tm[stat] / row['floor_s']:5.1f}xF")
    return f"{row['op']:9s} {row['n']:>9d} " + " ".join(cells) + f" {_ms(row['floor_s'])}"


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:8.3f}ms"


def format_table(report: dict, contenders=None) -> str:
    """The table of every (op, n) row, then the ratios worth reading."""
    stat = report.get("stat", "median_s")
    if contenders is None:
        contenders = list(dict.fromkeys(c for r in report["results"] for c in [*r["times"], *r["n/a"]]))
    lines = [f"{stat[:-2]} time per step; xT = ratio to torch_fused, xF = ratio to the bandwidth floor",
             format_header(contenders)]  # fmt: skip
    lines += [format_row(r, contenders, stat) for r in report["results"]]
    ratios = []
    for r in report["results"]:
        t = {c: v[stat] for c, v in r["times"].items()}
        parts = []
        if "graph" in t and "onnx_reference_evaluator" in t:
            parts.append(f"graph speed-up over ReferenceEvaluator {t['onnx_reference_evaluator'] / t['graph']:5.1f}x")
        if "training_session" in t:
            parts.append(f"fast path {t['training_session'] / r['floor_s']:5.2f}x floor")
            if "torch_fused" in t:
                parts.append(f"fast path {t['training_session'] / t['torch_fused']:5.2f}x torch_fused")
        for name in ("graph", "graph_native", "portable", "onnxruntime_training"):
            if name in t and "torch_fused" in t:
                parts.append(f"{name} {t[name] / t['torch_fused']:5.2f}x torch_fused")
        if parts:
            ratios.append(f"{r['op']:9s} {r['n']:>9d}  " + "; ".join(parts))
    if ratios:
        lines += ["", "ratios:"] + ratios
    return "\n".join(lines)


def plot(report: dict, path: str, stat: str = "median_s") -> None:
    """Time per step against size, one panel per op (plus the MLP steps/s), to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in report["results"]))
    shapes = report.get("mlp", {})
    shape = next(iter(shapes), "")
    mlp = {k: v for k, v in shapes.get(shape, {}).items() if "steps_per_s" in v}
    ncols = len(ops) + bool(mlp)
    fig, axes = plt.subplots(1, ncols, figsize=(4.5 * ncols, 4), squeeze=False)
    for ax, op in zip(axes[0], ops):
        rows = [r for r in report["results"] if r["op"] == op]
        names = list(dict.fromkeys(c for r in rows for c in r["times"]))
        for c in names:
            pts = [(r["n"], r["times"][c][stat] * 1e3) for r in rows if c in r["times"]]
            ax.loglog(*zip(*pts), marker="o", label=c)
        ax.loglog([r["n"] for r in rows], [r["floor_s"] * 1e3 for r in rows], "k--", label="bandwidth floor")
        ax.set_title(f"{op} (float32, one step)")
        ax.set_xlabel("parameters")
        ax.set_ylabel(f"ms ({stat[:-2]})")
        ax.grid(True, which="both", alpha=0.3)
    axes[0][0].legend(fontsize=7)
    if mlp:
        ax = axes[0][-1]
        ax.barh(list(mlp), [v["steps_per_s"] for v in mlp.values()])
        ax.set_title(f"MLP {shape}, Adam")
        ax.set_xlabel("training steps/s")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)


def write_json(report: dict, path: str) -> None:
    """The report as JSON at ``path`` (directories created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
