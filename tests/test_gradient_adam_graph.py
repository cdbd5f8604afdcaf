"""One ONNX graph with the forward pass, a Gradient node and a multi-tensor Adam node,
run in onnx_training_ops.InferenceSession, against torch (autograd, then the ONNX Adam formula)."""

import numpy as np
import pytest
from onnx import TensorProto
from onnx import helper as h

import onnx_training_ops as ot

torch = pytest.importorskip("torch")

DOMAIN = "ai.onnx.preview.training"
SHAPES = {"W1": (8, 16), "b1": (16,), "W2": (16, 4), "b2": (4,)}
PARAMS = list(SHAPES)
ALPHA, BETA, EPSILON, NORM = 0.9, 0.999, 1e-6, 0.01


def forward_gradient_adam_model():
    f = TensorProto.FLOAT
    nodes = [
        h.make_node("MatMul", ["x", "W1"], ["h1"]),
        h.make_node("Add", ["h1", "b1"], ["h1b"]),
        h.make_node("Relu", ["h1b"], ["a1"]),
        h.make_node("MatMul", ["a1", "W2"], ["h2"]),
        h.make_node("Add", ["h2", "b2"], ["logits"]),
        h.make_node("SoftmaxCrossEntropyLoss", ["logits", "labels"], ["loss"], reduction="mean"),
        h.make_node("Gradient", PARAMS + ["x", "labels"], [f"d{p}" for p in PARAMS], domain=DOMAIN,
                    xs=PARAMS, zs=["x", "labels"], y="loss", name="grad"),
        h.make_node("Adam", ["R", "T", *PARAMS, *[f"d{p}" for p in PARAMS], *[f"V{p}" for p in PARAMS],
                             *[f"H{p}" for p in PARAMS]],
                    [f"{p}_new" for p in PARAMS] + [f"V{p}_new" for p in PARAMS] + [f"H{p}_new" for p in PARAMS],
                    domain=DOMAIN, name="adam", alpha=ALPHA, beta=BETA, epsilon=EPSILON, norm_coefficient=NORM),
    ]
    inputs = [h.make_tensor_value_info("x", f, ["N", 8]), h.make_tensor_value_info("labels", TensorProto.INT64, ["N"]),
              h.make_tensor_value_info("R", f, []), h.make_tensor_value_info("T", TensorProto.INT64, [])]
    for prefix in ("", "V", "H"):
        inputs += [h.make_tensor_value_info(prefix + p, f, SHAPES[p]) for p in PARAMS]
    outputs = [h.make_tensor_value_info("loss", f, [])] + [
        h.make_tensor_value_info(o, f, None) for o in nodes[-1].output
    ]
    graph = h.make_graph(nodes, "forward_gradient_adam", inputs, outputs)
    return h.make_model(graph, opset_imports=[h.make_opsetid("", 17), h.make_opsetid(DOMAIN, 1)])


def onnx_adam_in_torch(x, g, v, hh, r, t):
    """The ONNX Adam pseudo code, in float64 torch, attributes as the model's float32 values."""
    a, b, eps, nc = (float(np.float32(c)) for c in (ALPHA, BETA, EPSILON, NORM))
    g = nc * x + g
    v = a * v + (1 - a) * g
    hh = b * hh + (1 - b) * g * g
    rate = r * np.sqrt(1 - b**t) / (1 - a**t) if t > 0 else r
    return x - rate * v / (hh.sqrt() + eps), v, hh


@pytest.mark.parametrize("t", [0, 5])
def test_one_step_equals_torch_autograd_then_onnx_adam(t):
    rng = np.random.default_rng(t)
    feeds = {p: (rng.standard_normal(s) * 0.3).astype(np.float32) for p, s in SHAPES.items()}
    feeds.update({f"V{p}": (rng.standard_normal(s) * 0.01).astype(np.float32) for p, s in SHAPES.items()})
    feeds.update({f"H{p}": (rng.random(s) * 0.01).astype(np.float32) for p, s in SHAPES.items()})
    feeds.update(x=rng.standard_normal((32, 8)).astype(np.float32), labels=rng.integers(0, 4, 32),
                 R=np.array(0.01, np.float32), T=np.array(t, np.int64))

    outputs = ot.InferenceSession(forward_gradient_adam_model()).run(None, feeds)
    loss, new = outputs[0], dict(zip([f"{p}_new" for p in PARAMS] + [f"V{p}_new" for p in PARAMS]
                                     + [f"H{p}_new" for p in PARAMS], outputs[1:]))

    params = {p: torch.tensor(feeds[p], dtype=torch.float64, requires_grad=True) for p in PARAMS}
    x = torch.tensor(feeds["x"], dtype=torch.float64)
    logits = torch.relu(x @ params["W1"] + params["b1"]) @ params["W2"] + params["b2"]
    torch_loss = torch.nn.functional.cross_entropy(logits, torch.tensor(feeds["labels"]))
    torch_loss.backward()
    np.testing.assert_allclose(loss, torch_loss.item(), rtol=1e-5)
    for p in PARAMS:
        want_x, want_v, want_h = onnx_adam_in_torch(
            params[p].detach(), params[p].grad, torch.tensor(feeds[f"V{p}"], dtype=torch.float64),
            torch.tensor(feeds[f"H{p}"], dtype=torch.float64), float(feeds["R"]), t,
        )
        assert not np.allclose(new[f"{p}_new"], feeds[p])  # the step moved the parameter
        for got, want in ((new[f"{p}_new"], want_x), (new[f"V{p}_new"], want_v), (new[f"H{p}_new"], want_h)):
            want = want.numpy()
            error = np.linalg.norm(got - want) / np.linalg.norm(want)
            assert error <= 1e-5, (p, error)
