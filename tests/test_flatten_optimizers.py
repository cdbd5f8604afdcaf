"""flatten_optimizers: a multi-tensor optimizer node run over its tensors laid end to end (the
portable form for a GPU) computes what the per-tensor lowering computes, bit for bit, in
onnxruntime; nodes it cannot flatten are left alone; an export with ``flat_optimizer=True``
trains exactly like the default one."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from model_factory import optimizer_model, single_node_model

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.export import DeviceTrainer, export_step
from onnx_training_ops.passes import flatten_optimizers
from onnx_training_ops.runtime.pipeline import prepare

ATTRS = {
    "Adam": dict(alpha=0.9, beta=0.999, epsilon=1e-6, norm_coefficient=0.01, norm_coefficient_post=0.02),
    "Momentum": dict(alpha=0.9, beta=0.5, mode="nesterov", norm_coefficient=0.01),
    "Adagrad": dict(decay_factor=0.1, epsilon=1e-6, norm_coefficient=0.01),
}
ROLES = {"Adam": 4, "Momentum": 3, "Adagrad": 3}
SHAPES = [(), (5,), (3, 4), (2, 3, 2)]


def _run(model: onnx.ModelProto, feeds: dict) -> list[np.ndarray]:
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return session.run(None, {k: v for k, v in feeds.items() if k in {i.name for i in session.get_inputs()}})


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("t", [0, 7])
@pytest.mark.parametrize("op_type", ["Adam", "Momentum", "Adagrad"])
def test_flat_node_equals_the_per_tensor_lowering_bit_for_bit(op_type, t, dtype):
    rng = np.random.default_rng(t)
    groups = [[rng.standard_normal(s).astype(dtype) if s else np.array(rng.standard_normal(), dtype)
               for _ in range(ROLES[op_type])] for s in SHAPES]
    if op_type in ("Adam", "Adagrad"):  # H (the squared sums) is >= 0
        for g in groups:
            g[-1] = np.abs(g[-1])
    model, feeds, outputs = single_node_model(op_type, np.array(0.1, np.float32), np.array(t, np.int64),
                                              groups, ATTRS[op_type])
    per_tensor = prepare(model, portable=True)
    flat = prepare(model, portable=True, flat=True)
    assert sum(n.op_type == "Concat" for n in flat.graph.node) == ROLES[op_type]
    assert sum(n.op_type == "Concat" for n in per_tensor.graph.node) == 0
    for got, want, name in zip(_run(flat, feeds), _run(per_tensor, feeds), outputs):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_nodes_it_cannot_flatten_are_left_alone():
    one = optimizer_model("Adam", n=1, shapes=[[3]])
    dynamic = optimizer_model("Adam", n=2, shapes=[["N"], [3]])
    broadcast = optimizer_model("Adam", n=2, shapes=[[3], [4]])
    broadcast.graph.input[4].type.tensor_type.shape.dim[0].dim_value = 1  # G0 of shape [1] against X0 [3]
    for model in (one, dynamic, broadcast):
        before = [n.op_type for n in model.graph.node]
        assert [n.op_type for n in flatten_optimizers(model).graph.node] == before


def test_an_export_with_a_flat_optimizer_trains_like_the_default_one(tmp_path):
    model = ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", ot.AdamW(lr=1e-2, weight_decay=0.1),
                                    clip_grad_norm=0.5)
    export_step(model, tmp_path / "default")
    export_step(model, tmp_path / "flat", flat_optimizer=True)
    flat_ops = [n.op_type for n in onnx.load(tmp_path / "flat" / "step.onnx").graph.node]
    default_ops = [n.op_type for n in onnx.load(tmp_path / "default" / "step.onnx").graph.node]
    assert flat_ops.count("Sqrt") < default_ops.count("Sqrt")  # one Adam chain instead of one per tensor
    a, b = DeviceTrainer(tmp_path / "default"), DeviceTrainer(tmp_path / "flat")
    rng = np.random.default_rng(0)
    for _ in range(5):
        x = rng.standard_normal((12, 8)).astype(np.float32)
        batch = {"input": x, "labels": np.argmax(x[:, :4], -1).astype(np.int64)}
        assert a.step(batch)["loss"] == b.step(batch)["loss"]
    want = a.state_dict()
    for name, value in b.state_dict().items():
        np.testing.assert_array_equal(value, want[name], err_msg=name)


def test_the_flat_buffers_are_two_dimensional_so_shape_inference_stays_cheap():
    """onnx's data propagation treats a 1-D tensor as shape data, one dim per element: on a
    [16M] buffer the lowering's shape inference took 16 GB and 40 s (GPT-2 4L/256)."""
    from onnx_training_ops.passes._graph import value_types

    model = optimizer_model("Adam", n=2, shapes=[[1000, 1000], [1000, 1000]])
    flattened = flatten_optimizers(model)
    concats = [n for n in flattened.graph.node if n.op_type == "Concat"]
    assert concats and all(next(a.i for a in n.attribute if a.name == "axis") == 0 for n in concats)
    types = value_types(flattened)
    assert types[concats[0].output[0]].shape == (2, 1_000_000)  # two rows: a host table of 2 entries on CUDA
    slices = [n for n in flattened.graph.node if n.op_type == "Slice"]
    assert slices and all(len(types[n.output[0]].shape) == 2 for n in slices)


