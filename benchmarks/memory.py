"""Memory of fine-tuning real models: peak RSS per phase, ours vs torch eager vs onnxruntime-training.

    python -m benchmarks memory [--models gpt2-124m,gpt2-355m,bert-base]
        [--contenders ours,torch,onnxruntime_training] [--ortt-python PATH] [--steps 6]
        [--resume] [--cache DIR] [--json benchmarks/results/memory.json]

For each model of :mod:`.zoo` (random init, weights perturbed, exported once by the
TorchScript exporter and cached) and each contender, **in its own process**, one run of
AdamW (lr 1e-4, weight decay 0.01, eps 1e-8) over the zoo's distinct batches, in phases:

* ``build``: ours ``build_training_model(export path, ...)``; torch the module (``zoo.torch_model``);
  onnxruntime-training ``artifacts.generate_artifacts`` (with ``--ortt-python``);
* ``session``: ours ``TrainingSession(training model)``; torch ``torch.optim.AdamW``;
  onnxruntime-training ``CheckpointState`` + ``Module`` + ``Optimizer``;
* ``first_step`` and ``steady`` (the other ``--steps - 1`` steps).

Each phase reports its own peak resident set (Linux ``VmHWM``, reset at the phase start:
:mod:`.rss`) and its wall time; the table gives the peaks, the run's peak against torch's,
build time, first-step time and the median steady step, and the losses (same weights, same
batches: step 0 equal, later steps within the optimizers' epsilon placement). ``--resume``
(ours): after the steps the session is saved, takes one more step, and a new process loads
the checkpoint and takes the same step: the loss and a SHA-256 of every state tensor must
be equal (bit-exact resumption).

The exports are made first, each in its own process (GPT-2 355M's export peaks near 8 GB).
Run the whole bench under the machine's heavy-job lock when it is shared.
"""

from __future__ import annotations

import argparse
import dataclasses
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

from . import lora, zoo
from .measure import loadavg
from .report import write_json
from .rss import Phases

DEFAULT_MODELS = ("gpt2-124m", "gpt2-355m", "bert-base")
CONTENDERS = ("ours", "torch", "onnxruntime_training")
LR, WEIGHT_DECAY, EPS = 1e-4, 0.01, 1e-8
ORTT_WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_ortt_memory_worker.py")
PHASES = ("build", "session", "first_step", "steady")


# --- the models: the zoo's, and the LoRA case (:mod:`.lora`) -------------------------------

def spec(name: str) -> zoo.Spec:
    return lora.SPEC if lora.is_lora(name) else zoo.spec(name)


def batches(s: zoo.Spec, count: int):
    return lora.batches(s, count) if s.family == "llama" else zoo.batches(s, count)


def model_names() -> list[str]:
    return [*zoo.SPECS, lora.SPEC.name]


# --- workers (each in its own process) ----------------------------------------------------

def _run_steps(meter: Phases, step, steps: int) -> dict:
    """The first step and ``steps - 1`` steady ones under ``meter``; losses and times."""
    losses, times = [], []

    def timed(i):
        t0 = time.perf_counter()
        losses.append(float(step(i)))
        times.append(time.perf_counter() - t0)

    with meter.phase("first_step"):
        timed(0)
    with meter.phase("steady"):
        for i in range(1, steps):
            timed(i)
    return {"losses": losses, "first_step_s": times[0],
            "steady_step_s": statistics.median(times[1:]) if len(times) > 1 else None}


def state_digest(session) -> str:
    """SHA-256 over every state tensor of ``session`` (names and bytes, in name order)."""
    digest = hashlib.sha256()
    names = sorted(session.state_names)
    for name, array in zip(names, session.state_views(names)):
        digest.update(name.encode() + b"\0")
        digest.update(memoryview(array).cast("B") if array.flags.c_contiguous else array.tobytes())
    return digest.hexdigest()


def ours_worker(s: zoo.Spec, path: str, steps: int, checkpoint: str | None) -> dict:
    from onnx_training_ops.builder import AdamW, build_training_model
    from onnx_training_ops.training import TrainingSession

    meter = Phases()
    feeds = batches(s, min(steps + 1, 16))
    llama = s.family == "llama"
    with meter.phase("build"):
        training = build_training_model(path, lora.loss(s) if llama else zoo.loss(s),
                                        AdamW(lr=LR, weight_decay=WEIGHT_DECAY, eps=EPS), mode=s.mode,
                                        labels="labels", trainable=lora.trainable(path) if llama else None)
    with meter.phase("session"):
        session = TrainingSession(training)
        # the session holds its own copy; onnxruntime-training's worker keeps no model in memory
        # either (its artifacts are files): holding it would count 187 MB more on GPT-2 4L/256
        del training
    out = _run_steps(meter, lambda i: session.step(feeds[i % len(feeds)])["loss"], steps)
    if checkpoint:
        with meter.phase("save"):
            session.save(checkpoint)
        out["checkpoint_bytes"] = _bytes_on_disk(checkpoint)
        out["next_loss"] = float(session.step(feeds[steps % len(feeds)])["loss"])
        out["next_digest"] = state_digest(session)
    out.update(meter.report())
    return out


