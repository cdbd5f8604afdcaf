"""The fuse_gelu pass: the exporters' GELU subgraphs become one com.microsoft Gelu/FastGelu
node when a Gradient reads the model (same values and gradients as the unfused graph, which
the portable pipeline keeps); a subgraph whose intermediate value is read elsewhere stays."""

from __future__ import annotations

import io

import numpy as np
import onnx
import pytest
from gradient_utils import gradient_model
from onnx import helper

import onnx_training_ops as ot
from onnx_training_ops.passes.fuse_gelu import fuse_gelu

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")


def _exported(activation: str) -> list:
    from transformers.activations import ACT2FN

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(4, 6), ACT2FN[activation])
    f = io.BytesIO()
    torch.onnx.export(module, (torch.randn(3, 4),), f, dynamo=False, opset_version=17,
                      do_constant_folding=False, input_names=["x"], output_names=["y"])
    model = onnx.load_from_string(f.getvalue())
    inits = {t.name: onnx.numpy_helper.to_array(t) for t in model.graph.initializer}
    return list(model.graph.node), inits


@pytest.mark.parametrize("activation,fused", [("gelu", "Gelu"), ("gelu_new", "FastGelu")])
def test_exported_gelu_is_one_node_with_the_same_values_and_gradients(activation, fused):
    nodes, inits = _exported(activation)
    feeds = {"x": np.random.default_rng(0).standard_normal((3, 4)).astype(np.float32)}
    xs = [n for n in inits if n.endswith("weight")]
    model = gradient_model(nodes, feeds, "y", xs, opset=17, initializers=inits)
    ops = [n.op_type for n in fuse_gelu(onnx.ModelProto.FromString(model.SerializeToString())).graph.node]
    assert fused in ops and "Erf" not in ops and "Tanh" not in ops
    names = ["y"] + [f"d_{x}" for x in xs]
    got = ot.InferenceSession(model, kernels="pyop").run(names, feeds)
    portable = ot.prepare(model, portable=True)
    assert not any(n.domain == "com.microsoft" for n in portable.graph.node)
    want = ot.InferenceSession(portable).run(names, feeds)
    for a, b in zip(got, want):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_a_gelu_whose_intermediate_is_read_elsewhere_stays():
    nodes, inits = _exported("gelu")
    erf = next(n for n in nodes if n.op_type == "Erf")
    nodes.append(helper.make_node("Add", ["y", erf.output[0]], ["z"]))
    feeds = {"x": np.zeros((3, 4), np.float32)}
    model = gradient_model(nodes, feeds, "z", ["0.weight"], opset=17, initializers=inits)
    assert "Erf" in [n.op_type for n in fuse_gelu(model).graph.node]


def test_an_inference_model_is_left_as_it_is():
    nodes, inits = _exported("gelu")
    graph = helper.make_graph(nodes, "g", [helper.make_tensor_value_info("x", 1, [3, 4])],
                              [helper.make_tensor_value_info("y", 1, None)],
                              [onnx.numpy_helper.from_array(v, k) for k, v in inits.items()])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    assert [n.op_type for n in fuse_gelu(model).graph.node] == [n.op_type for n in nodes]
