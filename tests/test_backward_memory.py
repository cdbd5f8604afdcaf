"""What a training step holds at once (issue 38, the int4 LoRA benchmark's memory): a wide
``MatMulNBits``'s weight dequantized by row ranges (autodiff/rules_quantized.py), cheap element-wise
values made again in the backward pass instead of kept (autodiff/recompute.py), glibc told to
return big blocks (runtime/heap.py), and a detached model's message without its tensors' bytes
(storage.detach)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import numpy as np
import onnx
import pytest
from contrib_refs import _model, gradient_model, matmul_nbits, quantized_weight, session
from onnx import helper, numpy_helper

import onnx_training_ops.autodiff.recompute as recompute
import onnx_training_ops.autodiff.rules_quantized as rules_quantized
from onnx_training_ops.autodiff.rules_quantized import row_ranges

# ---------------------------------------------------------------- MatMulNBits by row ranges


def _nbits_model(rng, n=300, k=64, bits=4, block=32, accuracy_level=1, zero_points="uint8", bias=True, out="y"):
    _, inits = quantized_weight(rng, n, k, bits, block, zero_points)
    names = ["B", "scales", "zero_points" if "zero_points" in inits else "", "", "bias" if bias else ""]
    if bias:
        inits["bias"] = rng.standard_normal(n).astype(np.float32)
    node = matmul_nbits(n, k, bits, block, names, accuracy_level, a="x", out=out)
    x = rng.standard_normal((2, 5, k)).astype(np.float32)
    return _model([node], {"x": x}, [out], inits), x


def test_row_ranges_cover_the_rows_in_equal_ranges_of_at_most_the_limit():
    assert row_ranges(300, 64, 300 * 64 * 4 // 3) == [(0, 100), (100, 200), (200, 300)]
    assert row_ranges(10, 64, 1 << 30) == [(0, 10)]
    assert row_ranges(3, 1 << 20, 16) == [(0, 1), (1, 2), (2, 3)]  # one row at least
    for n, k, limit in ((32000, 2048, 4 << 20), (5632, 2048, 4 << 20), (7, 5, 33)):
        ranges = row_ranges(n, k, limit)
        assert ranges[0][0] == 0 and ranges[-1][1] == n
        assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:]))
        assert all((stop - start) * k * 4 <= max(limit, k * 4) for start, stop in ranges)


def test_the_gradient_by_row_ranges_is_the_one_range_gradient(rng, monkeypatch):
    """dA = sum over ranges of dY_r · dequant(B)_r, each a Gemm onto the sum so far: the same
    values summed in another order, one range in float at a time."""
    model, x = _nbits_model(rng, n=96, bias=True, out="z")
    nodes, inits = list(model.graph.node), {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    weights = rng.standard_normal((2, 5, 96)).astype(np.float32)
    want = session(gradient_model(nodes, {"x": x}, "z", ["x"], weights, inits)).run(["d_x"], {"x": x})[0]
    monkeypatch.setattr(rules_quantized, "DEQUANTIZED_BYTES", 96 * 64 * 4 // 4)
    by_rows = gradient_model(nodes, {"x": x}, "z", ["x"], weights, inits)
    ops = [n.op_type for n in by_rows.graph.node]
    assert ops.count("GatherBlockQuantized") == 4 and ops.count("Gemm") == 4 and "MatMul" not in ops
    got = session(by_rows).run(["d_x"], {"x": x})[0]
    assert np.abs(got - want).max() < 1e-5 * np.abs(want).max()  # float32 sums in another order


# ---------------------------------------------------------------- recompute


def _swiglu(rng, hidden=8, inner=12):
    """A gated MLP as Llama's: down(silu(gate(x)) * up(x)), SiLU as Sigmoid and Mul."""
    x = rng.standard_normal((2, 3, hidden)).astype(np.float32)
    inits = {"Wg": rng.standard_normal((hidden, inner)).astype(np.float32) * 0.3,
             "Wu": rng.standard_normal((hidden, inner)).astype(np.float32) * 0.3,
             "Wd": rng.standard_normal((inner, hidden)).astype(np.float32) * 0.3}
    nodes = [helper.make_node("MatMul", ["x", "Wg"], ["gate"]), helper.make_node("MatMul", ["x", "Wu"], ["up"]),
             helper.make_node("Sigmoid", ["gate"], ["sig"]), helper.make_node("Mul", ["gate", "sig"], ["silu"]),
             helper.make_node("Mul", ["silu", "up"], ["h"]), helper.make_node("MatMul", ["h", "Wd"], ["out"])]
    weights = rng.standard_normal((2, 3, hidden)).astype(np.float32)
    return nodes, {"x": x}, inits, weights


def _backward_reads(model: onnx.ModelProto) -> set[str]:
    """The forward values the expanded backward pass reads (its nodes are named ``grad/...``)."""
    forward = {o for n in model.graph.node if not n.name.startswith("grad/") for o in n.output}
    return {i for n in model.graph.node if n.name.startswith("grad/") for i in n.input if i in forward}


