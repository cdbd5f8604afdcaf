"""The WebGPU step (export_step(target="webgpu"), onnx_training_ops/export/webgpu.py) and its
passes, each against onnxruntime's CPU provider on the graph it rewrites: the rewritten step,
with its host program evaluated in Python, computes the portable step's losses and state."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.export import export_step
from onnx_training_ops.export.host_program import run as run_host
from onnx_training_ops.passes._graph import value_types
from onnx_training_ops.passes.dequantize_with_float_ops import dequantize_with_float_ops
from onnx_training_ops.passes.fold_static_shapes import fold_static_shapes
from onnx_training_ops.passes.int32_inputs import int32_inputs
from onnx_training_ops.passes.lower_log_softmax import lower_log_softmax
from onnx_training_ops.passes.lower_one_hot import lower_one_hot
from onnx_training_ops.passes.lower_sum import lower_sum
from onnx_training_ops.passes.split_host_scalars import split_host_scalars
from onnx_training_ops.storage import safetensors

sys.path.insert(0, str(Path(__file__).parent))
import js_fixtures  # noqa: E402

# what onnxruntime-web 1.30's WebGPU provider does not run (DESIGN.md)
LACKING = {"LogSoftmax", "OneHot", "Sum", "GatherBlockQuantized"}
COMPARISONS = {"Equal", "Less", "Greater", "LessOrEqual", "GreaterOrEqual"}


def _model(nodes, inputs, outputs, opset=17, initializers=()):
    graph = helper.make_graph(nodes, "g", inputs, outputs, list(initializers))
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)])
    model.ir_version = 8
    return model


def _run(model, feeds):
    session = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    return dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))


def _vi(name, elem, shape):
    return helper.make_tensor_value_info(name, elem, shape)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_lower_log_softmax_equals_onnxruntime(axis):
    model = _model([helper.make_node("LogSoftmax", ["x"], ["y"], axis=axis)], [_vi("x", TensorProto.FLOAT, [3, 5, 4])],
                   [_vi("y", TensorProto.FLOAT, [3, 5, 4])])
    x = (np.random.default_rng(0).standard_normal((3, 5, 4)) * 30).astype(np.float32)
    expected = _run(model, {"x": x})["y"]
    lowered = lower_log_softmax(model)
    assert {n.op_type for n in lowered.graph.node} >= {"ReduceMax", "Exp", "Log"}
    assert "LogSoftmax" not in {n.op_type for n in lowered.graph.node}
    np.testing.assert_allclose(_run(lowered, {"x": x})["y"], expected, rtol=2e-6, atol=2e-6)


@pytest.mark.parametrize("axis", [-1, 0, 1])
def test_lower_one_hot_equals_onnxruntime(axis):
    depth = helper.make_node("Constant", [], ["depth"], value=helper.make_tensor("d", TensorProto.INT64, [1], [5]))
    values = helper.make_node("Constant", [], ["values"],
                              value=helper.make_tensor("v", TensorProto.FLOAT, [2], [-0.5, 2.0]))
    node = helper.make_node("OneHot", ["i", "depth", "values"], ["y"], axis=axis)
    model = _model([depth, values, node], [_vi("i", TensorProto.INT64, [2, 4])], [_vi("y", TensorProto.FLOAT, None)])
    indices = np.array([[0, 4, -1, -5], [7, -6, 2, 3]], np.int64)  # negative wrap, out of range on both sides
    expected = _run(model, {"i": indices})["y"]
    lowered = lower_one_hot(model)
    assert "OneHot" not in {n.op_type for n in lowered.graph.node}
    np.testing.assert_array_equal(_run(lowered, {"i": indices})["y"], expected)


def test_lower_one_hot_refuses_a_computed_depth():
    node = helper.make_node("OneHot", ["i", "depth", "values"], ["y"])
    model = _model([node], [_vi("i", TensorProto.INT64, [2]), _vi("depth", TensorProto.INT64, [1]),
                            _vi("values", TensorProto.FLOAT, [2])], [_vi("y", TensorProto.FLOAT, None)])
    with pytest.raises(TrainingOpError, match="depth and values must be constants"):
        lower_one_hot(model)


def test_lower_sum_equals_onnxruntime():
    model = _model([helper.make_node("Sum", ["a", "b", "c"], ["y"]), helper.make_node("Sum", ["a"], ["z"])],
                   [_vi("a", TensorProto.FLOAT, [3, 1]), _vi("b", TensorProto.FLOAT, [4]),
                    _vi("c", TensorProto.FLOAT, [1])],
                   [_vi("y", TensorProto.FLOAT, [3, 4]), _vi("z", TensorProto.FLOAT, [3, 1])])
    rng = np.random.default_rng(1)
    feeds = {"a": rng.standard_normal((3, 1)).astype(np.float32), "b": rng.standard_normal(4).astype(np.float32),
             "c": rng.standard_normal(1).astype(np.float32)}
    expected = _run(model, feeds)
    lowered = lower_sum(model)
    assert "Sum" not in {n.op_type for n in lowered.graph.node}
    got = _run(lowered, feeds)
    np.testing.assert_array_equal(got["y"], expected["y"])
    np.testing.assert_array_equal(got["z"], expected["z"])


def test_fold_static_shapes():
    nodes = [helper.make_node("Shape", ["x"], ["s"], start=1), helper.make_node("Size", ["x"], ["n"])]
    model = _model(nodes, [_vi("x", TensorProto.FLOAT, [2, 3, 4])],
                   [_vi("s", TensorProto.INT64, [2]), _vi("n", TensorProto.INT64, [])])
    folded = fold_static_shapes(model)
    assert [n.op_type for n in folded.graph.node] == ["Constant", "Constant"]
    got = _run(folded, {"x": np.zeros((2, 3, 4), np.float32)})
    assert got["s"].tolist() == [3, 4] and int(got["n"]) == 24


def test_split_host_scalars_moves_the_counter_cone_and_the_program_computes_it():
    """Adam's bias correction in float64 from T, and T + 1: the program computes what
    onnxruntime computes; the graph keeps only the float32 update."""
    c = lambda name, dtype, v: helper.make_node("Constant", [], [name], value=helper.make_tensor(name, dtype, [], [v]))  # noqa: E731
    nodes = [c("one", TensorProto.INT64, 1), c("b2", TensorProto.DOUBLE, 0.999), c("d1", TensorProto.DOUBLE, 1.0),
             helper.make_node("Add", ["T", "one"], ["T.new"]),
             helper.make_node("Cast", ["T.new"], ["Td"], to=TensorProto.DOUBLE),
             helper.make_node("Cast", ["lr"], ["lrd"], to=TensorProto.DOUBLE),
             helper.make_node("Pow", ["b2", "Td"], ["p"]), helper.make_node("Sub", ["d1", "p"], ["q"]),
             helper.make_node("Sqrt", ["q"], ["r"]), helper.make_node("Mul", ["lrd", "r"], ["s"]),
             helper.make_node("Cast", ["s"], ["step"], to=TensorProto.FLOAT),
             helper.make_node("Mul", ["x", "step"], ["y"])]
    model = _model(nodes, [_vi("T", TensorProto.INT64, []), _vi("lr", TensorProto.FLOAT, []),
                           _vi("x", TensorProto.FLOAT, [3])],
                   [_vi("y", TensorProto.FLOAT, [3]), _vi("T.new", TensorProto.INT64, [])])
    x = np.arange(3, dtype=np.float32)
    for t in (0, 1, 7, 2 ** 33):
        feeds = {"T": np.array(t, np.int64), "lr": np.array(0.01, np.float32), "x": x}
        expected = _run(model, feeds)
        rewritten = onnx.ModelProto()
        rewritten.CopyFrom(model)
        rewritten, program = split_host_scalars(rewritten, ["T", "lr"])
        assert {n.op_type for n in rewritten.graph.node} == {"Mul", "Constant"}
        assert [f["name"] for f in program["feeds"]] == ["step"] and program["outputs"] == ["T.new"]
        host = run_host(json.loads(json.dumps(program)), {"T": feeds["T"], "lr": feeds["lr"]})
        assert int(host["T.new"]) == t + 1
        got = _run(rewritten, {"x": x, "step": host["step"]})
        np.testing.assert_array_equal(got["y"], expected["y"])


def test_split_host_scalars_refuses_an_op_the_host_does_not_run():
    nodes = [helper.make_node("Cast", ["T"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Softmax", ["f"], ["g"]), helper.make_node("Mul", ["x", "g"], ["y"])]
    model = _model(nodes, [_vi("T", TensorProto.INT64, [1]), _vi("x", TensorProto.FLOAT, [1])],
                   [_vi("y", TensorProto.FLOAT, [1])])
    with pytest.raises(TrainingOpError, match="Softmax"):
        split_host_scalars(model, ["T"])


def test_int32_inputs_narrows_only_indexing_inputs():
    """labels: cast only; ids: index arithmetic with int64 constants (int32 copies), a Cast back
    to int64 before ScatterND; other: added to an int64 state value, so it stays int64. The
    rewritten model computes what the original does."""
    c = lambda name, v: helper.make_node("Constant", [], [name], value=helper.make_tensor(  # noqa: E731
        name, TensorProto.INT64, [], [v]))
    nodes = [c("zero", 0), c("vocab", 5), c("axis", -1),
             helper.make_node("Cast", ["labels"], ["f"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["other", "counter"], ["o2"]),
             helper.make_node("Cast", ["o2"], ["g"], to=TensorProto.FLOAT),
             helper.make_node("Add", ["f", "g"], ["y"]),
             helper.make_node("Less", ["ids", "zero"], ["negative"]),
             helper.make_node("Add", ["ids", "vocab"], ["wrapped"]),
             helper.make_node("Where", ["negative", "wrapped", "ids"], ["index"]),
             helper.make_node("Unsqueeze", ["index", "axis"], ["nd"]),
             helper.make_node("Gather", ["table", "ids"], ["rows"]),
             helper.make_node("ScatterND", ["table", "nd", "rows"], ["scattered"], reduction="add")]
    model = _model(nodes, [_vi("labels", TensorProto.INT64, [2]), _vi("other", TensorProto.INT64, [2]),
                           _vi("counter", TensorProto.INT64, [2]), _vi("ids", TensorProto.INT64, [3]),
                           _vi("table", TensorProto.FLOAT, [5, 2])],
                   [_vi("y", TensorProto.FLOAT, [2]), _vi("scattered", TensorProto.FLOAT, [5, 2])])
    rng = np.random.default_rng(2)
    feeds = {"labels": np.array([1, 2]), "other": np.array([3, 4]), "counter": np.array([5, 6]),
             "ids": np.array([-1, 0, 3]), "table": rng.standard_normal((5, 2)).astype(np.float32)}
    expected = _run(model, feeds)
    assert int32_inputs(model, skip=["counter"]) == ["labels", "ids"]
    onnx.checker.check_model(model, full_check=True)
    got = _run(model, {**feeds, "labels": feeds["labels"].astype(np.int32), "ids": feeds["ids"].astype(np.int32)})
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value)


def _export(tmp_path, name):
    training, batches, _ = js_fixtures.MODELS[name](np.random.default_rng(0))
    shapes = {k: list(v.shape[1:]) for k, v in batches.items()}
    manifest = export_step(training, tmp_path / name, target="webgpu", input_shapes=shapes)
    return manifest, batches


def _webgpu_steps(directory, manifest, batches, steps):
    """What the JavaScript WebGPU trainer does, in Python's onnxruntime (CPU): the host
    program each step, the graph on the rest; returns the losses and the final state."""
    gpu = manifest["webgpu"]
    session = ort.InferenceSession(str(directory / manifest["files"]["step_webgpu"]["path"]),
                                   providers=["CPUExecutionProvider"])
    state, _ = safetensors.read(directory / "state.safetensors")
    rates = {e["name"]: np.array(e["base"], np.float32) for e in manifest["learning_rates"]}
    losses = []
    for i in range(steps):
        host = run_host(gpu["host"], {**state, **rates})
        feeds = {e["name"]: batches[e["name"]][i % len(batches[e["name"]])].astype(e["dtype"]) for e in gpu["inputs"]}
        feeds.update({f["name"]: host[f["name"]].astype(f["dtype"]).reshape(f["shape"]) for f in gpu["host"]["feeds"]})
        feeds.update({n: rates[n] for n in gpu["rates"]})
        feeds.update({n: state[n] for n in gpu["feedback"]})
        out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        losses.append(float(out[manifest["loss"]]))
        for n, o in gpu["feedback"].items():
            state[n] = out[o]
        for n in gpu["host_state"]:
            state[n] = host[manifest["feedback"][n]].reshape(state[n].shape)
    return losses, state


def _portable_steps(directory, manifest, batches, steps):
    session = ort.InferenceSession(str(directory / "step.onnx"), providers=["CPUExecutionProvider"])
    state, _ = safetensors.read(directory / "state.safetensors")
    rates = {e["name"]: np.array(e["base"], np.float32) for e in manifest["learning_rates"]}
    losses = []
    for i in range(steps):
        feeds = {e["name"]: batches[e["name"]][i % len(batches[e["name"]])] for e in manifest["inputs"]}
        out = dict(zip([o.name for o in session.get_outputs()],
                       session.run(None, {**feeds, **rates, **{n: state[n] for n in manifest["feedback"]}})))
        losses.append(float(out[manifest["loss"]]))
        state.update({n: out[o] for n, o in manifest["feedback"].items()})
    return losses, state


def _left_for_the_cpu(model: onnx.ModelProto) -> list[str]:
    """The nodes onnxruntime-web 1.30's WebGPU provider refuses at their types (measured in
    Chromium, js/test/webgpu.test.js, js/test/lora.test.js): the ops it lacks (GatherBlockQuantized
    of uint8 data), float64 anywhere, int64 computed by
    anything but a Cast (its Cast writes int64: ScatterND's indices must be), Slice of anything
    but floats (its Pad takes int32)."""
    elem = {name: vt.elem_type for name, vt in value_types(model).items()}  # contrib ops' outputs too
    left = [f"{n.op_type} (lacking)" for n in model.graph.node if n.op_type in LACKING]
    left += [f"{n.op_type} {n.output[0]} (float64)" for n in model.graph.node
             if any(elem.get(v) == TensorProto.DOUBLE for v in (*n.input, *n.output))]
    left += [f"{n.op_type} {n.output[0]} (int64)" for n in model.graph.node if n.op_type not in ("Constant", "Cast")
             and (any(elem.get(o) == TensorProto.INT64 for o in n.output)
                  or n.op_type in COMPARISONS and any(elem.get(i) == TensorProto.INT64 for i in n.input))]
    left += [f"Slice {n.output[0]} ({TensorProto.DataType.Name(elem.get(n.input[0], 0))})" for n in model.graph.node
             if n.op_type == "Slice" and elem.get(n.input[0]) not in (TensorProto.FLOAT, TensorProto.FLOAT16)]
    return left


@pytest.mark.parametrize("name", ["mlp", "cnn", "gpt2"])
def test_the_webgpu_step_trains_like_the_portable_step(tmp_path, name):
    """50 steps: the same losses (float32 rounding) and state; no node WebGPU lacks or refuses
    at its types, the update count off the graph, labels int32. GPT-2: right-padded batches
    (attention mask, labels -100), whose shifted labels passed int64 Slice/Pad/Reshape/Equal/
    Where (issue 36 E: on the CPU in the browser)."""
    manifest, batches = _export(tmp_path, name)
    directory = tmp_path / name
    model = onnx.load(directory / "step.webgpu.onnx")
    assert not _left_for_the_cpu(model)
    if name != "gpt2":  # ScatterND's int64 indices (the embedding gradient) come from a Cast
        assert "Cast" not in {n.op_type for n in model.graph.node if n.output[0].startswith("int32/")}
    assert manifest["counter"] not in {vi.name for vi in model.graph.input}
    assert {e["name"]: e["dtype"] for e in manifest["webgpu"]["inputs"]}["labels"] == "int32"
    ours, our_state = _webgpu_steps(directory, manifest, batches, 50)
    theirs, their_state = _portable_steps(directory, manifest, batches, 50)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    assert int(our_state[manifest["counter"]].reshape(-1)[0]) == 50
    for key, value in their_state.items():
        np.testing.assert_allclose(our_state[key], value, rtol=1e-4, atol=1e-6, err_msg=key)


def test_the_webgpu_target_needs_static_shapes_and_changes_nothing_on_failure(tmp_path):
    training, _, _ = js_fixtures.MODELS["mlp"](np.random.default_rng(0))
    with pytest.raises(TrainingOpError, match="input_shapes"):
        export_step(training, tmp_path / "out", target="webgpu")
    assert not (tmp_path / "out").exists()
    with pytest.raises(TrainingOpError, match="target 'cuda'"):
        export_step(training, tmp_path / "out", target="cuda")


def test_cli_export_step_target_webgpu(tmp_path):
    from onnx_training_ops.cli import main

    training, _, _ = js_fixtures.MODELS["mlp"](np.random.default_rng(0))
    path = tmp_path / "mlp.onnx"
    onnx.save(training, path)
    assert main(["export-step", str(path), str(tmp_path / "out"), "--target", "webgpu",
                 "--input-shape", "input=32,64", "--input-shape", "labels=32"]) == 0
    manifest = json.loads((tmp_path / "out" / "manifest.json").read_text())
    assert manifest["files"]["step_webgpu"]["path"] == "step.webgpu.onnx"
    assert [e["shape"] for e in manifest["webgpu"]["inputs"]] == [[32, 64], [32]]


def _maxpool_scatter(kernel, strides, shape=(2, 3, 4, 6)):
    """MaxPool with Indices and the derivative rule's scatter of a gradient g."""
    size = int(np.prod(shape))
    c = lambda name, values: helper.make_node("Constant", [], [name], value=helper.make_tensor(  # noqa: E731
        name, TensorProto.INT64, [len(values)], values))
    nodes = [helper.make_node("MaxPool", ["x"], ["y", "i"], kernel_shape=kernel, strides=strides),
             c("flat", [-1]), c("size", [size]),
             helper.make_node("ConstantOfShape", ["size"], ["zeros"],
                              value=helper.make_tensor("z", TensorProto.FLOAT, [1], [0])),
             helper.make_node("Reshape", ["i", "flat"], ["fi"]), helper.make_node("Reshape", ["g", "flat"], ["fg"]),
             helper.make_node("ScatterElements", ["zeros", "fi", "fg"], ["dx"], axis=0, reduction="add")]
    out_shape = [shape[0], shape[1], shape[2] // strides[0], shape[3] // strides[1]]
    return _model(nodes, [_vi("x", TensorProto.FLOAT, list(shape)), _vi("g", TensorProto.FLOAT, out_shape)],
                  [_vi("y", TensorProto.FLOAT, out_shape), _vi("dx", TensorProto.FLOAT, [size])]), out_shape


def test_maxpool_gradient_by_mask_equals_the_scatter_ties_included():
    from onnx_training_ops.passes.maxpool_gradient_by_mask import maxpool_gradient_by_mask

    model, out_shape = _maxpool_scatter([2, 3], [2, 3])
    rng = np.random.default_rng(3)
    x = rng.integers(0, 3, (2, 3, 4, 6)).astype(np.float32)  # many ties: the first maximum takes the gradient
    g = rng.standard_normal(out_shape).astype(np.float32)
    expected = _run(model, {"x": x, "g": g})
    rewritten = maxpool_gradient_by_mask(model)
    assert all(len(n.output) == 1 for n in rewritten.graph.node if n.op_type == "MaxPool")
    assert "ScatterElements" not in {n.op_type for n in rewritten.graph.node}
    got = _run(rewritten, {"x": x, "g": g})
    np.testing.assert_array_equal(got["dx"], expected["dx"])
    np.testing.assert_array_equal(got["y"], expected["y"])


def test_maxpool_gradient_by_mask_refuses_overlapping_windows():
    from onnx_training_ops.passes.maxpool_gradient_by_mask import maxpool_gradient_by_mask

    model, _ = _maxpool_scatter([2, 2], [1, 1], shape=(1, 1, 4, 4))
    with pytest.raises(TrainingOpError, match="tile"):
        maxpool_gradient_by_mask(model)


def test_lower_is_nan_equals_onnxruntime():
    from onnx_training_ops.passes.lower_is_nan import lower_is_nan

    model = _model([helper.make_node("IsNaN", ["x"], ["y"])], [_vi("x", TensorProto.FLOAT, [5])],
                   [_vi("y", TensorProto.BOOL, [5])])
    x = np.array([0, np.nan, np.inf, -np.inf, -0.0], np.float32)
    expected = _run(model, {"x": x})["y"]
    lowered = lower_is_nan(model)
    assert "IsNaN" not in {n.op_type for n in lowered.graph.node}
    np.testing.assert_array_equal(_run(lowered, {"x": x})["y"], expected)


def _int_const(name, values):
    return helper.make_node("Constant", [], [name], value=helper.make_tensor(name, TensorProto.INT64, [len(values)],
                                                                              values))


@pytest.mark.parametrize("starts,ends,axes,steps", [
    ([1], [2 ** 63 - 1], [1], None),  # labels[:, 1:], a causal LM's shift
    ([-3, 0], [-1, 1], [2, 0], [1, 1]),  # negative starts and ends, axes out of order
    ([0, 2], [5, 100], None, None),  # axes by default, an end past the dimension (clamped)
    ([4], [2], [1], None),  # empty
])
def test_slice_as_pad_equals_onnxruntimes_slice(starts, ends, axes, steps):
    """An int32 Slice with unit steps becomes one Pad (negative pads crop), and computes the
    same; the Slice is gone (onnxruntime-web's WebGPU Slice is float-only)."""
    from onnx_training_ops.passes.slice_as_pad import slice_as_pad

    names = ["starts", "ends"] + (["axes"] if axes is not None else []) + (["steps"] if steps is not None else [])
    values = [starts, ends] + ([axes] if axes is not None else []) + ([steps] if steps is not None else [])
    nodes = [_int_const(n, v) for n, v in zip(names, values)] + [helper.make_node("Slice", ["x", *names], ["y"])]
    model = _model(nodes, [_vi("x", TensorProto.INT32, [3, 6, 4])], [_vi("y", TensorProto.INT32, None)])
    x = np.arange(72, dtype=np.int32).reshape(3, 6, 4) - 30
    expected = _run(model, {"x": x})["y"]
    rewritten = slice_as_pad(model)
    ops = [n.op_type for n in rewritten.graph.node]
    if expected.size == 0:  # a Pad cannot make a negative extent: such a Slice stays
        assert "Slice" in ops
        return
    assert "Slice" not in ops and ops.count("Pad") == 1
    np.testing.assert_array_equal(_run(rewritten, {"x": x})["y"], expected)


def test_slice_as_pad_leaves_float_strided_and_dynamic_slices():
    from onnx_training_ops.passes.slice_as_pad import slice_as_pad

    nodes = [_int_const("s", [1]), _int_const("e", [5]), _int_const("a", [1]), _int_const("two", [2]),
             helper.make_node("Slice", ["f", "s", "e", "a"], ["y1"]),  # float: WebGPU slices floats
             helper.make_node("Slice", ["x", "s", "e", "a", "two"], ["y2"]),  # step 2
             helper.make_node("Slice", ["x", "start", "e", "a"], ["y3"]),  # a start fed at run time
             helper.make_node("Slice", ["d", "s", "e", "a"], ["y4"])]  # a dimension unknown until run time
    model = _model(nodes, [_vi("f", TensorProto.FLOAT, [2, 6]), _vi("x", TensorProto.INT32, [2, 6]),
                           _vi("start", TensorProto.INT64, [1]), _vi("d", TensorProto.INT32, [2, "T"])],
                   [_vi(f"y{i}", TensorProto.FLOAT if i == 1 else TensorProto.INT32, None) for i in range(1, 5)])
    assert [n.op_type for n in slice_as_pad(model).graph.node].count("Slice") == 4


def test_int32_inputs_follows_shifted_labels_through_slice_pad_gather_and_concat():
    """A causal LM's label shift (Slice, Pad with the ignore index), a Gather of label columns
    and a Concat: all int32, Pad's value and Concat's constant part copied as int32; what the
    model computes is unchanged."""
    nodes = [_int_const("s", [1]), _int_const("e", [2 ** 62]), _int_const("a", [1]), _int_const("pads", [0, 0, 0, 1]),
             helper.make_node("Constant", [], ["ignore"], value=helper.make_tensor("ignore", TensorProto.INT64, [],
                                                                                     [-100])),
             _int_const("cols", [2, 0]), helper.make_node("Constant", [], ["tail"], value=helper.make_tensor(
                 "tail", TensorProto.INT64, [2, 1], [7, 8])),
             helper.make_node("Slice", ["labels", "s", "e", "a"], ["sliced"]),
             helper.make_node("Pad", ["sliced", "pads", "ignore"], ["shifted"]),
             helper.make_node("Equal", ["shifted", "ignore"], ["ignored"]),
             helper.make_node("Gather", ["shifted", "cols"], ["picked"], axis=1),
             helper.make_node("Concat", ["picked", "tail"], ["joined"], axis=1),
             helper.make_node("GatherElements", ["table", "joined"], ["y"], axis=1)]
    model = _model(nodes, [_vi("labels", TensorProto.INT64, [2, 4]), _vi("table", TensorProto.FLOAT, [2, 9])],
                   [_vi("y", TensorProto.FLOAT, [2, 3]), _vi("ignored", TensorProto.BOOL, [2, 4])])
    labels = np.array([[1, 2, 3, 4], [5, 6, 7, 8]])
    table = np.random.default_rng(4).standard_normal((2, 9)).astype(np.float32)
    expected = _run(model, {"labels": labels, "table": table})
    assert int32_inputs(model) == ["labels"]
    assert "Cast" not in {n.op_type for n in model.graph.node}
    got = _run(model, {"labels": labels.astype(np.int32), "table": table})
    for key, value in expected.items():
        np.testing.assert_array_equal(got[key], value)


@pytest.mark.parametrize("op", ["Equal", "Pad"])
def test_int32_inputs_with_a_constant_outside_int32_computes_what_the_model_does(op):
    """ignore_index=None's sentinel -(2**62) has no int32 copy: astype wraps it to 0, and a label
    0 compared equal to it (before: Equal gave [True, False, False]). Such an input stays int64."""
    sentinel = helper.make_node("Constant", [], ["never"], value=helper.make_tensor("never", TensorProto.INT64, [],
                                                                                      [-(2 ** 62)]))
    if op == "Equal":
        nodes = [sentinel, helper.make_node("Equal", ["labels", "never"], ["y"])]
        out = _vi("y", TensorProto.BOOL, [3])
    else:
        nodes = [sentinel, _int_const("pads", [0, 1]), helper.make_node("Pad", ["labels", "pads", "never"], ["p"]),
                 helper.make_node("Cast", ["p"], ["y"], to=TensorProto.FLOAT)]
        out = _vi("y", TensorProto.FLOAT, [4])
    model = _model(nodes, [_vi("labels", TensorProto.INT64, [3])], [out])
    labels = np.array([0, 1, 2])
    expected = _run(model, {"labels": labels})["y"]
    narrowed = int32_inputs(model)
    got = _run(model, {"labels": labels.astype(np.int32) if narrowed else labels})["y"]
    np.testing.assert_array_equal(got, expected)


def test_int32_inputs_takes_an_attention_masks_row_lengths_in_int32():
    """onnxruntime-genai's models read the sequence lengths GroupQueryAttention wants (int32) as
    ReduceSum(attention_mask) - 1: computed in int32 from an int32 mask."""
    nodes = [_int_const("axes", [1]), _int_const("one", [1]),
             helper.make_node("ReduceSum", ["mask", "axes"], ["total"], keepdims=0),
             helper.make_node("Sub", ["total", "one"], ["last"]),
             helper.make_node("Cast", ["last"], ["seqlens"], to=TensorProto.INT32)]
    model = _model(nodes, [_vi("mask", TensorProto.INT64, [2, 5])], [_vi("seqlens", TensorProto.INT32, [2])], opset=18)
    mask = np.array([[1, 1, 1, 0, 0], [1, 1, 1, 1, 1]])
    expected = _run(model, {"mask": mask})["seqlens"]
    assert int32_inputs(model) == ["mask"]
    assert not _left_for_the_cpu(model)
    np.testing.assert_array_equal(_run(model, {"mask": mask.astype(np.int32)})["seqlens"], expected)


@pytest.mark.parametrize("bits,zero_points,rows", [(4, "none", None), (4, "uint8", None), (8, "uint8", None),
                                                   (2, "none", None), (4, "uint8", (5, 17)), (2, "uint8", (0, 8))])
def test_dequantize_with_float_ops_equals_gather_block_quantized(bits, zero_points, rows):
    """The MatMulNBits rule's dequantization (GatherBlockQuantized of every row or of a row range,
    indices tied to the gradient) rewritten as DequantizeLinear and float arithmetic: the same
    weight, bit for bit, nothing WebGPU refuses."""
    from contrib_refs import MS, quantized_weight

    from onnx_training_ops.autodiff.emitter import Emitter, ValueMeta
    from onnx_training_ops.autodiff.registry import RuleContext
    from onnx_training_ops.autodiff.rules_quantized import QuantizedWeight

    rng = np.random.default_rng(bits)
    n, k, block = 24, 64, 16
    _, inits = quantized_weight(rng, n, k, bits, block, zero_points)
    names = ["B", "scales"] + (["zero_points"] if "zero_points" in inits else [])
    node = helper.make_node("MatMulNBits", ["a", *names], ["y"], domain=MS, K=k, N=n, bits=bits, block_size=block)
    em = Emitter("grad/", 18, {name: ValueMeta(TensorProto.FLOAT if name == "scales" else TensorProto.UINT8,
                                               value.shape) for name, value in inits.items()})
    em.set_meta("g", TensorProto.FLOAT, (3, n))
    em.set_meta("a", TensorProto.FLOAT, (3, k))
    weight = QuantizedWeight(RuleContext(node, ["g"], [True], em, {}))
    w = weight.dequantized("g", "a", rows)
    em.add_node(helper.make_node("Identity", [w], ["w"]))
    count = n if rows is None else rows[1] - rows[0]
    model = _model(em.nodes, [_vi("g", TensorProto.FLOAT, [3, n])], [_vi("w", TensorProto.FLOAT, [count, k])],
                   opset=18,
                   initializers=[numpy_helper.from_array(v, name) for name, v in inits.items()])
    model.opset_import.append(helper.make_opsetid(MS, 1))
    g = rng.standard_normal((3, n)).astype(np.float32)
    assert "GatherBlockQuantized" in {n.op_type for n in model.graph.node}
    expected = _run(model, {"g": g})["w"]
    rewritten = dequantize_with_float_ops(model)
    assert not _left_for_the_cpu(rewritten)
    assert "DequantizeLinear" in {n.op_type for n in rewritten.graph.node}
    np.testing.assert_array_equal(_run(rewritten, {"g": g})["w"], expected)


def test_the_int4_lora_webgpu_step_trains_like_the_portable_step(tmp_path):
    """LoRA on onnxruntime-genai's tiny int4 Llama (MatMulNBits, GroupQueryAttention...): its WebGPU
    step keeps the contrib ops WebGPU runs, dequantizes with float ops, computes the attention mask's
    lengths in int32, and trains 10 steps like the portable step (js/test/lora.test.js runs it in
    Chromium, every node on WebGPU)."""
    pytest.importorskip("onnxruntime_genai")
    pytest.importorskip("torch")
    training, batches, _ = js_fixtures._lora_int4(np.random.default_rng(0), tmp_path / "genai")
    shapes = {k: list(v.shape[1:]) for k, v in batches.items()}
    manifest = export_step(training, tmp_path / "lora", target="webgpu", input_shapes=shapes)
    model = onnx.load(tmp_path / "lora" / "step.webgpu.onnx")
    assert not _left_for_the_cpu(model)
    contrib = {n.op_type for n in model.graph.node if n.domain == "com.microsoft"}
    assert {"MatMulNBits", "GroupQueryAttention"} <= contrib
    assert {e["name"]: e["dtype"] for e in manifest["webgpu"]["inputs"]}["attention_mask"] == "int32"
    ours, our_state = _webgpu_steps(tmp_path / "lora", manifest, batches, 10)
    theirs, their_state = _portable_steps(tmp_path / "lora", manifest, batches, 10)
    np.testing.assert_allclose(ours, theirs, rtol=1e-5)
    for key, value in their_state.items():
        np.testing.assert_allclose(our_state[key], value, rtol=1e-4, atol=1e-6, err_msg=key)
