"""Static shapes for a device step (``input_shapes``): checked the same way wherever they are
taken (the device session, ``export_step(target="webgpu")``, ``DeviceTrainer``, the command
line), and folded without an onnxruntime session, so 16-bit graphs keep their 16-bit nodes.

Before (issue 36 B.10, issue 39 items 2-3): inconsistent values for a dim two inputs share gave a
raw onnxruntime ShapeInferenceError (CLI exit 3); the WebGPU export took 0 and negative dims and
truncated 4.5, and raised raw ValueError/TypeError for "four", nan or a bare int; bf16 with
``target="webgpu"`` failed with a raw NOT_IMPLEMENTED; a bf16 step with ``input_shapes`` failed
at load (the fold's onnxruntime CPU session has no bfloat16 Gemm/MatMul), and an fp16 one became
float32 (the CPU EP's inserted casts ended up in the folded model)."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.export import DeviceTrainer, export_step
from onnx_training_ops.training.engine.device_graphs import device_step_graphs
from onnx_training_ops.training.engine.graph import APPLY
from onnx_training_ops.training.state.state import collect_state_protos


def _model():
    return ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", ot.AdamW(lr=1e-2))


BAD = [
    ({"input": [4, 8], "labels": [5]}, r"dim 'N'.* 'input' and 'labels' share two values: 4 \('input'\) and 5"),
    ({"input": [0, 8], "labels": [0]}, r"input_shapes\['input'\] must be a list of whole numbers > 0.*\[0, 8\]"),
    ({"input": [-1, 8], "labels": [4]}, r"whole numbers > 0.*\[-1, 8\]"),
    ({"input": [4.5, 8], "labels": [4]}, r"whole numbers > 0.*\[4.5, 8\]"),
    ({"input": ["four", 8], "labels": [4]}, r"whole numbers > 0.*\['four', 8\]"),
    ({"input": [float("nan"), 8], "labels": [4]}, r"whole numbers > 0.*\[nan, 8\]"),
    ({"input": 4, "labels": [4]}, r"input_shapes\['input'\] must be a list.*found 4"),
    ({"input": "4,8", "labels": [4]}, r"found '4,8'"),
    ({"input": [True, 8], "labels": [4]}, r"found \[True, 8\]"),
    (4, r"input_shapes must map input names to lists of dims.*found int 4"),
    ({"input": [4, 9], "labels": [4]}, r"input_shapes\['input'\] is \[4, 9\]; the input's shape is \['N', 8\]"),
    ({"input": [4, 8], "labels": [4], "x": [1]}, r"names \['x'\], not data inputs"),
]


def _model_with_named_dims():
    """The MLP; its input [N, 8] and labels [N] share the batch dim ``N``."""
    model = _model()
    shapes = {vi.name: [d.dim_param or d.dim_value for d in vi.type.tensor_type.shape.dim]
              for vi in (*model.graph.input, *model.training_info[0].algorithm.input)}
    assert shapes["input"] == ["N", 8] and shapes["labels"] == ["N"]
    return model


@pytest.mark.parametrize("shapes,message", BAD, ids=[f"bad{i}" for i in range(len(BAD))])
def test_invalid_input_shapes_are_one_clear_error_in_the_session_the_export_and_the_trainer(shapes, message, tmp_path):
    model = _model_with_named_dims()
    with pytest.raises(TrainingOpError, match=message):
        ot.TrainingSession(model, device="cpu", input_shapes=shapes)
    with pytest.raises(TrainingOpError, match=message):
        export_step(model, tmp_path / "web", target="webgpu", input_shapes=shapes)
    assert not (tmp_path / "web").exists()
    export_step(model, tmp_path / "plain")
    with pytest.raises(TrainingOpError, match=message):
        DeviceTrainer(tmp_path / "plain", input_shapes=shapes)
    with pytest.raises(TrainingOpError, match=message):
        device_step_graphs(model, shapes)


def test_shapes_the_graph_refuses_together_are_a_clear_error():
    """Unnamed dims that the graph relates (the labels' batch against the logits'): onnx's shape
    inference over the fixed graph names the clash, not a raw onnxruntime error."""
    model = _model()
    for vi in model.training_info[0].algorithm.input:
        if vi.name == "labels":
            vi.type.tensor_type.shape.dim[0].dim_param = "M"
    with pytest.raises(TrainingOpError, match=r"input_shapes: the graph does not take these shapes together "
                                              r"\(input: \[4, 8\], labels: \[5\]\): "
                                              r"\(op_type:Mul, node name: loss/.*\): "
                                              r"\[ShapeInferenceError\] Incompatible dimensions$"):
        ot.TrainingSession(model, device="cpu", input_shapes={"input": [4, 8], "labels": [5]})


@pytest.mark.parametrize("argv,message", [
    (["--input-shape", "input=4,8", "--input-shape", "labels=5"], "share two values"),
    (["--input-shape", "input=0,8", "--input-shape", "labels=0"], "whole numbers > 0"),
    (["--input-shape", "input=4.5,8", "--input-shape", "labels=4"], "expected NAME=D,D"),
    (["--input-shape", "input=nan,8", "--input-shape", "labels=4"], "expected NAME=D,D"),
])
def test_the_command_line_exits_2_with_one_line(argv, message, tmp_path, capsys):
    from onnx_training_ops.cli import main

    path = tmp_path / "mlp.onnx"
    onnx.save(_model_with_named_dims(), path)
    assert main(["export-step", str(path), str(tmp_path / "out"), "--target", "webgpu", *argv]) == 2
    err = capsys.readouterr().err.strip()
    assert message in err and len(err.splitlines()) == 1, err


def test_bf16_to_webgpu_is_a_clear_error(tmp_path):
    bf16 = ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", ot.AdamW(), precision="bf16")
    with pytest.raises(TrainingOpError, match=r"precision='bf16' with target='webgpu': WebGPU has no bfloat16"):
        export_step(bf16, tmp_path / "out", target="webgpu", input_shapes={"input": [4, 8], "labels": [4]})
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------------------------------------- folding


@pytest.fixture(scope="module")
def block():
    """A small attention block exported by TorchScript with a symbolic batch (shape arithmetic
    in its graph and its gradient)."""
    torch = pytest.importorskip("torch")

    class Block(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.qkv, self.out, self.norm = torch.nn.Linear(8, 24), torch.nn.Linear(8, 3), torch.nn.LayerNorm(8)

        def forward(self, x):
            q, k, v = self.qkv(self.norm(x)).reshape(x.shape[0], x.shape[1], 3, 2, 4).unbind(2)
            att = torch.softmax(q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2) / 2.0, -1)
            y = (att @ v.transpose(1, 2)).transpose(1, 2).reshape(x.shape[0], x.shape[1], 8)
            return self.out(y.mean(1))

    torch.manual_seed(0)
    module = Block()
    with torch.no_grad():
        for p in module.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module, (torch.randn(2, 5, 8),), f, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["x"], output_names=["logits"],
                          dynamic_axes={"x": {0: "N"}, "logits": {0: "N"}})
    return onnx.load_from_string(f.getvalue())


def _types(model: onnx.ModelProto) -> dict[str, int]:
    g = onnx.shape_inference.infer_shapes(model).graph
    types = {t.name: t.data_type for t in g.initializer}
    types.update({vi.name: vi.type.tensor_type.elem_type for vi in (*g.input, *g.value_info, *g.output)})
    return types


@pytest.mark.parametrize("precision,low", [("fp16", TensorProto.FLOAT16), ("bf16", TensorProto.BFLOAT16)])
def test_the_static_step_keeps_its_16_bit_matmuls_and_folds_every_shape(block, precision, low):
    built = ot.build_training_model(block, "cross_entropy", ot.AdamW(), precision=precision)
    [dynamic] = device_step_graphs(built)
    [static] = device_step_graphs(built, {"x": [4, 5, 8], "labels": [4]})
    step = static.model_proto
    ops = [n.op_type for n in step.graph.node]
    assert "Shape" in [n.op_type for n in dynamic.model_proto.graph.node]
    assert not {"Shape", "Size", "NonZero"} & set(ops)
    types = _types(step)
    matmuls = [n for n in step.graph.node if n.op_type in ("MatMul", "Gemm")]
    sixteen = [n for n in matmuls if types.get(n.input[0]) == low]
    want = sum(types.get(n.input[0]) == low for n in dynamic.model_proto.graph.node if n.op_type in ("MatMul", "Gemm"))
    assert want >= 6 and len(sixteen) == want  # forward and backward matmuls, none gone float32
    assert not any("InsertedPrecisionFreeCast" in name for n in step.graph.node for name in n.input)


def test_the_folded_step_computes_what_the_symbolic_one_does(block):
    """The fold (numpy, not onnxruntime) changes no value: one step of the static graph and of the
    symbolic one, run by onnxruntime's CPU provider, give the same loss and state."""
    built = ot.build_training_model(block, "cross_entropy", ot.AdamW(lr=1e-2))
    [dynamic] = device_step_graphs(built)
    [static] = device_step_graphs(built, {"x": [4, 5, 8], "labels": [4]})
    rng = np.random.default_rng(0)
    state = {n: onnx.numpy_helper.to_array(t) for n, t in collect_state_protos(built).items()}
    feeds = {"x": rng.standard_normal((4, 5, 8)).astype(np.float32), "labels": rng.integers(0, 3, 4)}
    results = []
    for graph in (dynamic, static):
        session = ort.InferenceSession(graph.model_proto.SerializeToString(), providers=["CPUExecutionProvider"])
        names = {i.name: i for i in session.get_inputs()}
        values = {**{k: v for k, v in state.items() if k in names}, **feeds}
        for name, info in names.items():  # the learning rate, the update count, the capture gate (static)
            if name == APPLY:
                values[name] = np.array(True)
            elif name not in values:
                values[name] = np.array(1e-2 if "float" in info.type else 1, np.float32 if "float" in info.type
                                        else np.int64).reshape([d if isinstance(d, int) else 1 for d in info.shape])
        results.append(dict(zip([o.name for o in session.get_outputs()], session.run(None, values))))
    assert results[0].keys() == results[1].keys()
    for name, value in results[0].items():
        np.testing.assert_allclose(results[1][name], value, rtol=1e-6, atol=1e-7, err_msg=name)