def test_silu_and_the_gated_product_are_made_again_in_the_backward_pass(rng, monkeypatch):
    nodes, feeds, inits, weights = _swiglu(rng)
    xs = ["x", "Wg", "Wu", "Wd"]
    kept = gradient_model(nodes, feeds, "out", xs, weights, inits)  # 72 elements: under MIN_ELEMENTS
    assert {"sig", "silu", "h"} <= _backward_reads(kept)
    monkeypatch.setattr(recompute, "MIN_ELEMENTS", 1)
    again = gradient_model(nodes, feeds, "out", xs, weights, inits)
    reads = _backward_reads(again)
    assert reads.isdisjoint({"sig", "silu", "h"}) and {"gate", "up"} <= reads
    made = {n.op_type for n in again.graph.node if "again_" in n.name}
    assert made == {"Sigmoid", "Mul"}
    # the copy is tied to a gradient: its Sigmoid reads gate + a zero computed from a backward value
    producer = {o: n for n in again.graph.node for o in n.output}
    sigmoid = next(n for n in again.graph.node if "again_Sigmoid" in n.name)
    tie = producer[sigmoid.input[0]]
    assert tie.op_type == "Sub" and tie.input[0] == "gate"
    cast = producer[tie.input[1]]
    less = producer[cast.input[0]]
    assert cast.op_type == "Cast" and less.op_type == "Less" and less.input[0] == less.input[1]
    names = [f"d_{x}" for x in xs]
    want = session(kept).run(names, feeds)
    got = session(again).run(names, feeds)
    for name, w, g in zip(names, want, got):
        np.testing.assert_array_equal(g, w, err_msg=name)  # the same kernels on the same values


def test_a_value_whose_inputs_the_backward_pass_does_not_keep_is_kept(rng, monkeypatch):
    """Sigmoid's rule reads its output; its input (a MatMul's output) nothing in the backward
    reads: making the output again would keep the input instead, so the output stays."""
    monkeypatch.setattr(recompute, "MIN_ELEMENTS", 1)
    x = rng.standard_normal((4, 6)).astype(np.float32)
    w = rng.standard_normal((6, 5)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["x", "W"], ["u"]), helper.make_node("Sigmoid", ["u"], ["s"])]
    model = gradient_model(nodes, {"x": x}, "s", ["W"], np.ones((4, 5), np.float32), {"W": w})
    assert _backward_reads(model) == {"s"}
    assert not any("again_" in n.name for n in model.graph.node)


# ---------------------------------------------------------------- glibc and detached messages

_LINUX = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc and /proc: Linux")


def _python(code: str, **env) -> str:
    run = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **env})
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.strip()


@_LINUX
def test_return_big_blocks_sets_glibcs_threshold_once_unless_told_not_to():
    code = """
        from onnx_training_ops.runtime import heap
        print(heap.return_big_blocks(), heap.return_big_blocks())
    """
    assert _python(code) == "True True"
    assert _python(code, ONNX_TRAINING_OPS_MALLOPT="0") == "False False"


@_LINUX
def test_a_large_models_sessions_without_an_arena_return_big_blocks(monkeypatch):
    """A large model's sessions use the shared arena (no fresh pages each step); where the caller
    turns the arena off, malloc's big blocks go back to the system."""
    import onnxruntime as ort

    from onnx_training_ops.training.options import options

    calls = []
    monkeypatch.setattr(options, "return_big_blocks", lambda: calls.append(1) or True)
    options.fresh_options(None, {}, large=False)
    options.fresh_options(None, {}, large=True)
    assert calls == []
    no_arena = ort.SessionOptions()
    no_arena.enable_cpu_mem_arena = False
    options.fresh_options(no_arena, {}, large=True)
    assert calls == [1]


@_LINUX
def test_a_detached_model_holds_its_tensors_bytes_once():
    """A cleared field's bytes stay in protobuf's memory until the whole message goes: detach
    gives the model a fresh message, so the arrays are the only copy (measured: a 64 MB tensor,
    live memory after malloc_trim)."""
    code = """
        import ctypes, gc
        import numpy as np, onnx
        from onnx import helper, numpy_helper
        from onnx_training_ops.storage.large_model import detach
        libc = ctypes.CDLL("libc.so.6")
        def live():
            gc.collect(); libc.malloc_trim(0)
            return next(int(l.split()[1]) for l in open("/proc/self/status") if l.startswith("RssAnon")) / 1024
        def model():
            w = np.random.default_rng(0).standard_normal((4096, 4096)).astype(np.float32)  # 64 MB
            graph = helper.make_graph([helper.make_node("Identity", ["w"], ["y"])], "g", [],
                                      [helper.make_tensor_value_info("y", onnx.TensorProto.FLOAT, None)],
                                      [numpy_helper.from_array(w, "w")])
            return helper.make_model(graph)
        base = live()
        detached = detach(model())
        print(round(live() - base))
    """
    held = float(_python(code))
    assert 48 < held < 100, f"{held} MB held for a 64 MB tensor"
