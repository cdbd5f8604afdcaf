"""Training steps on a GPU: ours against torch eager fp32 and torch AMP bf16, one process each.

    python -m onnx_training_ops bench gpu [--models gpt2-124m,gpt2-355m,bert-base,resnet50]
                                          [--contenders ours,torch_fp32,torch_bf16] [--device cuda]
                                          [--losses 10] [--timed 20] [--batch B] [--seq S] [--json PATH]

Every contender trains the :mod:`.zoo` model with AdamW (lr 1e-4, weight decay 0.01, eps 1e-8)
on the same cycle of batches: the first ``--losses`` steps' losses side by side, then the
median of ``--timed`` steps, and the peak device memory (torch: ``max_memory_allocated``; ours:
the process's memory as ``nvidia-smi`` reports it, onnxruntime's arena included; on the CPU the
peak RSS of each process). TF32 is off on both sides for fp32 parity.

``ours`` is the exported step (:func:`~onnx_training_ops.export.export_step` with
``flat_optimizer=True``: standard ONNX ops, one optimizer chain over all parameters) trained by
:class:`~onnx_training_ops.export.DeviceTrainer`, the state resident on the device;
``ours_per_tensor`` the same with the optimizer per tensor.
``--device cpu`` runs the same on the CPU EP (what the test suite checks; it needs no GPU).
The defaults are the sizes of the GPU issue: GPT-2 batch 8 x 256, BERT-base 32 x 128,
ResNet-50 64 x 224 x 224 with train-mode BatchNorm, and the ~1.1B Llama with LoRA adapters of
:mod:`.lora` (batch 4 x 128; only the adapters train).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

from . import lora, zoo
from .model_runners import BETAS, EPS, LR, WEIGHT_DECAY, training_model

CONTENDERS = {
    "session": "ours: TrainingSession(device=...) with input_shapes (state on the device, CUDA graph when safe)",
    "session_nograph": "ours: the same with cuda_graph=False",
    "ours": "ours: export_step(flat_optimizer=True) + DeviceTrainer (state on the device)",
    "ours_per_tensor": "ours, the optimizer per tensor (export_step's default)",
    "torch_fp32": "torch eager fp32, AdamW",
    "torch_bf16": "torch eager, autocast bf16, AdamW",
}
DEFAULT_MODELS = ("gpt2-124m", "gpt2-355m", "bert-base", "resnet50", lora.SPEC.name)
# the batch sizes the GPU issue measures at
GPU_SIZES = {"gpt2-124m": {"batch": 8, "seq": 256}, "gpt2-355m": {"batch": 8, "seq": 256},
             "bert-base": {"batch": 32, "seq": 128}, "resnet50": {"batch": 64}, lora.SPEC.name: {}}
BATCHES = 4


def model_spec(name: str, batch: int | None = None, seq: int | None = None) -> zoo.Spec:
    """The zoo's spec (or the LoRA case's, :mod:`.lora`) at the GPU issue's sizes, or the given
    ``batch``/``seq``."""
    base = lora.SPEC if name == lora.SPEC.name else zoo.SPECS[name]
    sizes = dict(GPU_SIZES.get(name, {}))
    if batch:
        sizes["batch"] = batch
    if seq and base.family in ("bert", "gpt2", "llama"):
        sizes["seq"] = seq
    if not sizes:
        return base
    suffix = ",".join(f"{k}={v}" for k, v in sorted(sizes.items()))
    return dataclasses.replace(base, name=f"{name}[{suffix}]", **sizes)


def _batches(spec: zoo.Spec) -> list[dict]:
    return lora.batches(spec, BATCHES) if spec.family == "llama" else zoo.batches(spec, BATCHES)


def _training_model(spec: zoo.Spec):
    """Our training model of ``spec`` (AdamW as :mod:`.model_runners`; LoRA: the adapters train)."""
    if spec.family != "llama":
        return training_model(spec)
    from ..builder import AdamW, build_training_model

    path = lora.export(spec)
    return build_training_model(path, lora.loss(spec), AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
                                labels="labels", trainable=lora.trainable(path))


def _device_memory_mb() -> float | None:
    """This process's GPU memory (MiB) as nvidia-smi reports it, or None."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    for line in out.splitlines():
        pid, _, used = line.partition(",")
        if pid.strip() == str(os.getpid()):
            return float(used)
    return None