def resume_worker(s: zoo.Spec, checkpoint: str, steps: int) -> dict:
    """Load ``checkpoint`` in this fresh process and take the step the saver took next."""
    from onnx_training_ops.training import TrainingSession

    meter = Phases()
    feeds = batches(s, min(steps + 1, 16))
    with meter.phase("load"):
        session = TrainingSession(checkpoint)
    with meter.phase("next_step"):
        loss = float(session.step(feeds[steps % len(feeds)])["loss"])
    return {"next_loss": loss, "next_digest": state_digest(session), **meter.report()}


def torch_worker(s: zoo.Spec, steps: int) -> dict:
    import torch

    meter = Phases()
    feeds = batches(s, min(steps + 1, 16))
    with meter.phase("build"):
        module = lora.torch_model(s) if s.family == "llama" else zoo.torch_model(s)
    with meter.phase("session"):  # peft froze the base of the LoRA model: only the adapters train
        optimizer = torch.optim.AdamW([p for p in module.parameters() if p.requires_grad], lr=LR,
                                      weight_decay=WEIGHT_DECAY, eps=EPS)

    def step(i):
        feed = feeds[i % len(feeds)]
        optimizer.zero_grad()
        logits = module(*[torch.from_numpy(feed[n]) for n in ("input_ids", "attention_mask")]) \
            if s.family == "llama" else module(*[torch.from_numpy(feed[n]) for n in s.input_names])
        labels = torch.from_numpy(feed["labels"])
        loss = lora.torch_loss(logits, labels) if s.family == "llama" else zoo.torch_loss(s, logits, labels)
        loss.backward()
        optimizer.step()
        return loss.detach()

    out = _run_steps(meter, step, steps)
    out.update(meter.report())
    return out


def _bytes_on_disk(path: str) -> int:
    """The checkpoint file and the external data files beside it that it names."""
    import onnx

    total = os.path.getsize(path)
    model = onnx.load(path, load_external_data=False)
    from onnx.external_data_helper import ExternalDataInfo, _get_all_tensors, uses_external_data

    locations = {ExternalDataInfo(t).location for t in _get_all_tensors(model) if uses_external_data(t)}
    for info in model.training_info:
        for graph in (info.initialization, info.algorithm):
            locations |= {ExternalDataInfo(t).location for t in graph.initializer if uses_external_data(t)}
    return total + sum(os.path.getsize(os.path.join(os.path.dirname(path), loc)) for loc in locations)


# --- the orchestrator -------------------------------------------------------------------

