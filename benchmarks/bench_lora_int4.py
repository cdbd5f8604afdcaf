"""LoRA on the deployed int4 model vs torch + peft on float32: memory and step time (issue 38).

A TinyLlama-shaped model (1.1 B parameters: 22 layers, hidden 2048, MLP 5632, 32 heads with 4
key/value heads, vocabulary 32000; random init) built by onnxruntime-genai's model builder at
int4 (``-p int4 -e cpu``: ``MatMulNBits``, block 32, the builder's default ``accuracy_level``),
LoRA rank 16 (alpha 32) on every projection (q, k, v, o, gate, up, down), AdamW, one batch of
1 x 256 tokens, causal-LM loss. Contenders, each in its own process, timed in interleaved
rounds (:mod:`benchmarks.rounds`):

* ``ours``: :func:`onnx_training_ops.add_lora` on the builder's folder, ``build_training_model``,
  ``TrainingSession`` (the 4-bit weights stay 4-bit, bound as inputs; each layer dequantized by
  row ranges in the forward and for the input gradient, the forward's input rounded to int8 as
  the deployed kernel rounds it: ``passes/dequantize_matmul_nbits.py``);
* ``torch``: ``transformers.LlamaForCausalLM`` in float32 with ``peft`` LoRA, the same
  settings, ``torch.optim.AdamW`` over the adapters.

Printed: median seconds per step, peak RSS (the whole process: model, activations, runtime),
their ratios ours / torch, and the load average. ``--device cuda``: both on the GPU
(onnxruntime's CUDA EP with the state on the device: ``TrainingSession(device="cuda")``; torch
on cuda), with peak GPU memory from ``nvidia-smi``; ``--device cpu-engine`` runs that device
engine on the CPU (a dry run of the GPU variant).

The GPU machine need not have onnxruntime-genai: ``--write-skeleton DIR`` (here) writes the
builder's graph without its big tensors (their shapes and dtypes only; a few hundred KB), and
``--skeleton DIR`` (there) fills them with random values of the same kinds (random 4-bit codes
and scales, normal embeddings): the same graph, random-init weights, as the benchmark uses.

Run (under ``flock /tmp/heavy.lock`` on a shared machine; building the model once takes ~10 GB
of memory and a few minutes, cached under ``~/.cache/onnx_training_ops/zoo``):

    python benchmarks/bench_lora_int4.py [--rounds 3] [--steps 2] [--seq 256] [--layers 22]
    python benchmarks/bench_lora_int4.py --shape llama7b --layers 1 --contenders ours   # the 7B estimate
    python benchmarks/bench_lora_int4.py --write-skeleton out/lora-int4-skeleton
    python benchmarks/bench_lora_int4.py --device cuda --skeleton out/lora-int4-skeleton   # on the GPU
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import threading

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.join(ROOT, "tests"))  # genai_models: the builder's models, shared with the tests

import genai_models as genai  # noqa: E402

from benchmarks.measure import loadavg  # noqa: E402
from benchmarks.rounds import interleaved, median_ratio  # noqa: E402
from benchmarks.zoo import cache_dir  # noqa: E402

TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
SKELETON = "onnx_training_ops.skeleton"  # metadata: the stripped tensors and how to fill them
HF_CONFIG = "hf_config.json"


# ---------------------------------------------------------------- the model


SHAPES = {"tinyllama": genai.TINYLLAMA, "llama7b": genai.LLAMA7B}


def built_folder(layers: int, shape: str = "tinyllama") -> tuple[str, dict]:
    """The cached builder folder of ``shape`` (TinyLlama's or Llama-2-7B's configuration) with
    ``layers`` layers, and its HF config."""
    config = {**SHAPES[shape], "num_hidden_layers": layers}
    root = os.path.join(cache_dir(), f"{shape}-int4-{layers}l")
    onnx_dir = os.path.join(root, "onnx")
    if not os.path.isfile(os.path.join(onnx_dir, "genai_config.json")):
        hf = os.path.join(root, "hf")
        if not os.path.isfile(os.path.join(hf, "config.json")):
            genai.hf_folder(hf, "llama", config, seed=0, perturb=False)
        genai.build(hf, onnx_dir, accuracy_level=None)  # the builder's CPU default: accuracy_level 4
        shutil.rmtree(hf)  # 4.4 GB of float32 weights: torch makes its own random init
        with open(os.path.join(onnx_dir, HF_CONFIG), "w") as f:
            json.dump(config, f)
    with open(os.path.join(onnx_dir, HF_CONFIG)) as f:
        return onnx_dir, json.load(f)


def write_skeleton(folder: str, out: str, min_bytes: int = 1 << 16) -> None:
    """``folder``'s model with every tensor of ``min_bytes`` or more replaced by its shape and
    dtype (recorded in the metadata), plus its genai_config.json and HF config. The rotary
    tables (read by the attention nodes) keep their values."""
    import onnx
    from onnx import numpy_helper

    model = onnx.load(os.path.join(folder, "model.onnx"))
    exact = {name for node in model.graph.node if node.op_type in ("GroupQueryAttention", "RotaryEmbedding")
             for name in node.input}
    kinds = {}
    for tensor in model.graph.initializer:
        if tensor.name not in exact and numpy_helper.to_array(tensor).nbytes >= min_bytes:
            name = tensor.name
            kinds[name] = ("codes" if tensor.data_type == onnx.TensorProto.UINT8 else
                           "scales" if name.endswith("_scales") else "normal")
            stripped = onnx.TensorProto(name=name, data_type=tensor.data_type, dims=tensor.dims)
            tensor.CopyFrom(stripped)
    model.metadata_props.add(key=SKELETON, value=json.dumps(kinds))
    os.makedirs(out, exist_ok=True)
    onnx.save(model, os.path.join(out, "model.onnx"))
    for name in ("genai_config.json", HF_CONFIG):
        shutil.copy(os.path.join(folder, name), os.path.join(out, name))
    size = sum(os.path.getsize(os.path.join(out, n)) for n in os.listdir(out))
    print(f"skeleton of {folder}: {len(kinds)} tensors stripped, {size / 1e6:.2f} MB in {out}")


def materialize(skeleton: str, out: str, seed: int = 0) -> str:
    """A builder folder from a skeleton: random 4-bit codes, scales that make weights of std
    ~0.02 (a Llama's init), normal(0, 0.02) float tensors; written with external data."""
    import onnx
    from onnx import helper, numpy_helper

    if os.path.isfile(os.path.join(out, "model.onnx")):
        return out
    model = onnx.load(os.path.join(skeleton, "model.onnx"))
    kinds = json.loads(next(p.value for p in model.metadata_props if p.key == SKELETON))
    rng = np.random.default_rng(seed)
    for tensor in model.graph.initializer:
        kind = kinds.get(tensor.name)
        if kind is None:
            continue
        shape = tuple(tensor.dims)
        if kind == "codes":
            value = rng.integers(0, 256, shape, dtype=np.uint8)
        elif kind == "scales":  # codes 0..15 around the zero point 8: std ~4.6; 4.6 * 0.0043 ~ 0.02
            value = rng.uniform(0.003, 0.0056, shape).astype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        else:
            value = (0.02 * rng.standard_normal(shape)).astype(helper.tensor_dtype_to_np_dtype(tensor.data_type))
        tensor.CopyFrom(numpy_helper.from_array(value, tensor.name))
    del model.metadata_props[:]
    os.makedirs(out, exist_ok=True)
    onnx.save(model, os.path.join(out, "model.onnx"), save_as_external_data=True, location="model.onnx.data",
              size_threshold=1024)
    for name in ("genai_config.json", HF_CONFIG):
        shutil.copy(os.path.join(skeleton, name), os.path.join(out, name))
    return out


# ---------------------------------------------------------------- the workers


def _batches(vocab: int, seq: int, count: int = 4) -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.integers(3, vocab, (1, seq), dtype=np.int64) for _ in range(count)]