def _ours(spec: zoo.Spec, device: str, flat: bool):
    from ..export import DeviceTrainer, export_step

    directory = tempfile.mkdtemp(prefix="bench_gpu_")
    export_step(_training_model(spec), directory, flat_optimizer=flat)
    providers = ([("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"] if device == "cuda"
                 else ["CPUExecutionProvider"])
    batches = _batches(spec)
    # static shapes: the step's shape arithmetic folded at load (no host round trip for it)
    trainer = DeviceTrainer(directory, providers, input_shapes={k: list(v.shape) for k, v in batches[0].items()})

    def step(i: int) -> float:
        return float(trainer.step(batches[i % BATCHES])["loss"])

    def peak_mb() -> float | None:
        return _device_memory_mb() if device == "cuda" else None

    return step, lambda: None, peak_mb


def _session(spec: zoo.Spec, device: str, cuda_graph: bool | None):
    from ..training.session import TrainingSession

    providers = ([("CUDAExecutionProvider", {"use_tf32": "0"}), "CPUExecutionProvider"] if device == "cuda"
                 else ["CPUExecutionProvider"])
    batches = _batches(spec)
    session = TrainingSession(_training_model(spec), providers, device=device, cuda_graph=cuda_graph,
                              input_shapes={k: list(v.shape) for k, v in batches[0].items()})

    def step(i: int) -> float:
        return float(session.step(batches[i % BATCHES])["loss"])

    def peak_mb() -> float | None:
        return _device_memory_mb() if device == "cuda" else None

    return step, lambda: None, peak_mb


def _torch(spec: zoo.Spec, device: str, bf16: bool):
    import torch

    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    llama = spec.family == "llama"
    module = (lora.torch_model(spec) if llama else zoo.torch_model(spec)).to(device)
    trained = [p for p in module.parameters() if p.requires_grad]  # peft froze the base of the LoRA model
    optimizer = torch.optim.AdamW(trained, lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    batches = [{k: torch.from_numpy(v).to(device) for k, v in b.items()} for b in _batches(spec)]
    names = ("input_ids", "attention_mask") if llama else spec.input_names

    def step(i: int) -> float:
        b = batches[i % BATCHES]
        optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=bf16):
            logits = module(*[b[n] for n in names])
        loss = (lora.torch_loss(logits.float(), b["labels"]) if llama
                else zoo.torch_loss(spec, logits.float(), b["labels"]))
        loss.backward()
        optimizer.step()
        return float(loss.detach())  # a sync per step, as ours has (its loss comes down)

    def sync() -> None:
        if device == "cuda":
            torch.cuda.synchronize()

    def peak_mb() -> float | None:
        return torch.cuda.max_memory_allocated() / 2**20 if device == "cuda" else None

    return step, sync, peak_mb


def worker(contender: str, name: str, device: str, losses: int, timed: int, batch: int | None,
           seq: int | None) -> dict:
    """One contender on one model, in this process: losses, step times, peak memory."""
    spec = model_spec(name, batch, seq)
    if contender.startswith("session"):
        step, sync, peak_mb = _session(spec, device, False if contender == "session_nograph" else None)
    elif contender.startswith("ours"):
        step, sync, peak_mb = _ours(spec, device, flat=contender == "ours")
    else:
        step, sync, peak_mb = _torch(spec, device, contender == "torch_bf16")
    seen = [step(i) for i in range(losses)]
    sync()
    times = []
    for i in range(timed):
        start = time.perf_counter()
        step(losses + i)
        sync()
        times.append(time.perf_counter() - start)
    return {"contender": contender, "model": spec.name, "device": device, "losses": seen,
            "ms_per_step": 1e3 * statistics.median(times) if times else None,
            "peak_device_mb": peak_mb(), "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024}


def _run_worker(contender: str, name: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "onnx_training_ops.bench.gpu", "--worker", contender, name,
               "--device", args.device, "--losses", str(args.losses), "--timed", str(args.timed)]
    if args.batch:
        command += ["--batch", str(args.batch)]
    if args.seq:
        command += ["--seq", str(args.seq)]
    run = subprocess.run(command, capture_output=True, text=True)
    if run.returncode != 0:
        return {"contender": contender, "model": name, "error": (run.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def format_table(results: list[dict]) -> str:
    """Step times, ratios to torch fp32 / bf16, peak memory and the losses side by side."""
    lines = [f"{'model':<14} {'contender':<15} {'ms/step':>9} {'/fp32':>6} {'/bf16':>6} {'peak MB':>9}  losses"]
    by_model: dict[str, dict[str, dict]] = {}
    for r in results:
        by_model.setdefault(r["model"], {})[r["contender"]] = r
    for model, rows in by_model.items():
        for contender, r in rows.items():
            if "error" in r:
                lines.append(f"{model:<14} {contender:<15} failed: {r['error']}")
                continue
            ratio = {k: (r["ms_per_step"] / rows[k]["ms_per_step"]) if rows.get(k, {}).get("ms_per_step") else None
                     for k in ("torch_fp32", "torch_bf16")}
            peak = r["peak_device_mb"] if r["peak_device_mb"] is not None else r["peak_rss_mb"]
            losses = " ".join(f"{x:.6f}" for x in r["losses"])
            lines.append(f"{model:<14} {contender:<15} {r['ms_per_step']:9.2f} "
                         f"{ratio['torch_fp32'] or float('nan'):6.2f} {ratio['torch_bf16'] or float('nan'):6.2f} "
                         f"{peak:9.0f}  {losses}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="onnx-training-ops bench gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--contenders", default=",".join(CONTENDERS))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--losses", type=int, default=10, help="steps whose losses are compared")
    ap.add_argument("--timed", type=int, default=20, help="steps timed after them (median)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--json", default=None)
    ap.add_argument("--worker", nargs=2, metavar=("CONTENDER", "MODEL"), help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.device, args.losses, args.timed, args.batch, args.seq)))
        return 0
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in contenders if c not in CONTENDERS]
    models = [m for m in args.models.split(",") if m]
    unknown += [m for m in models if m not in zoo.SPECS and m != lora.SPEC.name]
    if unknown:
        print(f"bench gpu: unknown contender or model {', '.join(unknown)}; contenders: {', '.join(CONTENDERS)}; "
              f"models: {', '.join(zoo.SPECS)}", file=sys.stderr)
        return 2
    print(f"device {args.device}; load average {os.getloadavg()[0]:.2f}", flush=True)
    results = []
    for name in models:
        for contender in contenders:
            results.append(_run_worker(contender, name, args))
            print(format_table(results[-1:]).splitlines()[-1], flush=True)
    print(format_table(results))
    print(f"load average {os.getloadavg()[0]:.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
