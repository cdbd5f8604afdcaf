"""The report: the table of times and ratios, the JSON and the plot."""

from __future__ import annotations

import json
import os

CELL = 27
# A time below 1/FLOOR_MARGIN of the DRAM bandwidth floor moves data faster than even the
# caches can; a contender more than 1/TORCH_MARGIN times faster than torch_fused (a one-pass
# fused loop, as ours) means torch_fused stalled, e.g. its thread pool waiting for a busy core.
FLOOR_MARGIN = 20
TORCH_MARGIN = 0.05


def format_header(contenders) -> str:
    """The table's header line."""
    return f"{'op':9s} {'n':>9s} " + " ".join(f"{c:>{CELL}s}" for c in contenders) + f" {'floor':>10s}"


def implausible(row: dict, stat: str = "median_s") -> dict[str, str]:
    """Contender -> why its time in ``row`` cannot be right (see FLOOR_MARGIN, TORCH_MARGIN)."""
    out = {}
    ref = row["times"].get("torch_fused", {}).get(stat)
    for c, tm in row["times"].items():
        if tm[stat] < row["floor_s"] / FLOOR_MARGIN:
            out[c] = f"{_ms(tm[stat]).strip()} is below 1/{FLOOR_MARGIN} of the bandwidth floor"
        elif ref and c != "torch_fused" and tm[stat] / ref < TORCH_MARGIN:
            out["torch_fused"] = (f"{_ms(ref).strip()} is {ref / tm[stat]:.0f}x {c}'s time for the same one-pass "
                                  "update: it stalled (a thread pool waiting for a busy core?)")
    return out


def flags(report: dict) -> list[str]:
    """One line per time that cannot be right, for the table and the JSON."""
    stat = report.get("stat", "median_s")
    return [f"{r['op']} {r['n']} {c}: {why}" for r in report["results"] for c, why in implausible(r, stat).items()]


def format_row(row: dict, contenders, stat: str = "median_s") -> str:
    """One (op, n) row: per contender the time, its ratio to torch_fused (xT) and to the floor
    (xF); ``!`` marks a time that cannot be right (:func:`implausible`)."""
    ref = row["times"].get("torch_fused", {}).get(stat)
    bad = implausible(row, stat)
    cells = []
    for c in contenders:
        tm = row["times"].get(c)
        if tm is None:
            cells.append(f"{'n/a':>{CELL}s}")
            continue
        vs_torch = f"{tm[stat] / ref:5.2f}xT" if ref else "   -   "
        cells.append(f"{_ms(tm[stat])} {vs_torch} {tm[stat] / row['floor_s']:5.1f}xF{'!' if c in bad else ''}")
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
    flagged = flags(report)
    if flagged:
        lines += ["", f"flagged (!), cannot be right; load average before/after "
                      f"{report.get('loadavg_before_after')}: rerun on an idle machine or with --threads 1"]
        lines += ["  " + f for f in flagged]
    return "\n".join(lines)


PLOT_COLUMNS = 2  # panels per row: 5 panels make a 1200x1380 px page, not a 2700x480 strip


def plot(report: dict, path: str, stat: str = "median_s") -> None:
    """Time per step against size, one panel per op (plus the MLP steps/s), to ``path``."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ops = list(dict.fromkeys(r["op"] for r in report["results"]))
    shapes = report.get("mlp", {})
    shape = next(iter(shapes), "")
    mlp = {k: v for k, v in shapes.get(shape, {}).items() if "steps_per_s" in v}
    panels = len(ops) + bool(mlp)
    ncols = min(PLOT_COLUMNS, panels)
    nrows = -(-panels // ncols)
    plt.rcParams.update({"font.size": 11})
    fig, grid = plt.subplots(nrows, ncols, figsize=(6 * ncols, 4.6 * nrows), squeeze=False)
    axes = list(grid.flat)
    for ax in axes[panels:]:
        ax.set_visible(False)
    for ax, op in zip(axes, ops):
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
    axes[0].legend(fontsize=9)
    if mlp:
        ax = axes[panels - 1]
        ax.barh(list(mlp), [v["steps_per_s"] for v in mlp.values()])
        ax.set_title(f"MLP {shape}, Adam")
        ax.set_xlabel("training steps/s")
        ax.tick_params(axis="y", labelsize=9)
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=100)


def write_json(report: dict, path: str) -> None:
    """The report as JSON at ``path`` (directories created)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump(report, f, indent=1)