class _GpuPeak:
    """The largest memory nvidia-smi reports for this process, sampled every 50 ms."""

    def __init__(self) -> None:
        self.peak_mb, self._stop = 0.0, threading.Event()
        threading.Thread(target=self._poll, daemon=True).start()

    def _poll(self) -> None:
        pid = str(os.getpid())
        while not self._stop.wait(0.05):
            try:
                out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,used_memory", "--format=csv,noheader,"
                                      "nounits"], capture_output=True, text=True, timeout=5).stdout
            except (OSError, subprocess.TimeoutExpired):
                return
            for line in out.splitlines():
                p, _, mb = line.partition(",")
                if p.strip() == pid:
                    self.peak_mb = max(self.peak_mb, float(mb))


def worker_ours(args, folder: str, config: dict) -> None:
    from benchmarks.timing import serve
    from onnx_training_ops import AdamW, CrossEntropyLoss, TrainingSession, add_lora, build_training_model

    model = add_lora(folder, rank=args.rank, alpha=2 * args.rank, targets=TARGETS)
    training = build_training_model(model, CrossEntropyLoss(shift_labels=True), AdamW(lr=1e-4))
    del model
    device = {"cpu": None, "cuda": "cuda", "cpu-engine": "cpu"}[args.device]
    session = TrainingSession(training, device=device)
    del training
    gpu = _GpuPeak() if args.device == "cuda" else None
    batches = _batches(config["vocab_size"], args.seq)
    losses, i = [], [0]

    def run(n: int) -> None:
        for _ in range(n):
            ids = batches[i[0] % len(batches)]
            i[0] += 1
            losses.append(float(session.step({"input_ids": ids, "attention_mask": np.ones_like(ids), "labels": ids})
                                ["loss"]))

    first = _timed(run)
    ready = {"first_step_s": first, "trainable": session.summary().trainable_count, "first_loss": losses[0]}
    _serve_with_gpu(serve, run, ready, gpu, args)