def _worker(args: list[str], python: str | None = None, script: str | None = None) -> dict:
    """Run a worker process; its JSON report, or ``{"n/a": reason}``."""
    cmd = [python, script] if script else [sys.executable, "-m", "benchmarks.memory"]
    try:
        proc = subprocess.run(cmd + args, capture_output=True, text=True)
    except OSError as error:
        return {"n/a": f"cannot run {cmd[0]}: {error}"}
    if proc.returncode:
        lines = [line for line in proc.stderr.strip().splitlines() if line.strip()]
        return {"n/a": f"worker failed: {lines[-1] if lines else proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def export_in_subprocess(name: str, cache: str | None) -> str:
    """The export of ``name`` (made in a process of its own, which frees its memory)."""
    if lora.is_lora(name):
        code = ("import sys; from benchmarks import lora; "
                "print(lora.export(lora.SPEC, sys.argv[1] or None))")
        cmd = [sys.executable, "-c", code, cache or ""]
    else:
        cmd = [sys.executable, "-m", "benchmarks.zoo", name] + (["--cache", cache] if cache else [])
    proc = subprocess.run(cmd, capture_output=True, text=True)
    if proc.returncode:
        raise RuntimeError(f"exporting {name} failed: {proc.stderr.strip().splitlines()[-1:]}")
    return proc.stdout.strip().splitlines()[-1]


def measure_model(name: str, contenders, steps: int, ortt_python: str | None, cache: str | None,
                  resume: bool, log=print) -> dict:
    s = spec(name)
    path = export_in_subprocess(name, cache)
    out = {"spec": dataclasses.asdict(s), "export": path, "contenders": {}}
    for contender in contenders:
        log(f"{name}: {contender} ...")
        if contender == "onnxruntime_training":
            if not ortt_python or s.family == "llama":  # its worker knows the zoo's heads only
                continue
            spec_json = json.dumps(dataclasses.asdict(s))
            out["contenders"][contender] = _worker([path, spec_json, str(steps), str(LR), str(WEIGHT_DECAY)],
                                                   ortt_python, ORTT_WORKER)
            continue
        args = ["--worker", contender, "--model", name, "--path", path, "--steps", str(steps)]
        if contender == "ours" and resume:
            with tempfile.TemporaryDirectory(prefix="bench_memory_", dir=cache or zoo.cache_dir()) as tmp:
                checkpoint = os.path.join(tmp, "checkpoint.onnx")
                result = _worker(args + ["--checkpoint", checkpoint])
                if "n/a" not in result:
                    again = _worker(["--worker", "resume", "--model", name, "--path", checkpoint,
                                     "--steps", str(steps)])
                    result["resume"] = again
                    result["resume_bit_exact"] = "n/a" not in again and \
                        again["next_loss"] == result["next_loss"] and again["next_digest"] == result["next_digest"]
        else:
            result = _worker(args)
        out["contenders"][contender] = result
    return out


def format_table(report: dict) -> str:
    """Markdown: one row per model and contender."""
    gib = 1 / 1024
    lines = ["| model | contender | build peak GiB (s) | session peak GiB (s) | first step peak GiB (s) | "
             "steady peak GiB | steady step s | peak GiB | vs torch | losses first / last |",
             "|---|---|---|---|---|---|---|---|---|---|"]
    for name, model in report["models"].items():
        torch_peak = model["contenders"].get("torch", {}).get("peak_mib")
        for contender, r in model["contenders"].items():
            if "n/a" in r:
                lines.append(f"| {name} | {contender} | n/a: {r['n/a']} |||||||||")
                continue
            cells = [f"{r[p]['peak_mib'] * gib:.2f} ({r[p]['seconds']:.1f})" for p in PHASES[:3]]
            ratio = f"{r['peak_mib'] / torch_peak:.2f}x" if torch_peak else "—"
            losses = f"{r['losses'][0]:.5f} / {r['losses'][-1]:.5f}"
            lines.append(f"| {name} | {contender} | {' | '.join(cells)} | {r['steady']['peak_mib'] * gib:.2f} | "
                         f"{r['steady_step_s'] or 0:.2f} | {r['peak_mib'] * gib:.2f} | {ratio} | {losses} |")
            if "resume_bit_exact" in r:
                lines.append(f"| {name} | ours: save peak {r['save']['peak_mib'] * gib:.2f} GiB, "
                             f"{r['save']['seconds']:.1f} s, "
                             f"{r['checkpoint_bytes'] / 2**30:.2f} GiB on disk; resumed in a new process "
                             f"(load peak {r['resume'].get('peak_mib', 0) * gib:.2f} GiB) | bit-exact: "
                             f"{r['resume_bit_exact']} |||||||||")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks memory", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(model_names())}")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    ap.add_argument("--ortt-python", default=None, help="a Python with onnxruntime-training (its own venv)")
    ap.add_argument("--steps", type=int, default=6, help="training steps per run (first + steady), >= 2")
    ap.add_argument("--resume", action="store_true", help="ours: save, reload in a new process, compare a step")
    ap.add_argument("--cache", default=None, help="export cache (default: $ONNX_TRAINING_OPS_ZOO or ~/.cache)")
    ap.add_argument("--json", default="benchmarks/results/memory.json", help="write the report here ('' for none)")
    ap.add_argument("--worker", choices=("ours", "torch", "resume"), help=argparse.SUPPRESS)
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--path", help=argparse.SUPPRESS)
    ap.add_argument("--checkpoint", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.steps < 2:
        ap.error("--steps must be >= 2 (a first step and at least one steady one)")
    models = [m for m in args.models.split(",") if m]
    contenders = [c for c in args.contenders.split(",") if c]
    for m in models + ([args.model] if args.model else []):
        if m not in model_names():
            ap.error(f"unknown model {m!r}; known: {', '.join(model_names())}")
    for c in contenders:
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r}; known: {', '.join(CONTENDERS)}")
    if args.worker:
        s = spec(args.model)
        if args.worker == "ours":
            result = ours_worker(s, args.path, args.steps, args.checkpoint)
        elif args.worker == "torch":
            result = torch_worker(s, args.steps)
        else:
            result = resume_worker(s, args.path, args.steps)
        print(json.dumps(result))
        return 0
    report = {"loadavg_before": loadavg(), "steps": args.steps, "optimizer": {"AdamW": {
        "lr": LR, "weight_decay": WEIGHT_DECAY, "eps": EPS}}, "models": {}}
    for name in models:
        report["models"][name] = measure_model(name, contenders, args.steps, args.ortt_python, args.cache,
                                               args.resume)
    report["loadavg_after"] = loadavg()
    print(format_table(report))
    print(f"load average before {report['loadavg_before']}, after {report['loadavg_after']}")
    if args.json:
        write_json(report, args.json)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
