"""Models people train, exported by torch.onnx.export (both exporters), against torch.

For each architecture of :mod:`real_models` and each exporter:

* the expanded Gradient of the loss equals torch autograd on every parameter (float32,
  max |ours - torch| <= 1e-4 * max |torch| per tensor);
* one TrainingSession step with Adam and with Momentum equals the same torch.optim step:
  every new parameter within 1e-4 of the tensor's largest update (5e-4 for Adam, whose
  division by sqrt(v) magnifies the gradients' float32 rounding) plus 4 float32 ulps.

Where an exporter itself fails on a model, the case is skipped with the exporter's error
(:data:`EXPORTER_FAILURES` lists the known ones).
"""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from gradient_utils import DOMAIN, runnable, session  # noqa: E402
from real_models import EXPORTERS, ZOO, build, export, parameter_map  # noqa: E402

from onnx_training_ops import Adam, Momentum, TrainingSession, build_training_model  # noqa: E402
from onnx_training_ops.passes.split_sequences import split_sequences  # noqa: E402

# exporter failures that are the exporter's own (not ours): (model, exporter) -> reason
EXPORTER_FAILURES = {
    ("t5", "dynamo"): "torch.export cannot decompose T5's relative-position bucketing",
}
_CACHE: dict = {}


def _exported(name: str, exporter: str):
    key = (name, exporter)
    if key not in _CACHE:
        module, inputs = build(name)
        try:
            model = export(module, inputs, exporter)
        except Exception as error:  # noqa: BLE001  the exporter's own failure
            _CACHE[key] = error
        else:
            state = {k: v.clone() for k, v in module.state_dict().items()}
            _CACHE[key] = (module, inputs, model, parameter_map(model, module), state)
    value = _CACHE[key]
    if isinstance(value, Exception):
        pytest.skip(f"{exporter} exporter fails on {name}: {type(value).__name__}: "
                    f"{str(value).splitlines()[0][:200]}")
    module, inputs, model, pmap, state = value
    module.load_state_dict(state)  # a previous test's optimizer step moved the weights
    return module, inputs, model, pmap


def _targets(name: str, module, inputs) -> dict[str, np.ndarray]:
    entry = ZOO[name]
    with torch.no_grad():
        out = module(*inputs.values())
    rng = np.random.default_rng(0)
    if entry.loss == "cross_entropy":
        return {"labels": rng.integers(0, entry.classes, out.shape[0]).astype(np.int64)}
    return {"target": rng.standard_normal(tuple(out.shape)).astype(np.float32)}


def _torch_loss(name: str, out, targets):
    if ZOO[name].loss == "cross_entropy":
        return torch.nn.functional.cross_entropy(out, torch.from_numpy(targets["labels"]))
    return torch.nn.functional.mse_loss(out, torch.from_numpy(targets["target"]))


def _torch_grads(name, module, inputs, targets) -> tuple[float, dict[str, np.ndarray]]:
    module.zero_grad()
    loss = _torch_loss(name, module(*inputs.values()), targets)
    loss.backward()
    return float(loss.detach()), {n: p.grad.numpy().copy() for n, p in module.named_parameters()
                         if p.grad is not None}


def _with_loss_and_gradient(model: onnx.ModelProto, name: str, params: list[str]):
    m = onnx.ModelProto()
    m.CopyFrom(model)
    out = m.graph.output[0].name
    g = m.graph
    if ZOO[name].loss == "cross_entropy":
        g.input.append(helper.make_tensor_value_info("labels", TensorProto.INT64, ["N"]))
        g.node.append(helper.make_node("SoftmaxCrossEntropyLoss", [out, "labels"], ["loss"]))
    else:
        target = onnx.ValueInfoProto()
        target.CopyFrom(m.graph.output[0])
        target.name = "target"
        g.input.append(target)
        g.node.extend([helper.make_node("Sub", [out, "target"], ["diff"]),
                       helper.make_node("Mul", ["diff", "diff"], ["sq"]),
                       helper.make_node("ReduceMean", ["sq"], ["loss"], keepdims=0)])
    outs = [f"grad/{p}" for p in params]
    g.node.append(helper.make_node("Gradient", params, outs, domain=DOMAIN, xs=params, y="loss"))
    del g.output[:]
    g.output.extend([onnx.ValueInfoProto(name=n) for n in ["loss"] + outs])
    m.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return m


def _feeds(inputs, targets, model) -> dict[str, np.ndarray]:
    wanted = {i.name for i in model.graph.input}
    feeds = {k: v.numpy() for k, v in inputs.items() if k in wanted}
    feeds.update(targets)
    return feeds


