"""Real-model training steps: ours against onnxruntime-training, torch eager and torch.compile.

    python -m benchmarks models [--models bert,gpt2,resnet18,mlp]
        [--contenders ours_fast,ours_graph,torch_eager,torch_compile] [--ortt-python PATH]
        [--rounds 7] [--round-seconds 3] [--threads 2] [--profile-steps 4] [--no-profile]
        [--warmup-seconds 1]
        [--cache DIR] [--json benchmarks/results/models.json]

The models are :mod:`.zoo`'s (one export, TorchScript, opset 17, no constant folding, that
every ONNX contender trains). Contenders (:mod:`.model_runners`): our TrainingSession (fast
path and ``fast=False``), torch eager and ``torch.compile`` on the same torch module and
weights, and with ``--ortt-python`` onnxruntime-training 1.19's on-device API in that
Python (:mod:`._ortt_models`; it gets the LayerNormalization output fix on its own copy of
the export, which the report states). All train the same tensors with AdamW (same
hyper-parameters) on the same cycle of 16 distinct batches, with ``--threads`` intra-op
threads.

Method: each contender in its own process, warmed up, then ``--rounds`` interleaved rounds
(:mod:`.rounds`) of about ``--round-seconds`` each; per contender the median ms/step, and
the median over rounds of the ratio ours / contender. Peak RSS is each worker's. Then,
unless ``--no-profile``, a profiled run (own process) of ours and of onnxruntime-training
gives the nodes executed per step and ours' kernel time by op type (:mod:`.ort_profile`).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import tempfile

from . import zoo
from .measure import ORTT_WORKER, loadavg
from .model_runners import CONTENDERS
from .rounds import interleaved, median_ratio

ORTT = "onnxruntime_training"
ORTT_LABEL = "onnxruntime-training 1.19 (AdamW)"
DEFAULT_MODELS = ("bert", "gpt2", "resnet18", "mlp")
LAYERNORM_NOTE = ("onnxruntime-training gets the LayerNormalization Mean/InvStdDev outputs added on its own "
                  "copy of the export (its gradient needs them; onnxruntime issue 19427)")


def _worker(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "benchmarks.models", *args]


def _commands(spec: zoo.Spec, contenders, ortt_python, trainable_path, common, cache, threads,
              warmup_seconds) -> dict:
    commands = {c: _worker(["--worker", c, *common]) for c in contenders}
    if ortt_python:
        commands[ORTT] = [ortt_python, ORTT_WORKER, "model", zoo.export(spec, cache),
                          json.dumps(dataclasses.asdict(spec)), trainable_path, str(threads), str(warmup_seconds)]
    return commands


def _profile(command: list[str]) -> dict:
    proc = subprocess.run(command, capture_output=True, text=True)
    if proc.returncode:
        lines = proc.stderr.strip().splitlines()
        return {"n/a": f"profile run failed: {lines[-1] if lines else proc.returncode}"}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def measure_model(spec: zoo.Spec, contenders, ortt_python=None, rounds=7, round_seconds=3.0, threads=2,
                  profile_steps=4, cache=None, warmup_seconds=1.0, log=print) -> dict:
    """One model's results: per contender ms/step, peak RSS, ratios; the profiles."""
    from .model_runners import trainable_names, training_model

    names = trainable_names(training_model(spec, cache))  # what every contender trains
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(names, f)
    try:
        common = ["--model", spec.name, "--threads", str(threads), "--warmup-seconds", str(warmup_seconds)] + (
            ["--cache", cache] if cache else [])
        commands = _commands(spec, contenders, ortt_python, f.name, common, cache, threads, warmup_seconds)
        outcomes = interleaved(commands, lambda name, ready: max(1, round(round_seconds / ready["step_s"])),
                               rounds, log=log)
        result = {"spec": dataclasses.asdict(spec), "contenders": {}, "profiles": {}}
        base = outcomes.get("ours_fast")
        for name, o in outcomes.items():
            cell = o.as_dict()
            if base is not None and name != "ours_fast":
                cell["ours_fast_over_this"] = median_ratio(base, o)
            result["contenders"][name] = cell
        if profile_steps:
            for name in [c for c in ("ours_fast", "ours_graph") if c in contenders]:
                result["profiles"][name] = _profile(_worker(["--profile-worker", name, "--profile-steps",
                                                             str(profile_steps), *common]))
            if ortt_python:
                result["profiles"][ORTT] = _profile(commands[ORTT] + ["--profile", str(profile_steps)])
    finally:
        os.unlink(f.name)
    return result


def _fmt(x, spec="7.1f"):
    return "n/a" if x is None else format(x, spec)


def _ms(seconds: float) -> str:
    """Milliseconds with 3 significant digits (an MLP step is a tenth of a millisecond)."""
    ms = seconds * 1e3
    return f"{ms:8.1f}" if ms >= 100 else f"{ms:8.2f}" if ms >= 1 else f"{ms:8.3f}"


