"""End to end: MLP training steps/s, each contender in its own long-lived process.

Contenders: TrainingSession (fast path and full graph), torch eager (Adam, default and
fused), and — with ``--ortt-python PATH``, a Python whose environment has
onnxruntime-training — onnxruntime-training's on-device API (``_ortt_worker.py``, AdamW).
Each trains on the same cycle of batches (:mod:`.dataset`: not one batch repeated) after
the same warm-up. Rounds are interleaved (each round runs every contender once, one at a
time, so load hits all alike); the table gives the best round and, against
onnxruntime-training, the median of the per-round ratios.
"""

from __future__ import annotations

import statistics
from collections.abc import Callable

from . import threads
from .contenders import ORTT
from .dataset import BATCHES, WARMUP_STEPS, mlp_batches
from .measure import ORTT_WORKER, worker_command
from .rounds import interleaved, median_ratio
from .timing import serve

MLP_CONTENDERS = {
    "training_session_fast": "TrainingSession fast path (in-place fused Adam)",
    "training_session_graph": "TrainingSession full graph (fast=False, native kernels)",
    "torch_eager": "torch eager, torch.optim.Adam (default impl)",
    "torch_eager_fused": "torch eager, torch.optim.Adam(fused=True)",
}
ORTT_LABEL = "onnxruntime-training 1.19 on-device API (AdamW)"
DEFAULT_SHAPES = ("64,128,10x64", "784,1024,1024,10x128")


def parse_shape(text: str) -> tuple[tuple[int, ...], int]:
    """``"64,128,10x64"`` -> ((64, 128, 10), 64): layer sizes and batch."""
    sizes, batch = text.split("x")  # ValueError unless exactly one "x"
    layers = tuple(int(s) for s in sizes.split(","))
    if len(layers) < 2 or min(layers) < 1 or int(batch) < 1:
        raise ValueError(f"bad MLP shape {text!r}")
    return layers, int(batch)


def mlp_runner(name: str, shape: tuple[tuple[int, ...], int]) -> Callable[[int], None]:
    """``run(steps)`` for one contender: ReLU MLP, cross-entropy, Adam lr 1e-3, cycling
    through :func:`.dataset.mlp_batches`."""
    sizes, batch = shape
    batches = mlp_batches(sizes, batch)
    if name.startswith("training_session"):
        from onnx_training_ops.builder import build_training_model
        from onnx_training_ops.demo import make_mlp
        from onnx_training_ops.optim.adam import Adam
        from onnx_training_ops.training import TrainingSession

        from .contenders import DEFAULT_OPTIONS, session_options

        session = TrainingSession(build_training_model(make_mlp(sizes), "cross_entropy", Adam(lr=1e-3)),
                                  fast=name.endswith("fast"), sess_options=session_options(DEFAULT_OPTIONS))
        feeds = [{"input": x, "labels": y} for x, y in batches]
        step = session.step

        def run(steps):
            for i in range(steps):
                step(feeds[i % BATCHES])

        return run
    import torch

    threads.torch_pinned(torch)
    torch.manual_seed(0)
    layers = []
    for fan_in, fan_out in zip(sizes[:-1], sizes[1:]):
        layers += [torch.nn.Linear(fan_in, fan_out), torch.nn.ReLU()]
    net = torch.nn.Sequential(*layers[:-1])
    opt = torch.optim.Adam(net.parameters(), lr=1e-3, **({"fused": True} if name.endswith("fused") else {}))
    tensors = [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in batches]
    loss_fn = torch.nn.CrossEntropyLoss()

    def run(steps):
        for i in range(steps):
            x, y = tensors[i % BATCHES]
            opt.zero_grad()
            loss_fn(net(x), y).backward()
            opt.step()

    return run


def mlp_worker(name: str, shape: tuple[tuple[int, ...], int]) -> None:
    """Warm up, then serve steps on stdin (:func:`.timing.serve`)."""
    run = mlp_runner(name, shape)
    run(WARMUP_STEPS)
    serve(run, {"ready": name, "threads": threads.in_use()})


def _command(name: str, shape, worker_script: str | None, ortt_python: str | None) -> list[str]:
    sizes, batch = shape
    if name == ORTT:
        return [ortt_python, ORTT_WORKER, "mlp", ",".join(map(str, sizes)), str(batch)]
    return worker_command(worker_script) + ["--mlp-worker", name, "--mlp-shape", f"{','.join(map(str, sizes))}x{batch}"]


def measure_mlp(names, steps: int = 1000, rounds: int = 5, worker_script: str | None = None,
                shape=((64, 128, 10), 64), ortt_python: str | None = None, settle: float = 0.2) -> dict:
    """Steps/s per contender (best round, median round, every round), peak RSS and, with
    onnxruntime-training, each contender's median per-round ratio to it."""
    names = list(names) + ([ORTT] if ortt_python else [])
    outcomes = interleaved({name: _command(name, shape, worker_script, ortt_python) for name in names},
                           steps, rounds, settle)
    out = {}
    for name, o in outcomes.items():
        if o.na is not None:
            out[name] = {"n/a": o.na}
            continue
        rates = [1 / s for s in o.seconds_per_step]
        out[name] = {"steps_per_s": max(rates), "median_steps_per_s": statistics.median(rates), "rounds": rates,
                     "steps_per_round": steps, "peak_rss_mb": o.peak_rss_mb,
                     "label": ORTT_LABEL if name == ORTT else MLP_CONTENDERS[name], "threads": o.ready.get("threads")}
        if ORTT in outcomes:
            ratio = median_ratio(outcomes[ORTT], o)  # their time / ours = our steps/s / theirs
            if ratio is not None:
                out[name]["vs_ortt"] = ratio
    return out


def format_mlp(mlp: dict, shape: str = DEFAULT_SHAPES[0]) -> str:
    ref = mlp.get("torch_eager", {}).get("steps_per_s")
    sizes, batch = parse_shape(shape)
    lines = [f"MLP {'-'.join(map(str, sizes))}, batch {batch}, Adam: training steps/s "
             "(best round; interleaved, own processes)"]
    for name, r in mlp.items():
        if "n/a" in r:
            label = ORTT_LABEL if name == ORTT else MLP_CONTENDERS.get(name, name)
            lines.append(f"  {label:55s}      n/a  {r['n/a']}")
            continue
        ratio = f"{r['steps_per_s'] / ref:5.2f}x torch eager" if ref else ""
        if "vs_ortt" in r:
            ratio += f"  {r['vs_ortt']:5.2f}x onnxruntime-training (median of round ratios)"
        lines.append(f"  {r['label']:55s} {r['steps_per_s']:8.0f}  {ratio}")
    return "\n".join(lines)