def worker_torch(args, config: dict) -> None:
    import peft
    import torch
    import transformers

    from benchmarks.timing import serve

    device = "cuda" if args.device == "cuda" else "cpu"
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.LlamaForCausalLM(transformers.LlamaConfig(tie_word_embeddings=False, use_cache=False,
                                                                       **config))
    lora = peft.LoraConfig(r=args.rank, lora_alpha=2 * args.rank, lora_dropout=0.0, target_modules=TARGETS)
    model = peft.get_peft_model(model, lora).train()
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    batches = [torch.from_numpy(b).to(device) for b in _batches(config["vocab_size"], args.seq)]
    losses, i = [], [0]

    def run(n: int) -> None:
        for _ in range(n):
            ids = batches[i[0] % len(batches)]
            i[0] += 1
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(float(loss))
        if device == "cuda":
            torch.cuda.synchronize()

    first = _timed(run)
    ready = {"first_step_s": first, "trainable": sum(p.numel() for p in params), "first_loss": losses[0]}
    if device == "cuda":
        ready["torch_max_allocated_mb"] = torch.cuda.max_memory_allocated() / 2**20
    _serve_with_gpu(serve, run, ready, _GpuPeak() if device == "cuda" else None, args)


def _timed(run) -> float:
    """Seconds of one step (the first: the runtime's set-up and allocations included)."""
    import time

    start = time.perf_counter()
    run(1)
    return time.perf_counter() - start


def _serve_with_gpu(serve, run, ready: dict, gpu, args) -> None:
    def timed(n: int) -> None:
        run(n)
        if gpu is not None and args.gpu_file:
            with open(args.gpu_file, "w") as f:
                json.dump({"peak_gpu_mb": gpu.peak_mb}, f)

    serve(timed, ready)


