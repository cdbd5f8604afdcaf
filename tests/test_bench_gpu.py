"""`bench gpu` runs its contenders on the CPU too (CI has no GPU): each in its own process,
ours (TrainingSession(device=...), and the exported step, with the state on the device) giving
torch's losses."""

from __future__ import annotations

import json

from onnx_training_ops.bench import gpu


def test_bench_gpu_on_the_cpu_compares_ours_with_torch(tmp_path, capsys):
    out = tmp_path / "gpu.json"
    assert gpu.main(["--device", "cpu", "--models", "mlp", "--contenders", "session,ours,torch_fp32",
                     "--losses", "4", "--timed", "2", "--json", str(out)]) == 0
    results = {r["contender"]: r for r in json.loads(out.read_text())}
    assert set(results) == {"session", "ours", "torch_fp32"}, results
    for ours in ("session", "ours"):
        for a, b in zip(results[ours]["losses"], results["torch_fp32"]["losses"]):
            assert abs(a - b) <= 1e-5 * abs(b)
    assert all(r["ms_per_step"] > 0 for r in results.values())
    assert "load average" in capsys.readouterr().out


def test_bench_gpu_rejects_unknown_names_in_one_line(capsys):
    assert gpu.main(["--models", "nope"]) == 2
    assert "unknown contender or model nope" in capsys.readouterr().err


def test_the_command_line_reaches_bench_gpu(capsys):
    """``python -m onnx_training_ops bench gpu`` (what benchmarks/gpu_check.sh runs): it once
    failed to import its module, which only a GPU session would have found."""
    from onnx_training_ops.cli import main

    assert main(["bench", "gpu", "--models", "nope"]) == 2
    assert "unknown contender or model nope" in capsys.readouterr().err
