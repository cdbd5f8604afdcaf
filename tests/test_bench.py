"""The benchmark harness (``python -m benchmarks``): a --quick smoke run.

Timings are never asserted: only that the run completes and the JSON has its shape.
"""

import json
import os
import struct
import subprocess
import sys

import pytest

import benchmarks as bench


def test_quick_bench_writes_json_and_png(tmp_path):
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--ops", "adam,momentum",
         "--contenders", "graph,training_session,fused", "--mlp", "training_session_fast",
         "--mlp-steps", "5", "--json", str(out), "--png", str(png)],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "training_session" in result.stdout and "ratios:" in result.stdout
    report = json.loads(out.read_text())
    assert png.stat().st_size > 0
    for key in ("machine", "versions", "copy_bandwidth_bytes_per_s", "results", "graph_breakdown", "mlp",
                "graph_session_options", "dtype"):
        assert key in report, key
    assert report["dtype"] == "float32"
    cells = {(r["op"], r["n"]) for r in report["results"]}
    assert cells == {(op, n) for op in ("adam", "momentum") for n in (10**4, 10**5)}
    for row in report["results"]:
        assert row["floor_s"] > 0
        assert not row["n/a"], row["n/a"]
        assert set(row["times"]) == {"graph", "training_session", "fused"}
        for timing in row["times"].values():
            assert timing["median_s"] > 0 and timing["min_s"] > 0 and timing["reps"] >= 5
    breakdown = report["graph_breakdown"]
    assert breakdown["op"] == "adam" and breakdown["n"] == 10**5
    assert breakdown["total_s"] > 0 and breakdown["kernel_s"] > 0
    assert report["mlp"]["64,128,10x64"]["training_session_fast"]["steps_per_s"] > 0
    # --quick pins every pool to one thread, in every contender's own process
    assert report["threads"]["fused"] == {"pinned": 1, "numba": 1}
    assert report["mlp"]["64,128,10x64"]["training_session_fast"]["threads"] == {"pinned": 1, "numba": 1}