def format_model(result: dict) -> str:
    s = result["spec"]
    title = {"bert": f"BERT {s['layers']}L/{s['hidden']}, batch {s['batch']} x {s['seq']}",
             "gpt2": f"GPT-2 {s['layers']}L/{s['hidden']}, causal LM, batch {s['batch']} x {s['seq']}",
             "resnet": f"ResNet-{sum(s['depths']) * 2 + 2} {s['image']}x{s['image']}, train-mode BatchNorm, "
                       f"batch {s['batch']}",
             "mlp": f"MLP {'-'.join(map(str, s['sizes']))}, batch {s['batch']}"}[s["family"]]
    lines = [f"{title} ({s['name']}): ms/step (median of rounds), peak RSS, ours_fast / contender "
             "(median of per-round ratios)"]
    profiles = result.get("profiles", {})
    for name, cell in result["contenders"].items():
        label = ORTT_LABEL if name == ORTT else CONTENDERS.get(name, name)
        if "n/a" in cell:
            lines.append(f"  {label:40s}     n/a  {cell['n/a']}")
            continue
        nodes = profiles.get(name, {}).get("nodes_per_step")
        lines.append(f"  {label:40s} {_ms(cell['median_s'])} ms  {_fmt(cell['peak_rss_mb'], '7.0f')} MB  "
                     f"ratio {_fmt(cell.get('ours_fast_over_this'), '5.2f')}"
                     + (f"  nodes/step {nodes:.0f}" if nodes is not None else ""))
    ours = profiles.get("ours_fast", {})
    if ours.get("by_op"):
        lines.append(f"  ours_fast profile: {ours['kernel_ms_per_step']:.1f} kernel ms/step; by op type "
                     "(nodes, ms): " + ", ".join(f"{op} {n:.0f} {ms:.1f}" for op, n, ms in ours["by_op"]))
    return "\n".join(lines)


def add_arguments(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS), help=f"comma list of {', '.join(zoo.SPECS)}")
    ap.add_argument("--contenders", default=",".join(CONTENDERS), help=f"comma list of {', '.join(CONTENDERS)}")
    ap.add_argument("--ortt-python", default=None, help="a Python with onnxruntime-training 1.19 (own venv)")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--round-seconds", type=float, default=3.0, help="about this long per contender and round")
    ap.add_argument("--threads", type=int, default=2,
                    help="intra-op threads of every contender; 0: each one's own default")
    ap.add_argument("--profile-steps", type=int, default=4, help="steps of the profiled run (first left out)")
    ap.add_argument("--warmup-seconds", type=float, default=1.0, help="each worker warms up at least this long")
    ap.add_argument("--no-profile", action="store_true")
    ap.add_argument("--cache", default=None, help=f"export cache (default {zoo.cache_dir()})")
    ap.add_argument("--json", default="benchmarks/results/models.json", help="write results here ('' for none)")
    ap.add_argument("--model", help=argparse.SUPPRESS)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--profile-worker", help=argparse.SUPPRESS)


def _serve_worker(args) -> int:
    from .model_runners import profile_ours, runner
    from .timing import serve, warm_up

    spec = zoo.SPECS[args.model]
    if args.profile_worker:
        out = profile_ours(spec, args.profile_worker == "ours_fast", args.threads, args.profile_steps, args.cache)
        print(json.dumps(out))
        return 0
    run, facts = runner(args.worker, spec, args.threads, args.cache)
    serve(run, {"ready": args.worker, "step_s": warm_up(run, min_seconds=args.warmup_seconds), **facts})
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks models", description=__doc__.split("\n\n")[0])
    add_arguments(ap)
    args = ap.parse_args(argv)
    models, contenders = args.models.split(","), [c for c in args.contenders.split(",") if c]
    for m in models + ([args.model] if args.model else []):
        if m not in zoo.SPECS:
            ap.error(f"unknown model {m!r}; known: {', '.join(zoo.SPECS)}")
    for c in contenders + [c for c in (args.worker, args.profile_worker) if c]:
        if c not in CONTENDERS:
            ap.error(f"unknown contender {c!r}; known: {', '.join(CONTENDERS)}")
    if args.ortt_python and not os.access(args.ortt_python, os.X_OK):
        ap.error(f"--ortt-python {args.ortt_python!r}: not an executable")
    if args.worker or args.profile_worker:
        return _serve_worker(args)
    report = {"loadavg_before": loadavg(), "threads": args.threads, "rounds": args.rounds,
              "ortt_python": args.ortt_python, "notes": [LAYERNORM_NOTE] if args.ortt_python else [], "models": {}}
    if args.ortt_python:
        print(f"note: {LAYERNORM_NOTE}")
    for name in models:
        print(f"measuring {name} ...", flush=True)
        result = measure_model(zoo.SPECS[name], contenders, args.ortt_python, args.rounds, args.round_seconds,
                               args.threads, 0 if args.no_profile else args.profile_steps, args.cache,
                               args.warmup_seconds, log=lambda m: print(m, flush=True))
        report["models"][name] = result
        print(format_model(result), flush=True)
    report["loadavg_after"] = loadavg()
    print(f"load average before {report['loadavg_before']}, after {report['loadavg_after']}")
    if args.json:
        os.makedirs(os.path.dirname(os.path.abspath(args.json)), exist_ok=True)
        with open(args.json, "w") as f:
            json.dump(report, f, indent=1)
        print(f"wrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
