"""What training through a deployed int4 LLM layer costs: one Llama-2-7B-shaped decoder layer
(hidden 4096, MLP 11008, 32 heads) built by onnxruntime-genai's builder (``-p int4 -e cpu``, and
``-p fp32``), batch 1 x 256 tokens, the input gradient taken through every MatMulNBits,
GroupQueryAttention and norm (the norm weights train: the LoRA case's backward without the
adapters' own cost).

Contenders, each in its own process (peak RSS from ``getrusage``), run twice in turn (median step),
on the large-model path a 7B model takes (the weights memory-mapped from the file, whatever
this layer's size):

* ``inference``       the int4 layer's forward alone (onnxruntime InferenceSession);
* ``int4``            training, MatMulNBits' dA = dY · dequant(B) with B dequantized by
                      GatherBlockQuantized just in time, per step (the rule as shipped);
* ``int4-std-ops``    the same with the dequantization in standard ops (Cast/Div/Floor/Mod/Sub/Mul);
* ``int4-ungated``    the same dequantization not tied to dY (its index a constant): nothing then
                      keeps onnxruntime from running it early, or from folding it into float
                      initializers (onnxruntime >= 1.2x folds nodes of up to 1 GB of output);
* ``fp32``            the fp32 build trained the same way: float weights all the time, what
                      dequantizing once per model open would hold.

Usage: ``python benchmarks/contrib_backward.py [--root DIR] [--steps N]`` (builds the models on
first use: about 1 GB of disk, a few minutes).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SHAPE = dict(hidden_size=4096, intermediate_size=11008, num_hidden_layers=1, num_attention_heads=32,
             num_key_value_heads=32, max_position_embeddings=4096)
TOKENS = 256


def build(root: Path) -> dict[str, Path]:
    """The two builds (in this process: run it apart from the measured ones, whose peak RSS
    would start at this process's after torch's import)."""
    sys.path.insert(0, str(ROOT / "tests"))
    import genai_models
    return {"int4": genai_models.genai_model("llama", "int4", root, config=SHAPE),
            "fp32": genai_models.genai_model("llama", "fp32", root, config=SHAPE)}


def _rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def run(contender: str, folder: Path, steps: int) -> dict:
    """One contender in this process: peak RSS (MB) after the imports, after opening, after the
    steps; seconds to open and per step."""
    import numpy as np
    import onnx

    import onnx_training_ops as ot
    from onnx_training_ops.autodiff import rules_quantized

    if contender == "int4-std-ops":
        rules_quantized.QuantizedWeight._gather_block_quantized = rules_quantized.QuantizedWeight._standard_ops
    if contender == "int4-ungated":
        rules_quantized._runtime_zero = lambda em, like: em.ints([0])
    config = json.loads((folder / "genai_config.json").read_text())["model"]["decoder"]
    rng = np.random.default_rng(0)
    ids = rng.integers(3, 256, (1, TOKENS)).astype(np.int64)
    feeds = {"input_ids": ids, "attention_mask": np.ones_like(ids)}
    for i in range(config["num_hidden_layers"]):
        for kind in ("key", "value"):
            feeds[f"past_key_values.{i}.{kind}"] = np.zeros(
                (1, config["num_key_value_heads"], 0, config["head_size"]), np.float32)
    base = _rss_mb()
    start = time.perf_counter()
    if contender == "inference":
        import onnxruntime as ort
        session = ort.InferenceSession(str(folder / "model.onnx"), providers=["CPUExecutionProvider"])
        step = lambda: session.run(["logits"], feeds)  # noqa: E731
    else:
        graph = onnx.load(folder / "model.onnx", load_external_data=False).graph
        norms = [t.name for t in graph.initializer if "layernorm" in t.name]
        training = ot.build_training_model(str(folder / "model.onnx"), ot.CrossEntropyLoss(shift_labels=True),
                                           ot.AdamW(lr=1e-4), trainable=norms, output="logits")
        session = ot.TrainingSession(training)
        feeds["labels"] = ids
        step = lambda: session.step(feeds)  # noqa: E731
    opened = time.perf_counter() - start
    open_mb = _rss_mb()
    step()  # first run: allocations
    times = []
    for _ in range(steps):
        t = time.perf_counter()
        step()
        times.append(time.perf_counter() - t)
    return {"rss_mb": _rss_mb(), "base_mb": base, "open_mb": open_mb, "open_s": opened, "step_s": times}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--root", type=Path, default=Path("/tmp/contrib_backward"))
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--contenders", default="inference,int4,int4-std-ops,int4-ungated,fp32")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--child", nargs=2, metavar=("CONTENDER", "FOLDER"))
    args = parser.parse_args()
    if args.child:
        print(json.dumps(run(args.child[0], Path(args.child[1]), args.steps)))
        return
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    builder = (f"import sys; sys.path.insert(0, {str(ROOT / 'benchmarks')!r}); import contrib_backward as b; "
               f"from pathlib import Path; b.build(Path({str(args.root)!r}))")
    subprocess.run([sys.executable, "-c", builder], env=env, check=True, capture_output=True)
    folders = {"int4": args.root / "llama" / "int4", "fp32": args.root / "llama" / "fp32"}
    env["ONNX_TRAINING_OPS_LARGE_MODEL_BYTES"] = "1"  # a 7B model's path: weights memory-mapped from the file
    results: dict[str, list] = {}
    for _ in range(args.rounds):  # interleaved: one of each, then again
        for contender in args.contenders.split(","):
            folder = folders["fp32" if contender == "fp32" else "int4"]
            out = subprocess.run([sys.executable, __file__, "--steps", str(args.steps), "--child", contender,
                                  str(folder)], capture_output=True, text=True, env=env, check=True)
            results.setdefault(contender, []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    import statistics
    print(f"load average {os.getloadavg()[0]:.1f}; one Llama-2-7B-shaped layer, batch 1 x {TOKENS} tokens")
    print(f"{'contender':15} {'peak RSS MB':>12} {'opened MB':>10} {'imports MB':>11} {'open s':>7} "
          f"{'step s (median)':>16}")
    for contender, runs in results.items():
        steps = [t for r in runs for t in r["step_s"]]
        print(f"{contender:15} {max(r['rss_mb'] for r in runs):12.0f} {max(r['open_mb'] for r in runs):10.0f} "
              f"{min(r['base_mb'] for r in runs):11.0f} {statistics.median(r['open_s'] for r in runs):7.1f} "
              f"{statistics.median(steps):16.2f}")


if __name__ == "__main__":
    main()
