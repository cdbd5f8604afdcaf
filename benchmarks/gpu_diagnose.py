"""Where a device step's time goes: the nodes onnxruntime placed on the CPU, the Memcpy nodes it
inserted, and the nodes that take the most host time, for one model's static step.

    python benchmarks/gpu_diagnose.py [--model gpt2-124m] [--device cuda] [--steps 5] [--out DIR]

Opens ``TrainingSession(model, device=..., input_shapes=...)`` (the ``session`` contender of
``bench gpu``, AdamW, the zoo's model at the GPU sizes) once, eager (``cuda_graph=False``) with
onnxruntime's log at INFO and its profiler on, runs a few steps and prints:

* the log's Memcpy lines (onnxruntime inserts a Memcpy node around each node it places on the
  CPU; any of them also makes it refuse CUDA graphs);
* the nodes by execution provider, from the profile (the CPU-placed ones named);
* the eager ms per step (profiler on: a little slower than without);
* the top nodes and op types by host time per step. With the CUDA EP the profiler times the
  launch of a kernel, not its run on the GPU: a big number is work on the host (a CPU node, a
  copy, a table filled per run), which is what makes a step slow for no GPU reason.

Whether the step replays a CUDA graph is the ``graph`` column of ``bench gpu``'s ``session`` row.
``--device cpu`` runs the same on the CPU (a dry run; every node is the CPU EP's there).
Writes ``diagnose.txt`` (and the raw log and profile) under ``--out``.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import gc
import glob
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout: `benchmarks`


@contextlib.contextmanager
def _stderr_to(path: str):
    """onnxruntime's log (C++, written to fd 2) into ``path`` while inside."""
    sys.stderr.flush()
    saved = os.dup(2)
    with open(path, "ab") as f:
        os.dup2(f.fileno(), 2)
    try:
        yield
    finally:
        sys.stderr.flush()
        os.dup2(saved, 2)
        os.close(saved)