# sizes like a transformer's (a wide embedding, square and wide matrices, biases) with odd ones
# (a classifier's bias of 2, a scalar, a 7): 70 tensors, more than one Concat may take
MANY = [(48, 16), (16,), (16, 48), (48,), (16, 16)] * 13 + [(2,), (), (7,), (16, 2), (3, 5)]


@pytest.mark.parametrize("op_type", ["Adam", "Momentum"])
def test_many_tensors_go_in_groups_of_at_most_32_bit_for_bit(op_type, monkeypatch):
    """More than 32 tensors: one flat chain per group of at most 32 (onnxruntime's CUDA Concat
    takes up to 32 pieces by value); pieces of odd sizes are zero-padded to the buffer's width
    (here whenever that saves a row) and cut away again; the result is the per-tensor
    lowering's, bit for bit."""
    import importlib

    module = importlib.import_module("onnx_training_ops.passes.flatten_optimizers")
    from onnx_training_ops.runtime.kernel_table import host_tables

    monkeypatch.setattr(module, "PAD_COST_ROWS", 0)

    rng = np.random.default_rng(1)
    groups = [[rng.standard_normal(s).astype(np.float32) for _ in range(ROLES[op_type])] for s in MANY]
    for g in groups:
        g[-1] = np.abs(g[-1])
    model, feeds, outputs = single_node_model(op_type, np.array(0.1, np.float32), np.array(3, np.int64),
                                              groups, ATTRS[op_type])
    flat = prepare(model, portable=True, flat=True)
    concats = [n for n in flat.graph.node if n.op_type == "Concat"]
    assert len(concats) == 3 * ROLES[op_type] and max(len(n.input) for n in concats) <= 32
    assert any(n.op_type == "Pad" for n in flat.graph.node)  # the odd pieces
    rows = sum(t.axis_length for t in host_tables(flat)) // ROLES[op_type]  # an entry per row, not per element
    total = sum(int(np.prod(s)) for s in MANY)
    assert rows * 8 < total, (rows, total)
    for got, want, name in zip(_run(flat, feeds), _run(prepare(model, portable=True), feeds), outputs):
        assert got.dtype == want.dtype and got.shape == want.shape, name
        np.testing.assert_array_equal(got, want, err_msg=name)


