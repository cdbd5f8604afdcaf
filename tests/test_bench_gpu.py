"""`bench gpu` runs its contenders on the CPU too (CI has no GPU): each in its own process,
ours (TrainingSession(device=...), and the exported step, with the state on the device) giving
torch's losses."""

from __future__ import annotations

import json

from benchmarks import gpu


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
    out = capsys.readouterr().out
    assert "load average" in out
    assert "nan" not in out  # before: each row printed as it came had nan where torch's row was still to come


def test_device_memory_is_the_device_wide_peak_above_the_baseline(monkeypatch):
    """Every contender's memory the same way: NVML's device-wide used memory sampled while it
    runs, less what was used when its process started (container PIDs never match NVML's)."""
    readings = iter([1000.0, 1500.0, 4200.0, 3900.0] + [3000.0] * 1000)
    monkeypatch.setattr(gpu.DeviceMemory, "_nvml", staticmethod(lambda: lambda: next(readings)))
    memory = gpu.DeviceMemory(interval=0.001)
    assert memory.baseline == 1000.0
    memory._sample()
    memory._sample()
    memory._sample()
    assert memory.stop() == 3200.0
    monkeypatch.setattr(gpu.DeviceMemory, "_nvml", staticmethod(lambda: None))
    monkeypatch.setattr(gpu.DeviceMemory, "_smi", staticmethod(lambda: None))
    assert gpu.DeviceMemory().stop() is None  # no GPU: nothing claimed


def test_the_table_marks_what_is_not_measured_yet():
    rows = [{"contender": "session", "model": "m", "losses": [1.0], "ms_per_step": 10.0, "peak_device_mb": 900.0,
             "cuda_graph": True, "setup_s": 3.0}]
    line = gpu.format_table(rows, last=1).splitlines()[-1]
    assert line.split()[2:8] == ["10.00", "-", "-", "900", "yes", "3.0"], line
    rows.append({"contender": "torch_fp32", "model": "m", "losses": [1.0], "ms_per_step": 5.0, "peak_device_mb": 800.0})
    assert gpu.format_table(rows).splitlines()[1].split()[3] == "2.00"


def test_bench_gpu_rejects_unknown_names_in_one_line(capsys):
    assert gpu.main(["--models", "nope"]) == 2
    assert "unknown contender or model nope" in capsys.readouterr().err


def test_the_command_line_reaches_bench_gpu(capsys):
    """``python -m benchmarks gpu`` (what benchmarks/gpu_check.sh runs): it once
    failed to import its module, which only a GPU session would have found."""
    from benchmarks.__main__ import main

    assert main(["gpu", "--models", "nope"]) == 2
    assert "unknown contender or model nope" in capsys.readouterr().err


def test_a_contender_past_its_budget_still_reports():
    """A slow contender (the GPU run's first session took 6 s a step) stops its steps when its
    time is up, keeping two losses and one timed step, rather than being killed with nothing."""
    result = gpu.worker("session", "mlp", "cpu", losses=5, timed=5, batch=None, seq=None, budget=0.0)
    assert len(result["losses"]) == 2 and result["timed_steps"] == 1 and result["ms_per_step"] > 0


def test_a_run_in_parts_appends_to_one_table(tmp_path, capsys):
    """gpu_check.sh runs the contenders in two parts (the diagnostic between them): the second
    part starts from the first part's JSON, so its table and ratios cover both."""
    out = tmp_path / "gpu.json"
    for contender in ("session", "ours"):
        assert gpu.main(["--device", "cpu", "--models", "mlp", "--contenders", contender, "--losses", "2",
                         "--timed", "1", "--json", str(out), "--append"]) == 0
    assert [r["contender"] for r in json.loads(out.read_text())] == ["session", "ours"]
    lines = capsys.readouterr().out.splitlines()
    last_table = lines[max(i for i, line in enumerate(lines) if line.startswith("model ")):]
    assert [line.split()[1] for line in last_table[1:3]] == ["session", "ours"], last_table