# ---------------------------------------------------------------- the table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", choices=("cpu", "cuda", "cpu-engine"), default="cpu")
    ap.add_argument("--shape", choices=sorted(SHAPES), default="tinyllama",
                    help="the model's configuration (llama7b: for the 7B estimate, with a few --layers)")
    ap.add_argument("--layers", type=int, help="default: the shape's (22 for tinyllama, 32 for llama7b)")
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=2, help="steps per contender per round")
    ap.add_argument("--contenders", default="ours,torch")
    ap.add_argument("--folder", help="a genai builder folder to use (default: build TinyLlama's shape, cached)")
    ap.add_argument("--skeleton", help="a skeleton folder (--write-skeleton) to fill with random weights and use")
    ap.add_argument("--write-skeleton", metavar="DIR", help="write the model's skeleton into DIR and stop")
    ap.add_argument("--json", help="also write the results as JSON")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--gpu-file", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)

    if args.skeleton:
        folder = materialize(args.skeleton, os.path.join(cache_dir(), "lora-int4-from-skeleton",
                                                         os.path.basename(os.path.abspath(args.skeleton))))
    elif args.folder:
        folder = args.folder
    else:
        folder, _ = built_folder(args.layers or SHAPES[args.shape]["num_hidden_layers"], args.shape)
    with open(os.path.join(folder, HF_CONFIG)) as f:
        config = json.load(f)
    if args.write_skeleton:
        write_skeleton(folder, args.write_skeleton)
        return 0
    if args.worker == "ours":
        worker_ours(args, folder, config)
        return 0
    if args.worker == "torch":
        worker_torch(args, config)
        return 0

    before = loadavg()
    names = args.contenders.split(",")
    gpu_files = {n: os.path.join(folder, f".gpu-{n}-{os.getpid()}.json") for n in names}
    commands = {n: [sys.executable, os.path.abspath(__file__), "--worker", n, "--folder", folder, "--device",
                    args.device, "--seq", str(args.seq), "--rank", str(args.rank), "--gpu-file", gpu_files[n]]
                for n in names}
    print(f"model: {folder} ({config['num_hidden_layers']} layers, hidden {config['hidden_size']}), LoRA rank "
          f"{args.rank} on {', '.join(TARGETS)}, batch 1 x {args.seq}, device {args.device}; load average {before}",
          flush=True)
    out = interleaved(commands, args.steps, args.rounds, settle=1.0, log=lambda m: print(m, flush=True))
    after = loadavg()
    rows = {}
    for n in names:
        o = out[n]
        row = o.as_dict()
        if os.path.exists(gpu_files[n]):
            with open(gpu_files[n]) as f:
                row.update(json.load(f))
            os.remove(gpu_files[n])
        rows[n] = row
    print(f"\n| contender | median s/step | peak RSS GB |{' peak GPU GB |' if args.device == 'cuda' else ''} "
          "trainable | first loss |")
    print("|---|---|---|" + ("---|" if args.device == "cuda" else "") + "---|---|")
    for n, row in rows.items():
        if "n/a" in row:
            print(f"| {n} | n/a: {row['n/a']} |")
            continue
        gpu = f" {row.get('peak_gpu_mb', 0) / 1024:.2f} |" if args.device == "cuda" else ""
        print(f"| {n} | {row['median_s']:.2f} | {row['peak_rss_mb'] / 1024:.2f} |{gpu} {row['trainable']:,} | "
              f"{row['first_loss']:.4f} |")
    if "ours" in rows and "torch" in rows and "n/a" not in rows["ours"] and "n/a" not in rows["torch"]:
        time_ratio = median_ratio(out["ours"], out["torch"])
        rss_ratio = rows["ours"]["peak_rss_mb"] / rows["torch"]["peak_rss_mb"]
        print(f"\nours / torch: step time {time_ratio:.2f}x (median of per-round ratios), peak RSS {rss_ratio:.2f}x"
              + (f", peak GPU memory {rows['ours']['peak_gpu_mb'] / rows['torch']['peak_gpu_mb']:.2f}x"
                 if args.device == "cuda" and rows["torch"].get("peak_gpu_mb") else ""))
        rows["ratios"] = {"step_time": time_ratio, "peak_rss": rss_ratio}
    print(f"load average before {before}, after {after}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"rows": rows, "load_before": before, "load_after": after, "args": vars(args)}, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