def _ours_per_torch_param(pmap, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
    """Sum ONNX tensors mapped to one torch parameter (tied or transposed copies)."""
    out: dict[str, np.ndarray] = {}
    for onnx_name, (torch_name, transposed) in pmap.items():
        v = values[onnx_name].T if transposed else values[onnx_name]
        out[torch_name] = out[torch_name] + v if torch_name in out else v
    return out


CASES = [(n, e) for n in ZOO for e in EXPORTERS]


@pytest.mark.parametrize("name,exporter", CASES)
def test_gradients_match_torch_autograd(name, exporter):
    if (name, exporter) in EXPORTER_FAILURES:
        pytest.skip(EXPORTER_FAILURES[(name, exporter)])
    module, inputs, model, pmap = _exported(name, exporter)
    targets = _targets(name, module, inputs)
    want_loss, want = _torch_grads(name, module, inputs, targets)
    params = [p for p, (t, _) in pmap.items() if t in want]
    missing = set(want) - {pmap[p][0] for p in params}
    assert not missing, f"torch parameters not among the initializers: {sorted(missing)}"
    expanded = runnable(split_sequences(_with_loss_and_gradient(model, name, params)))
    names = ["loss"] + [f"grad/{p}" for p in params]
    got = dict(zip(names, session(expanded).run(names, _feeds(inputs, targets, model))))
    np.testing.assert_allclose(got["loss"], want_loss, rtol=1e-5)
    ours = _ours_per_torch_param({p: pmap[p] for p in params},
                                 {p: got[f"grad/{p}"] for p in params})
    # per tensor, relative to its largest entry; a tensor whose exact gradient is zero (an
    # attention key bias: softmax ignores a constant shift) is compared with the model's
    # largest gradient instead
    largest = max(float(np.abs(g).max()) for g in want.values())
    for torch_name, g in want.items():
        scale = max(float(np.abs(g).max()), 1e-3 * largest)
        err = float(np.abs(ours[torch_name] - g).max()) / scale
        assert err <= 1e-4, f"{torch_name}: max rel err {err:.2e}"


@pytest.mark.parametrize("optimizer", ["adam", "momentum"])
@pytest.mark.parametrize("name,exporter", CASES)
def test_one_training_step_matches_torch_optim(name, exporter, optimizer):
    if (name, exporter) in EXPORTER_FAILURES:
        pytest.skip(EXPORTER_FAILURES[(name, exporter)])
    module, inputs, model, pmap = _exported(name, exporter)
    targets = _targets(name, module, inputs)
    _, want = _torch_grads(name, module, inputs, targets)
    trainable = [p for p, (t, _) in pmap.items() if t in want]
    largest = max(float(np.abs(g).max()) for g in want.values())
    if optimizer == "adam":  # eps=0: the one setting where ONNX's and torch's Adam agree
        ours_opt, torch_opt = Adam(lr=1e-2, eps=0.0), lambda ps: torch.optim.Adam(ps, lr=1e-2, eps=0)
    else:
        ours_opt = Momentum(lr=0.1, momentum=0.9)
        torch_opt = lambda ps: torch.optim.SGD(ps, lr=0.1, momentum=0.9)  # noqa: E731
    training = build_training_model(model, ZOO[name].loss, ours_opt, trainable=trainable)
    ts = TrainingSession(training)
    ts.step(_feeds(inputs, targets, model))
    after = ts.state_dict()

    params = dict(module.named_parameters())
    start = {n: p.detach().numpy().copy() for n, p in params.items()}
    opt = torch_opt([params[n] for n in want])
    opt.zero_grad()
    _torch_loss(name, module(*inputs.values()), targets).backward()
    opt.step()
    # the new parameters, element by element: within 1e-4 (Momentum; 5e-4 for Adam, whose
    # division by sqrt(v) magnifies the rounding of small gradients) of the tensor's largest
    # update, plus 4 float32 ulps of the parameter (both sides round the new value)
    tolerance = 5e-4 if optimizer == "adam" else 1e-4
    ulp = 4 * np.finfo(np.float32).eps
    for onnx_name in trainable:
        torch_name, transposed = pmap[onnx_name]
        theirs = params[torch_name].detach().numpy()
        theirs = theirs.T if transposed else theirs
        update = theirs - (start[torch_name].T if transposed else start[torch_name])
        ours = after[onnx_name]
        g = want[torch_name].T if transposed else want[torch_name]
        meaningful = np.ones(g.shape, bool)
        if optimizer == "adam":
            # Adam's first step is lr * g / |g|: an element whose exact gradient is 0 (unused
            # embedding rows: 0/0; an attention key bias: rounding noise) says nothing
            meaningful = np.abs(g) > 1e-4 * largest
            if not meaningful.any():
                continue
        scale = float(np.abs(update[meaningful]).max())
        excess = np.abs(ours - theirs) - ulp * np.abs(theirs)
        err = float(excess[meaningful].max()) / max(scale, 1e-30)
        assert err <= tolerance, f"{onnx_name} ({torch_name}): new value off by {err:.2e} of the update"


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_resnet_train_mode_step_matches_torch_including_running_statistics(exporter):
    """mode="train": batch statistics in the step, running statistics updated as torch's
    model.train() does (3 SGD-momentum steps)."""
    module, inputs, model, pmap = _exported("resnet", exporter)
    targets = _targets("resnet", module, inputs)
    training = build_training_model(model, "cross_entropy", Momentum(lr=0.1, momentum=0.9),
                                    trainable=list(pmap), mode="train")
    ts = TrainingSession(training)
    opt = torch.optim.SGD(module.parameters(), lr=0.1, momentum=0.9)
    module.train()
    for _ in range(3):
        got = ts.step(_feeds(inputs, targets, model))
        opt.zero_grad()
        loss = _torch_loss("resnet", module(*inputs.values()), targets)
        loss.backward()
        opt.step()
        np.testing.assert_allclose(got["loss"], float(loss.detach()), rtol=1e-4)
    module.eval()
    state = ts.state_dict()
    buffers = {n: b.numpy() for n, b in module.named_buffers() if "running" in n}
    assert set(buffers) <= set(state), "the running statistics are state (kept names)"
    for name, value in buffers.items():
        np.testing.assert_allclose(state[name], value, rtol=1e-4, atol=1e-5, err_msg=name)
    for onnx_name, (torch_name, transposed) in pmap.items():
        want = dict(module.named_parameters())[torch_name].detach().numpy()
        np.testing.assert_allclose(state[onnx_name], want.T if transposed else want,
                                   rtol=1e-4, atol=1e-5, err_msg=torch_name)
