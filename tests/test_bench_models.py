"""The real-model benchmark (``bench models``): zoo exports and batches, the profile summary,
and a smoke run on the MLP. Timings are never asserted."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import onnx
import pytest

from benchmarks import ort_profile, zoo

pytest.importorskip("torch")


def test_zoo_batches_are_distinct_and_the_same_for_every_caller():
    spec = zoo.spec("gpt2", layers=1, hidden=8, heads=2, vocab=50, batch=2, seq=6)
    a, b = zoo.batches(spec, 4), zoo.batches(spec, 4)
    assert all(np.array_equal(x["input_ids"], y["input_ids"]) for x, y in zip(a, b))
    assert len({x["input_ids"].tobytes() for x in a}) == 4
    assert np.array_equal(a[0]["labels"], a[0]["input_ids"]), "causal LM: labels are the ids"
    assert spec.name == "gpt2[batch=2,heads=2,hidden=8,layers=1,seq=6,vocab=50]"


def test_zoo_export_is_cached_with_no_equal_initializers_and_trains_like_torch(tmp_path):
    import torch

    import onnx_training_ops as ot

    spec = zoo.spec("bert", layers=1, hidden=16, heads=2, vocab=40, batch=2, seq=5)
    path = zoo.export(spec, str(tmp_path))
    assert zoo.export(spec, str(tmp_path)) == path and os.path.getsize(path) > 0
    model = onnx.load(path)
    values = [onnx.numpy_helper.to_array(t) for t in model.graph.initializer if t.data_type == 1]
    assert len({v.tobytes() for v in values}) == len(values), "perturbed: nothing merged"
    feed = zoo.batches(spec, 1)[0]
    module = zoo.torch_model(spec)
    want = zoo.torch_loss(spec, module(*[torch.from_numpy(feed[n]) for n in spec.input_names]),
                          torch.from_numpy(feed["labels"]))
    session = ot.TrainingSession(ot.build_training_model(model, zoo.loss(spec), ot.AdamW(), mode=spec.mode))
    np.testing.assert_allclose(session.step(feed)["loss"], float(want.detach()), rtol=1e-5)


def test_profile_summary_reads_traces_written_into_one_file(tmp_path):
    def trace(op, runs):
        events = []
        for r in range(runs):
            events.append({"cat": "Session", "name": "model_run", "ts": 100 * r, "dur": 50})
            events.append({"cat": "Node", "name": f"n{r}_kernel_time", "ts": 100 * r + 1, "dur": 1000,
                           "args": {"op_name": op}})
        return events
    path = tmp_path / "p.json"
    path.write_text(json.dumps(trace("Gemm", 3)) + "\n" + json.dumps(trace("Adam", 2)))
    out = ort_profile.summarize([str(path)], skip_runs=1)
    assert out["sessions"] == 2 and out["nodes_per_step"] == 2.0
    assert out["by_op"] == [["Gemm", 1.0, 1.0], ["Adam", 1.0, 1.0]]


def test_bench_models_smoke_run_writes_its_report(tmp_path):
    out = tmp_path / "models.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "models", "--models", "mlp",
         "--contenders", "ours_fast,torch_eager", "--rounds", "1", "--round-seconds", "0.05", "--warmup-seconds", "0",
         "--profile-steps", "3", "--cache", str(tmp_path / "zoo"), "--json", str(out)],
        capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout + result.stderr
    report = json.loads(out.read_text())
    cells = report["models"]["mlp"]["contenders"]
    assert set(cells) == {"ours_fast", "torch_eager"}
    assert cells["ours_fast"]["median_s"] > 0 and cells["ours_fast"]["peak_rss_mb"] > 0
    assert cells["torch_eager"]["ours_fast_over_this"] > 0
    assert report["models"]["mlp"]["profiles"]["ours_fast"]["nodes_per_step"] > 0
    assert "MLP 64-128-10" in result.stdout


def test_an_unusable_ortt_python_is_an_na_cell_with_its_reason(tmp_path):
    """--ortt-python names a Python with onnxruntime-training; this one lacks it."""
    from benchmarks.models import ORTT, measure_model

    result = measure_model(zoo.SPECS["mlp"], ["ours_fast"], ortt_python=sys.executable, rounds=1,
                           round_seconds=0.05, profile_steps=0, cache=str(tmp_path), warmup_seconds=0,
                           log=lambda m: None)
    assert "onnxruntime" in result["contenders"][ORTT]["n/a"]
    assert result["contenders"]["ours_fast"]["median_s"] > 0


def test_bench_models_rejects_an_unknown_model():
    result = subprocess.run([sys.executable, "-m", "benchmarks", "models", "--models", "vgg"],
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 2 and "unknown model 'vgg'" in result.stderr
