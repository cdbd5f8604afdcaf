"""Training steps on a GPU: ours against torch eager fp32 and torch AMP bf16, one process each.

    python -m benchmarks gpu [--models gpt2-124m,gpt2-355m,bert-base,resnet50]
                                          [--contenders ours,torch_fp32,torch_bf16] [--device cuda]
                                          [--losses 10] [--timed 20] [--batch B] [--seq S] [--json PATH]

Every contender trains the :mod:`.zoo` model with AdamW (lr 1e-4, weight decay 0.01, eps 1e-8)
on the same cycle of batches: the first ``--losses`` steps' losses side by side, then the
median of ``--timed`` steps, and the peak device memory, measured the same way for every
contender (:class:`DeviceMemory`): the device-wide used memory (NVML) sampled while it runs, above
a baseline taken when its fresh process starts, so the CUDA context, onnxruntime's arena
(``arena_extend_strategy=kSameAsRequested``: it grows by what is asked, not by powers of two) and
torch's caching allocator all count (torch's ``max_memory_allocated`` is reported beside it). On
the CPU: the peak RSS of each process. TF32 is off on both sides for fp32 parity.

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
import threading
import time

from . import lora, zoo
from .model_runners import BETAS, EPS, LR, WEIGHT_DECAY, training_model

CONTENDERS = {
    "session": "ours: TrainingSession(device=...) with input_shapes (state on the device, CUDA graph when safe)",
    "session_nograph": "ours: the same with cuda_graph=False",
    "session_bf16": "ours: the device session with precision='bf16' (matmuls in bfloat16; CUDA only)",
    "ours": "ours: export_step(flat_optimizer=True) + DeviceTrainer (state on the device)",
    "ours_per_tensor": "ours, the optimizer per tensor (export_step's default)",
    "ours_bf16": "ours with precision='bf16' (matmuls in bfloat16, fp32 master weights; CUDA only)",
    "ours_fp16": "ours with precision='fp16' (matmuls in float16, dynamic loss scaling)",
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


def _training_model(spec: zoo.Spec, precision: str = "fp32"):
    """Our training model of ``spec`` (AdamW as :mod:`.model_runners`; LoRA: the adapters train)."""
    if spec.family != "llama":
        return training_model(spec, precision=precision)
    from onnx_training_ops.builder import AdamW, build_training_model

    path = lora.export(spec)
    return build_training_model(path, lora.loss(spec), AdamW(lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY),
                                labels="labels", trainable=lora.trainable(path), precision=precision)


class DeviceMemory:
    """The device-wide used memory of GPU 0 (MiB, NVML through ctypes: no package needed),
    sampled by a thread between :meth:`start` and :meth:`stop`; the peak comes back above the
    baseline read when the object is made (make it first thing in a fresh process).

    Process ids are not used: inside a container NVML reports the host's, so matching them to
    ``os.getpid()`` finds nothing. Device-wide memory counts the other processes on the GPU too:
    the baseline takes out what they held at the start."""

    def __init__(self, interval: float = 0.005) -> None:
        self.interval, self._peak, self._thread = interval, 0.0, None
        self._stop = threading.Event()
        self._used = self._nvml() or self._smi
        self.baseline = self._used() if self._used is not None else None

    @staticmethod
    def _nvml():
        import ctypes

        try:
            lib = ctypes.CDLL("libnvidia-ml.so.1")
        except OSError:
            return None

        class Memory(ctypes.Structure):
            _fields_ = [("total", ctypes.c_ulonglong), ("free", ctypes.c_ulonglong), ("used", ctypes.c_ulonglong)]

        handle = ctypes.c_void_p()
        if lib.nvmlInit_v2() != 0 or lib.nvmlDeviceGetHandleByIndex_v2(0, ctypes.byref(handle)) != 0:
            return None
        memory = Memory()

        def used() -> float | None:
            return memory.used / 2**20 if lib.nvmlDeviceGetMemoryInfo(handle, ctypes.byref(memory)) == 0 else None
        return used

    @staticmethod
    def _smi() -> float | None:
        try:
            out = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits", "-i", "0"],
                                 capture_output=True, text=True, timeout=30).stdout
            return float(out.split()[0])
        except (OSError, subprocess.SubprocessError, ValueError, IndexError):
            return None

    def _sample(self) -> None:
        used = self._used() if self._used is not None else None
        if used is not None:
            self._peak = max(self._peak, used)

    def start(self) -> None:
        if self.baseline is None or self._thread is not None:
            return

        def loop() -> None:
            while not self._stop.wait(self.interval):
                self._sample()
        self._thread = threading.Thread(target=loop, daemon=True)
        self._thread.start()

    def stop(self) -> float | None:
        """The peak used memory above the baseline (MiB), or None without NVML or nvidia-smi."""
        if self._thread is not None:
            self._stop.set()
            self._thread.join()
        self._sample()
        return None if self.baseline is None else max(self._peak - self.baseline, 0.0)


def _cuda_providers() -> list:
    """The CUDA EP as the bench runs it: TF32 off (fp32 parity with torch), the arena grown by
    what is asked (not by powers of two: comparable peaks)."""
    return [("CUDAExecutionProvider", {"use_tf32": "0", "arena_extend_strategy": "kSameAsRequested"}),
            "CPUExecutionProvider"]


def _ours(spec: zoo.Spec, device: str, flat: bool, precision: str = "fp32"):
    from onnx_training_ops.export import DeviceTrainer, export_step

    directory = tempfile.mkdtemp(prefix="bench_gpu_")
    export_step(_training_model(spec, precision), directory, flat_optimizer=flat)
    providers = _cuda_providers() if device == "cuda" else ["CPUExecutionProvider"]
    batches = _batches(spec)
    # static shapes: the step's shape arithmetic folded at load (no host round trip for it)
    trainer = DeviceTrainer(directory, providers, input_shapes={k: list(v.shape) for k, v in batches[0].items()})

    def step(i: int) -> float:
        return float(trainer.step(batches[i % BATCHES])["loss"])

    return step, lambda: None, dict


def _session(spec: zoo.Spec, device: str, cuda_graph: bool | None, precision: str = "fp32"):
    from onnx_training_ops.training.session.session import TrainingSession

    providers = _cuda_providers() if device == "cuda" else ["CPUExecutionProvider"]
    batches = _batches(spec)
    session = TrainingSession(_training_model(spec, precision), providers, device=device, cuda_graph=cuda_graph,
                              input_shapes={k: list(v.shape) for k, v in batches[0].items()})

    def step(i: int) -> float:
        return float(session.step(batches[i % BATCHES])["loss"])

    def facts() -> dict:  # whether the step replays a CUDA graph, and if not why
        programs = getattr(getattr(session, "_programs", None), "steps", None) or []
        program = getattr(programs[0], "program", None) if programs else None
        return {"cuda_graph": bool(getattr(session, "cuda_graph", False)),
                "not_captured": getattr(program, "not_fixed", None)}

    return step, lambda: None, facts


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

    def facts() -> dict:
        return {"torch_max_allocated_mb": torch.cuda.max_memory_allocated() / 2**20} if device == "cuda" else {}

    return step, sync, facts


def worker(contender: str, name: str, device: str, losses: int, timed: int, batch: int | None,
           seq: int | None, budget: float | None = None) -> dict:
    """One contender on one model, in this process: losses, step times, peak memory. ``budget``:
    seconds for the whole (steps stop early past it, at least two losses and one timed step
    kept, so a slow contender still reports)."""
    began = time.perf_counter()

    def over() -> bool:
        return budget is not None and time.perf_counter() - began > budget
    memory = DeviceMemory() if device == "cuda" else None  # the baseline, before anything touches the GPU
    if memory is not None:
        memory.start()
    spec = model_spec(name, batch, seq)
    started = time.perf_counter()
    if contender.startswith("session"):
        step, sync, facts = _session(spec, device, False if contender == "session_nograph" else None,
                                     "bf16" if contender == "session_bf16" else "fp32")
    elif contender.startswith("ours"):
        precision = contender.removeprefix("ours_") if contender in ("ours_bf16", "ours_fp16") else "fp32"
        step, sync, facts = _ours(spec, device, flat=contender != "ours_per_tensor", precision=precision)
    else:
        step, sync, facts = _torch(spec, device, contender == "torch_bf16")
    setup = time.perf_counter() - started
    seen: list[float] = []
    for i in range(losses):
        if len(seen) >= 2 and over():
            break
        seen.append(step(i))
    sync()
    times: list[float] = []
    for i in range(timed):
        if times and over():
            break
        start = time.perf_counter()
        step(len(seen) + i)
        sync()
        times.append(time.perf_counter() - start)
    return {"contender": contender, "model": spec.name, "device": device, "losses": seen,
            "ms_per_step": 1e3 * statistics.median(times) if times else None, "timed_steps": len(times),
            "setup_s": setup,
            "peak_device_mb": memory.stop() if memory is not None else None,
            "baseline_device_mb": memory.baseline if memory is not None else None,
            "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
            **facts()}


def _run_worker(contender: str, name: str, args: argparse.Namespace) -> dict:
    command = [sys.executable, "-m", "benchmarks.gpu", "--worker", contender, name,
               "--device", args.device, "--losses", str(args.losses), "--timed", str(args.timed)]
    if args.worker_timeout:  # the steps stop early, so that a slow contender reports before it is killed
        command += ["--budget", str(0.8 * args.worker_timeout)]
    if args.batch:
        command += ["--batch", str(args.batch)]
    if args.seq:
        command += ["--seq", str(args.seq)]
    model = model_spec(name, args.batch, args.seq).name
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=args.worker_timeout)
    except subprocess.TimeoutExpired:
        return {"contender": contender, "model": model, "error": f"timed out after {args.worker_timeout} s"}
    if run.returncode != 0:
        return {"contender": contender, "model": model, "error": (run.stderr.strip().splitlines() or ["?"])[-1]}
    return json.loads(run.stdout.strip().splitlines()[-1])


def _cell(value: float | None, width: int, digits: int) -> str:
    return f"{value:{width}.{digits}f}" if value is not None else f"{'-':>{width}}"


def format_table(results: list[dict], last: int | None = None) -> str:
    """Step times, ratios to torch fp32 / bf16 (``-``: that row not measured yet), peak device
    memory (MiB above the process's baseline; on the CPU the peak RSS), whether the step replays
    a CUDA graph (``graph``), the seconds to build and open it (``setup s``), and the losses.
    ``last``: only the last ``last`` rows, their ratios against every row so far."""
    lines = [f"{'model':<20} {'contender':<15} {'ms/step':>9} {'/fp32':>6} {'/bf16':>6} {'peak MB':>9} "
             f"{'graph':>5} {'setup s':>7}  losses"]
    by_model: dict[str, dict[str, dict]] = {}
    for r in results:
        by_model.setdefault(r["model"], {})[r["contender"]] = r
    shown = results[-last:] if last else results
    for r in shown:
        model, contender, rows = r["model"], r["contender"], by_model[r["model"]]
        if "error" in r:
            lines.append(f"{model:<20} {contender:<15} failed: {r['error'][:240]}")
            continue
        ratio = {k: (r["ms_per_step"] / rows[k]["ms_per_step"])
                 if r.get("ms_per_step") and rows.get(k, {}).get("ms_per_step") else None
                 for k in ("torch_fp32", "torch_bf16")}
        peak = r["peak_device_mb"] if r.get("peak_device_mb") is not None else r.get("peak_rss_mb")
        graph = {True: "yes", False: "no"}.get(r.get("cuda_graph"), "-")
        losses = " ".join(f"{x:.6f}" for x in r["losses"])
        lines.append(f"{model:<20} {contender:<15} {_cell(r.get('ms_per_step'), 9, 2)} "
                     f"{_cell(ratio['torch_fp32'], 6, 2)} {_cell(ratio['torch_bf16'], 6, 2)} "
                     f"{_cell(peak, 9, 0)} {graph:>5} {_cell(r.get('setup_s'), 7, 1)}  {losses}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m benchmarks gpu", description=__doc__.split("\n\n")[0])
    ap.add_argument("--models", default=",".join(DEFAULT_MODELS))
    ap.add_argument("--contenders", default=",".join(c for c in CONTENDERS if c != "ours_fp16"))
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--losses", type=int, default=10, help="steps whose losses are compared")
    ap.add_argument("--timed", type=int, default=20, help="steps timed after them (median)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--json", default=None, help="write the results here (after each contender)")
    ap.add_argument("--worker-timeout", type=float, default=None, help="seconds one contender may take")
    ap.add_argument("--append", action="store_true", help="start from the results already in --json (a run in "
                    "parts: the ratios and the table take them all)")
    ap.add_argument("--prepare", action="store_true", help="only export the models into the cache (what every "
                    "contender then reuses) and exit")
    ap.add_argument("--worker", nargs=2, metavar=("CONTENDER", "MODEL"), help=argparse.SUPPRESS)
    ap.add_argument("--budget", type=float, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(*args.worker, args.device, args.losses, args.timed, args.batch, args.seq,
                                args.budget)))
        return 0
    contenders = [c for c in args.contenders.split(",") if c]
    unknown = [c for c in contenders if c not in CONTENDERS]
    models = [m for m in args.models.split(",") if m]
    unknown += [m for m in models if m not in zoo.SPECS and m != lora.SPEC.name]
    if unknown:
        print(f"bench gpu: unknown contender or model {', '.join(unknown)}; contenders: {', '.join(CONTENDERS)}; "
              f"models: {', '.join(zoo.SPECS)}", file=sys.stderr)
        return 2
    if args.prepare:
        for name in models:
            spec = model_spec(name, args.batch, args.seq)
            started = time.perf_counter()
            path = lora.export(spec) if spec.family == "llama" else zoo.export(spec)
            print(f"{spec.name}: {path} ({time.perf_counter() - started:.1f} s)", flush=True)
        return 0
    print(f"device {args.device}; load average {os.getloadavg()[0]:.2f}", flush=True)
    results: list[dict] = []
    if args.append and args.json and os.path.exists(args.json):
        with open(args.json) as f:
            results = json.load(f)
    print(format_table([]), flush=True)
    for name in models:
        for contender in contenders:
            results.append(_run_worker(contender, name, args))
            print(format_table(results, last=1).splitlines()[-1], flush=True)
            if args.json:  # as it goes: a run cut short keeps what it measured
                _write_json(args.json, results)
    print(format_table(results))
    print(f"load average {os.getloadavg()[0]:.2f}")
    return 0


def _write_json(path: str, results: list[dict]) -> None:
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        json.dump(results, f, indent=1)
    os.replace(tmp, path)


if __name__ == "__main__":
    raise SystemExit(main())