def test_a_missing_extra_is_a_one_line_hint(monkeypatch, capsys, tmp_path):
    import importlib.util

    from benchmarks.__main__ import main

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "torch" else real(name, *a))
    monkeypatch.chdir(tmp_path)
    assert main(["--quick"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "error: this command needs 'torch': pip install 'onnx-training-ops[test]'"]
    assert not (tmp_path / "benchmarks").exists()


def test_a_torch_worker_runs_on_the_pinned_thread_count():
    """--quick let torch take both cores of a busy machine (0.00x ratios)."""
    result = subprocess.run([sys.executable, "-m", "benchmarks", "--worker", "torch_fused", "--ops",
                             "adam", "--sizes", "1000", "--min-time", "0.001", "--max-reps", "3", "--quick"],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout.strip().splitlines()[-1])["threads"] == {"pinned": 1, "numba": 1, "torch": 1}


def test_mlp_bench_takes_shapes_and_reports_an_unusable_ortt_python():
    """--ortt-python names a Python with onnxruntime-training; one without it is an n/a row."""
    result = bench.measure_mlp(["training_session_fast"], steps=3, rounds=1, shape=((8, 16, 4), 4),
                               ortt_python=sys.executable)
    assert result["training_session_fast"]["steps_per_s"] > 0
    assert "n/a" in result["onnxruntime_training"]
    assert "onnxruntime-training" in bench.format_mlp(result, "8,16,4x4")


@pytest.mark.parametrize("op", bench.OPS)
def test_graph_and_training_session_contenders_compute_the_reference_steps(op):
    """The two onnx_training_ops contenders really step the optimizer (bit for bit the numpy kernels)."""
    import numpy as np

    from onnx_training_ops.kernels import REFERENCE_KERNELS

    n, steps = 1000, 3
    state = bench.make_state(op, n)
    names = bench.STATE_NAMES[op]
    updated = [k for k in names if k != "G"]
    for _ in range(steps):
        outs = REFERENCE_KERNELS[bench.ONNX_OP[op]](
            np.array(bench.R, np.float32), np.array(bench.T, np.int64), *(state[k] for k in names), **bench.ATTRS[op]
        )
        state.update(zip(updated, outs))
    _, graph_step = bench.graph_session(op, n)
    fast_step = bench.training_session(op, n)
    for _ in range(steps):
        graph_step()
        fast_step()
    graph_state = graph_step.buffers[graph_step.current[0]]
    fast_state = fast_step.session.state_dict()
    for k in updated:
        np.testing.assert_array_equal(graph_state[k], state[k])
        np.testing.assert_array_equal(fast_state[k], state[k])


def test_cli_rejects_an_unknown_contender():
    result = subprocess.run([sys.executable, "-m", "benchmarks", "--contenders", "nope"],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and "unknown contender 'nope'" in result.stderr


@pytest.mark.parametrize("shape", ["64-128-10", "64,128,10", "64x8", "64,a,10x8", "64,0x8"])
def test_cli_rejects_a_malformed_mlp_shape_in_one_line(shape):
    result = subprocess.run([sys.executable, "-m", "benchmarks", "--mlp-shapes", shape],
                            capture_output=True, text=True, timeout=60)  # fmt: skip
    assert result.returncode == 2 and f"--mlp-shapes: {shape!r}" in result.stderr
    assert "Traceback" not in result.stderr


def _reference_steps(op, n, steps):
    import numpy as np

    from onnx_training_ops.kernels import REFERENCE_KERNELS

    state = bench.make_state(op, n)
    names = bench.STATE_NAMES[op]
    for _ in range(steps):
        outs = REFERENCE_KERNELS[bench.ONNX_OP[op]](
            np.array(bench.R, np.float32), np.array(bench.T, np.int64), *(state[k] for k in names), **bench.ATTRS[op]
        )
        state.update(zip([k for k in names if k != "G"], outs))
    return state


@pytest.mark.parametrize("op", bench.OPS)
@pytest.mark.parametrize("name", ["graph_native", "portable"])
def test_native_and_portable_contenders_update_the_state_in_place_as_the_reference_does(name, op):
    """Both bind X/V/H as one OrtValue in and out: the caller's buffers hold the new state."""
    import numpy as np

    from onnx_training_ops.runtime import native

    if name == "graph_native" and not native.availability()[0]:
        pytest.skip(f"native kernels unavailable: {native.availability()[1]}")
    n, steps = 1000, 3
    expected = _reference_steps(op, n, steps)
    step = bench.CONTENDERS[name](op, n)
    assert len(step.buffers) == 1  # in place: one set of buffers, no swapping
    for _ in range(steps):
        step()
    for k, v in step.buffers[0].items():
        np.testing.assert_allclose(v, expected[k], rtol=1e-5, atol=1e-7, err_msg=k)


def test_ortt_contender_without_ortt_python_is_na_with_the_reason():
    out = bench.measure("onnxruntime_training", ["adam"], [100], min_time=0.01, max_reps=5)
    assert "--ortt-python" in out["adam/100"]["n/a"]


def test_ortt_contender_with_an_unusable_python_is_na():
    out = bench.measure_ortt(sys.executable, ["adam", "momentum"], [100], min_time=0.01, max_reps=5)
    assert "worker failed" in out["adam/100"]["n/a"]
    assert "AdamW" in out["momentum/100"]["n/a"]


ORTT_PYTHON = "/tmp/ortt-venv/bin/python"


@pytest.mark.skipif(not os.path.exists(ORTT_PYTHON), reason=f"no onnxruntime-training Python at {ORTT_PYTHON}")
def test_ortt_contender_times_adamw_optimizer_steps(tmp_path):
    out = tmp_path / "bench.json"
    result = subprocess.run(
        [sys.executable, "-m", "benchmarks", "--quick", "--sizes", "1e3", "--ops", "adam",
         "--contenders", "graph_native,portable,onnxruntime_training", "--mlp", "none", "--ortt-python", ORTT_PYTHON,
         "--json", str(out), "--png", ""],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert result.returncode == 0, result.stdout + result.stderr
    assert "onnxruntime_training" in result.stdout
    (row,) = json.loads(out.read_text())["results"]
    timing = row["times"]["onnxruntime_training"]
    assert timing["median_s"] > 0 and timing["reps"] >= 5


def test_mlp_batches_are_a_fixed_cycle_of_distinct_learnable_batches():
    import numpy as np

    from benchmarks.dataset import BATCHES, mlp_batches

    batches, again = mlp_batches((6, 5, 3), 8), mlp_batches((6, 5, 3), 8)
    assert len(batches) == BATCHES
    for (x, y), (x2, y2) in zip(batches, again):  # the same for every contender
        assert x.dtype == np.float32 and x.shape == (8, 6) and y.dtype == np.int64 and y.shape == (8,)
        np.testing.assert_array_equal(x, x2)
        np.testing.assert_array_equal(y, y2)
    assert len({x.tobytes() for x, _ in batches}) == BATCHES  # not one batch repeated
    labels = np.concatenate([y for _, y in batches])
    assert set(labels.tolist()) == {0, 1, 2}
    # labelled by a linear teacher: a least-squares linear classifier fits them far above chance
    xs = np.concatenate([x for x, _ in batches]).astype(np.float64)
    w, *_ = np.linalg.lstsq(xs, np.eye(3)[labels], rcond=None)
    assert (np.argmax(xs @ w, axis=1) == labels).mean() > 0.8


def _row(n, floor, **times):
    return {"op": "adam", "n": n, "floor_s": floor, "n/a": {},
            "times": {c: {"median_s": t, "min_s": t, "reps": 5} for c, t in times.items()}}


def test_a_time_that_cannot_be_right_is_flagged():
    """A torch step that stalled on a busy core made the table print 0.00x: now flagged."""
    report = {"stat": "median_s", "loadavg_before_after": [(3.9, 4.5, 3.6), (3.8, 4.5, 3.6)], "results": [
        _row(10**4, 2e-6, training_session=6e-6, torch_fused=9e-3),  # torch 1500x slower: stalled
        _row(10**7, 4e-3, fused=1e-5, torch_fused=5e-3),  # below 1/20 of the floor
        _row(10**5, 2e-5, fused=4e-5, torch_fused=6e-5)]}  # plausible
    table = bench.format_table(report)
    assert bench.report.flags(report) == [
        "adam 10000 torch_fused: 9.000ms is 1500x training_session's time for the same one-pass update: it "
        "stalled (a thread pool waiting for a busy core?)",
        "adam 10000000 fused: 0.010ms is below 1/20 of the bandwidth floor"]
    assert "flagged (!), cannot be right; load average" in table and "--threads 1" in table
    assert table.count("xF!") == 2


def test_the_plot_is_a_readable_page_not_a_strip(tmp_path):
    pytest.importorskip("matplotlib")
    report = {"results": [_row(n, n * 4e-10, fused=n * 1e-9, torch_fused=n * 2e-9) | {"op": op}
                          for op in bench.OPS for n in (10**4, 10**5)],
              "mlp": {"64,128,10x64": {"torch_eager": {"steps_per_s": 9000.0}}}}
    path = tmp_path / "bench.png"
    bench.plot(report, str(path))
    width, height = struct.unpack(">II", path.read_bytes()[16:24])  # the PNG's IHDR
    assert width <= 1400 and width / height <= 2, (width, height)