def test_a_gradient_of_unknown_shape_is_flattened_and_a_wrong_size_fails_at_run_time():
    """A gradient whose shape inference does not know (symbolic dims upstream) still goes in the
    flat buffer, reshaped to its X's exact size: one of another size fails loudly."""
    model = optimizer_model("Adam", n=2, shapes=[[3, 2], [4]])
    g0 = next(vi for vi in model.graph.input if vi.name == "G0")
    g0.type.tensor_type.shape.dim[0].ClearField("dim_value")
    g0.type.tensor_type.shape.dim[0].dim_param = "unk"
    flat = prepare(model, portable=True, flat=True)
    assert sum(n.op_type == "Concat" for n in flat.graph.node) == 4
    rng = np.random.default_rng(0)
    feeds = {"R": np.array(0.1, np.float32), "T": np.array(1, np.int64)}
    for role in ("X", "G", "V", "H"):
        feeds[f"{role}0"], feeds[f"{role}1"] = (np.abs(rng.standard_normal((3, 2))).astype(np.float32),
                                                np.abs(rng.standard_normal(4)).astype(np.float32))
    want = _run(prepare(model, portable=True), feeds)
    for got, expected in zip(_run(flat, feeds), want):
        np.testing.assert_array_equal(got, expected)
    feeds["G0"] = np.ones((2, 2), np.float32)  # 4 elements for a tensor of 6
    with pytest.raises(Exception, match="Reshape"):
        _run(flat, feeds)


def test_a_node_left_per_tensor_says_why():
    broadcast = optimizer_model("Adam", n=2, shapes=[[3], [4]])
    broadcast.graph.input[4].type.tensor_type.shape.dim[0].dim_value = 1
    with pytest.warns(UserWarning, match=r"one update per tensor for Adam node 'opt' \(2 tensors\): 'G0' of shape "
                                         r"\[1\] broadcasts against 'X0' of shape \[3\]"):
        flatten_optimizers(broadcast)
    dynamic = optimizer_model("Adam", n=2, shapes=[["N"], [3]])
    with pytest.warns(UserWarning, match="the shape of 'X0' is not static"):
        flatten_optimizers(dynamic)


def test_the_buffer_width_keeps_the_host_table_small_on_real_models():
    """The width of a group's rows (the CUDA Concat uploads one int64 per row): GPT-2 124M's
    sizes share 768 (no padding; 124M elements in 162K rows); BERT-base's classifier bias of 2
    is padded rather than making every row 2 wide; a model of small odd sizes keeps their gcd."""
    from onnx_training_ops.passes.flatten_optimizers import _width

    gpt2 = [50257 * 768, 1024 * 768] + [768, 768, 768 * 2304, 2304, 768 * 768, 768, 768, 768,
                                        768 * 3072, 3072, 3072 * 768, 768] * 12 + [768, 768]
    assert _width(gpt2, True) == 768
    bert = [30522 * 768, 512 * 768, 2 * 768, 768, 768] + [768 * 768, 768] * 48 + [768 * 768, 768, 2 * 768, 2]
    assert _width(bert, True) == 768
    assert _width(bert, False) == 2  # no Pad kernel for the type: the common divisor
    assert _width([8192, 128, 1280, 10], True) == 2  # an MLP: padding would cost more than it saves


def test_onnxruntime_does_not_merge_the_cut_back_into_a_ragged_split(tmp_path):
    """onnxruntime's GatherSliceToSplitFusion merges single-axis Slices that cover a tensor into
    one Split; a Split of unequal pieces on CUDA uploads an int64 per element of the buffer on
    every run (three 124M-entry tables per GPT-2 124M step). The cut's Slices take two axes."""
    model = optimizer_model("Adam", n=4, shapes=[[6], [10], [4, 3], [12]])
    flat = prepare(model, portable=True, flat=True)
    options = ort.SessionOptions()
    options.optimized_model_filepath = str(tmp_path / "optimized.onnx")
    ort.InferenceSession(flat.SerializeToString(), options, providers=["CPUExecutionProvider"])
    optimized = onnx.load(options.optimized_model_filepath)
    assert "Split" not in {n.op_type for n in optimized.graph.node}
    assert sum(n.op_type == "Slice" for n in optimized.graph.node) == 3 * 4