def _profile_nodes(path: str) -> tuple[dict[str, str], collections.Counter, dict[str, str], collections.Counter, int]:
    """From onnxruntime's profile, the warm-up run left out: node -> provider, node -> host µs
    per run, node -> op type, GPU kernel -> µs per run (only where the build records GPU
    kernels: CUPTI), and the runs counted."""
    with open(path) as f:
        events = json.load(f)
    runs = sorted(e["ts"] for e in events if e.get("cat") == "Session" and e.get("name") == "model_run")
    after = runs[1] if len(runs) > 1 else 0
    count = max(len(runs) - 1, 1)
    provider, micros, ops, kernels = {}, collections.Counter(), {}, collections.Counter()
    for e in events:
        if e.get("ts", 0) < after:
            continue
        if e.get("cat") == "Kernel":
            kernels[e.get("name", "?")[:80]] += float(e.get("dur", 0)) / count
        if e.get("cat") != "Node" or not e.get("name", "").endswith("_kernel_time"):
            continue
        name = e["name"][: -len("_kernel_time")]
        args = e.get("args", {})
        provider[name] = args.get("provider", "?")
        ops[name] = args.get("op_name", "?")
        micros[name] += float(e.get("dur", 0)) / count
    return provider, micros, ops, kernels, count


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="gpt2-124m")
    ap.add_argument("--device", default="cuda", choices=("cuda", "cpu"))
    ap.add_argument("--steps", type=int, default=5, help="profiled steps (after one warm-up step)")
    ap.add_argument("--batch", type=int, default=None)
    ap.add_argument("--seq", type=int, default=None)
    ap.add_argument("--out", default="out/gpu")
    args = ap.parse_args(argv)

    import onnxruntime as ort

    from benchmarks.gpu import _batches, _cuda_providers, _training_model, model_spec
    from onnx_training_ops.training.session.session import TrainingSession

    os.makedirs(args.out, exist_ok=True)
    report_path = os.path.join(args.out, "diagnose.txt")
    lines: list[str] = []

    def say(text: str = "") -> None:
        print(text, flush=True)
        lines.append(text)
        with open(report_path, "w") as f:  # as it goes: a run cut short keeps what it found
            f.write("\n".join(lines) + "\n")

    spec = model_spec(args.model, args.batch, args.seq)
    say(f"diagnose {spec.name} on {args.device}: onnxruntime {ort.__version__}, {ort.get_available_providers()}")
    started = time.perf_counter()
    training = _training_model(spec)
    built = time.perf_counter() - started
    batches = _batches(spec)
    profile_dir = tempfile.mkdtemp(prefix="diagnose_")  # the raw log and profile: big; kept beside --out if small
    log_path = os.path.join(profile_dir, "ort.log")
    options = ort.SessionOptions()
    options.log_severity_level = 1  # INFO: "Add MemcpyFromHost after ..." per inserted copy
    options.enable_profiling = True
    options.profile_file_prefix = os.path.join(profile_dir, "step")
    providers = _cuda_providers() if args.device == "cuda" else ["CPUExecutionProvider"]
    started = time.perf_counter()
    with _stderr_to(log_path):
        session = TrainingSession(training, providers, device=args.device, cuda_graph=False, sess_options=options,
                                  input_shapes={k: list(v.shape) for k, v in batches[0].items()})
        opened = time.perf_counter() - started
        session.step(batches[0])  # warm-up (allocations)
        times = []
        for i in range(args.steps):
            start = time.perf_counter()
            session.step(batches[(i + 1) % len(batches)])
            times.append(time.perf_counter() - start)
        del session
        gc.collect()  # onnxruntime writes each session's profile as the session goes
    say(f"setup: build {built:.1f} s, open {opened:.1f} s; eager step (profiler on): "
        f"{1e3 * statistics.median(times):.1f} ms median of {args.steps}")

    with open(log_path, errors="replace") as f:
        memcpy = [line.rstrip() for line in f if "Memcpy" in line
                  and any(w in line for w in ("added", " after ", " before "))]
    say(f"Memcpy lines in onnxruntime's log: {len(memcpy)}")
    for line in memcpy[:20]:
        say(f"  {line[-220:]}")

    profiles = sorted(glob.glob(os.path.join(profile_dir, "step*.json")))  # one per program; the step's is the largest
    step_profile = max(profiles, key=os.path.getsize) if profiles else None
    if step_profile is None:
        say("no profile written")
        return 1
    provider, micros, ops, kernels, runs = _profile_nodes(step_profile)
    by_provider = collections.Counter(provider.values())
    say("nodes by provider: " + ", ".join(f"{p} {n}" for p, n in by_provider.most_common()))
    on_cpu = [n for n, p in provider.items() if p == "CPUExecutionProvider"]
    if args.device == "cuda":
        say(f"nodes on the CPU: {len(on_cpu)}")
        for name in on_cpu[:30]:
            say(f"  {ops[name]} {name!r}: {micros[name]:.0f} µs/step")
    say(f"host time in nodes: {sum(micros.values()) / 1e3:.1f} ms/step (mean of {runs} runs); top 10 nodes:")
    for name, us in micros.most_common(10):
        say(f"  {us / 1e3:8.2f} ms  {ops[name]:<18} {provider[name]:<24} {name}")
    by_op: collections.Counter = collections.Counter()
    for name, us in micros.items():
        by_op[ops[name]] += us
    say("top 10 op types: " + ", ".join(f"{op} {us / 1e3:.2f} ms" for op, us in by_op.most_common(10)))
    if kernels:
        say(f"GPU kernel time: {sum(kernels.values()) / 1e3:.1f} ms/step; top 10: "
            + ", ".join(f"{k} {us / 1e3:.2f} ms" for k, us in kernels.most_common(10)))
    for raw, name in ((step_profile, "diagnose_profile.json"), (log_path, "diagnose_ort.log")):
        if os.path.getsize(raw) < 12 * 2**20:  # what comes back from a device run: at most 16 MiB a file
            os.replace(raw, os.path.join(args.out, name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
