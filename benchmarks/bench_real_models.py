"""Parity and step time on the model zoo of tests/real_models.py (the README's table).

For every architecture and exporter: the largest gradient error against torch autograd
(max |ours - torch| / max |torch| over the parameters, float32); then, for BERT and ResNet,
the time of one Adam training step in TrainingSession against torch eager (median of
interleaved rounds in one process, torch on 2 threads, onnxruntime on its default pool).

Run: ``python benchmarks/bench_real_models.py [--steps N]`` (about a minute).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

import torch  # noqa: E402
from gradient_utils import runnable, session  # noqa: E402
from real_models import EXPORTERS, ZOO, build, export, parameter_map  # noqa: E402
from test_real_models import _feeds, _ours_per_torch_param, _targets, _torch_grads, _torch_loss, _with_loss_and_gradient  # noqa: E402

from onnx_training_ops import Adam, TrainingSession, build_training_model  # noqa: E402
from onnx_training_ops.passes.split_sequences import split_sequences  # noqa: E402


def gradient_error(name: str, exporter: str) -> tuple[str, float | None]:
    module, inputs = build(name)
    try:
        model = export(module, inputs, exporter)
    except Exception as error:  # noqa: BLE001  the exporter's own failure
        return f"export fails: {type(error).__name__}", None
    pmap = parameter_map(model, module)
    targets = _targets(name, module, inputs)
    _, want = _torch_grads(name, module, inputs, targets)
    params = [p for p, (t, _) in pmap.items() if t in want]
    expanded = runnable(split_sequences(_with_loss_and_gradient(model, name, params)))
    names = ["loss"] + [f"grad/{p}" for p in params]
    got = dict(zip(names, session(expanded).run(names, _feeds(inputs, targets, model))))
    ours = _ours_per_torch_param({p: pmap[p] for p in params}, {p: got[f"grad/{p}"] for p in params})
    largest = max(float(np.abs(g).max()) for g in want.values())
    err = max(float(np.abs(ours[n] - g).max()) / max(float(np.abs(g).max()), 1e-3 * largest)
              for n, g in want.items())
    opset = next(o.version for o in model.opset_import if o.domain in ("", "ai.onnx"))
    return f"opset {opset}, {len(params)} tensors", err


def step_times(name: str, steps: int) -> tuple[float, float]:
    module, inputs = build(name)
    model = export(module, inputs, "torchscript")
    pmap = parameter_map(model, module)
    targets = _targets(name, module, inputs)
    ts = TrainingSession(build_training_model(model, ZOO[name].loss, Adam(lr=1e-4),
                                              trainable=list(pmap)))
    feeds = _feeds(inputs, targets, model)
    opt = torch.optim.Adam(module.parameters(), lr=1e-4)

    def torch_step():
        opt.zero_grad()
        _torch_loss(name, module(*inputs.values()), targets).backward()
        opt.step()

    ours, theirs = [], []
    for _ in range(5):
        ts.step(feeds)
        torch_step()
    for _ in range(steps):  # interleaved rounds
        t0 = time.perf_counter()
        ts.step(feeds)
        t1 = time.perf_counter()
        torch_step()
        t2 = time.perf_counter()
        ours.append(t1 - t0)
        theirs.append(t2 - t1)
    return float(np.median(ours)) * 1e3, float(np.median(theirs)) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=50)
    args = parser.parse_args()
    torch.set_num_threads(2)
    print("| architecture | exporter | graph | max gradient error vs torch |")
    print("|---|---|---|---|")
    for name in ZOO:
        for exporter in EXPORTERS:
            what, err = gradient_error(name, exporter)
            print(f"| {name} | {exporter} | {what} | {'—' if err is None else f'{err:.1e}'} |",
                  flush=True)
    print()
    print("| model (tiny config, batch 2) | TrainingSession step (ms) | torch eager step (ms) | ratio |")
    print("|---|---|---|---|")
    for name in ("bert", "resnet"):
        ours, theirs = step_times(name, args.steps)
        print(f"| {name} | {ours:.2f} | {theirs:.2f} | {ours / theirs:.2f}x |", flush=True)


if __name__ == "__main__":
    main()