def test_fold_constants_folds_shape_arithmetic_and_leaves_16_bit_and_big_values():
    from onnx import helper, numpy_helper

    from onnx_training_ops.passes.fold_constants import fold_constants

    c = lambda name, v: numpy_helper.from_array(np.array(v, np.int64), name)  # noqa: E731
    nodes = [
        helper.make_node("Shape", ["x"], ["shape"]),
        helper.make_node("Gather", ["shape", "zero"], ["batch"], axis=0),
        helper.make_node("Unsqueeze", ["batch", "zero1"], ["batch1"]),
        helper.make_node("Concat", ["batch1", "minus1"], ["target"], axis=0),
        helper.make_node("Reshape", ["x", "target"], ["flat"]),
        helper.make_node("Shape", ["flat"], ["flat_shape"]),  # static only once the Reshape's target folded
        helper.make_node("ConstantOfShape", ["flat_shape"], ["zeros"]),
        helper.make_node("Add", ["flat", "zeros"], ["y"]),
        helper.make_node("Cast", ["one"], ["one16"], to=TensorProto.BFLOAT16),  # 16-bit: left to the provider
        helper.make_node("ConstantOfShape", ["big"], ["huge"]),  # 4M elements: not stored in the graph
        helper.make_node("Shape", ["x"], ["unread"]),
    ]
    graph = helper.make_graph(
        nodes, "g", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3, 2])],
        [helper.make_tensor_value_info(n, TensorProto.UNDEFINED, None) for n in ("y", "one16", "huge")],
        [c("zero", 0), c("zero1", [0]), c("minus1", [-1]), c("big", [2048, 2048]),
         numpy_helper.from_array(np.array(1.0, np.float32), "one")])
    model = fold_constants(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)]))
    ops = [n.op_type for n in model.graph.node]
    assert sorted(op for op in ops if op != "Constant") == ["Add", "Cast", "ConstantOfShape", "Reshape"], ops
    values = {n.output[0]: numpy_helper.to_array(n.attribute[0].t) for n in model.graph.node if n.op_type == "Constant"}
    np.testing.assert_array_equal(values["target"], [4, -1])
    np.testing.assert_array_equal(values["zeros"], np.zeros((4, 6), np.float32))
    assert "unread" not in values and "big" in {t.name for t in model.graph.initializer}
