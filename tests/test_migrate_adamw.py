"""OrtAdamW is onnxruntime-training's AdamW kernel, operation for operation.

The fixtures hold, for each of 20 steps, the gradients onnxruntime-training's optimizer
received and the parameters it produced. Replaying those gradients through the standard ops
that :func:`onnx_training_ops.optim.ort_adamw.emit_update` writes (run by onnxruntime) gives its
moments bit for bit (they equal the checkpoint's ``momentum0``/``momentum1`` after 10 steps)
and its parameters to an ulp of X plus 2^-20 of the update: its CPU kernel takes the square
root of the second moment with Eigen's fast-math ``psqrt`` (the CPU's ``rsqrtps`` approximation
and one Newton step) on each whole group of 4 elements, exact ``sqrt`` on the rest; that approximation
differs between CPU makers, so no portable graph reproduces it (with it, replayed outside, every bit matched on this
machine: see docs/migrating.md). Adam mode 1 without and with weight decay, and adam_mode 0.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper
from ortt_fixtures import ORTT, trajectory

from onnx_training_ops import Momentum
from onnx_training_ops.builder.ops import Ops
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.migrate import OrtAdamW, read_checkpoint
from onnx_training_ops.migrate.artifacts import read_optimizer
from onnx_training_ops.optim.ort_adamw import emit_update


def _update_session(opt: OrtAdamW, shapes: dict[str, tuple[int, ...]]) -> ort.InferenceSession:
    names = list(shapes)
    nodes: list[onnx.NodeProto] = []
    taken: set[str] = set()

    def unique(base: str) -> str:
        name, k = base, 0
        while name in taken:
            k, name = k + 1, f"{base}_{k}"
        taken.add(name)
        return name

    states = {s: [f"{n}.{s}" for n in names] for s in ("V", "H")}
    new_states = {s: [f"{n}.{s}.new" for n in names] for s in ("V", "H")}
    emit_update(Ops(unique, nodes, "adamw"), opt, "R", "T", names, [f"{n}.grad" for n in names], states,
                [f"{n}.new" for n in names], new_states, [np.float32] * len(names))

    def vi(name, shape, elem=TensorProto.FLOAT):
        return helper.make_tensor_value_info(name, elem, shape)

    inputs = [vi("R", []), vi("T", [], TensorProto.INT64)]
    inputs += [vi(f"{n}{suffix}", shapes[n]) for suffix in ("", ".grad", ".V", ".H") for n in names]
    outputs = [vi(f"{n}{suffix}", shapes[n]) for suffix in (".new", ".V.new", ".H.new") for n in names]
    model = helper.make_model(helper.make_graph(nodes, "adamw", inputs, outputs),
                              opset_imports=[helper.make_opsetid("", 17)], ir_version=8)
    onnx.checker.check_model(model, full_check=True)
    return ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])


@pytest.mark.parametrize("case", ["mlp", "mlp_wd", "mlp_torch"])
def test_replaying_their_gradients_gives_their_moments_exactly_and_their_parameters_to_rounding(case):
    t = trajectory(case)
    model = onnx.load(str(ORTT / case / "optimizer_model.onnx"))
    opt = read_optimizer(model, case, float(t["lr"]))
    assert (opt.mode, opt.weight_decay) == {"mlp": (1, 0.0), "mlp_wd": (1, np.float32(0.1)),
                                           "mlp_torch": (0, np.float32(0.1))}[case]
    names = [str(n) for n in t["trainable"]]
    session = _update_session(opt, {n: t[f"p/{n}"].shape[1:] for n in names})
    v = {n: np.zeros_like(t[f"p/{n}"][0]) for n in names}
    h = {n: np.zeros_like(t[f"p/{n}"][0]) for n in names}
    differing = total = 0
    for step in range(20):
        feeds = {"R": np.array(t["lr"], np.float32), "T": np.array(step + 1, np.int64)}
        for n in names:  # from their parameters each step: one step's difference, not compounded
            feeds.update({n: t[f"p/{n}"][step], f"{n}.grad": t[f"g/{n}"][step], f"{n}.V": v[n], f"{n}.H": h[n]})
        out = dict(zip([o.name for o in session.get_outputs()], session.run(None, feeds)))
        for n in names:
            v[n], h[n] = out[f"{n}.V.new"], out[f"{n}.H.new"]
            theirs = t[f"p/{n}"][step + 1]
            # their sqrt is off by <= 2 ulp: the update by ~2^-22 of itself, then rounded into X
            update = np.abs(theirs - t[f"p/{n}"][step])
            bound = np.spacing(np.abs(theirs)) + update * 2.0 ** -20
            assert np.all(np.abs(out[f"{n}.new"] - theirs) <= bound), (case, step, n)
            differing += int(np.count_nonzero(out[f"{n}.new"] != theirs))
            total += theirs.size
        if step + 1 == 10:
            groups = read_checkpoint(ORTT / case / "checkpoint_10").optimizer_groups
            for n in names:
                assert np.array_equal(v[n], groups[0].moments[n]["momentum0"]), n
                assert np.array_equal(h[n], groups[0].moments[n]["momentum1"]), n
    assert differing < 0.05 * total  # measured: 115 of 4240 element updates (mlp), the sqrt's doing


def test_the_node_attributes_map_to_ortadamw_and_kernel_defaults_fill_the_gaps():
    node = helper.make_node("AdamWOptimizer", ["a"] * 6, ["f"], domain="com.microsoft", alpha=0.8,
                            adam_mode=1)
    model = helper.make_model(helper.make_graph([node], "g", [], []))
    opt = read_optimizer(model, "optim.onnx", 0.5)
    assert opt == OrtAdamW(lr=0.5, betas=(float(np.float32(0.8)), 0.999), eps=1e-8, weight_decay=0.0, mode=1)


@pytest.mark.parametrize("kwargs, message", [
    ({"mode": 2}, "mode (adam_mode) must be 0 or 1"),
    ({"mode": 0, "bias_correction": False}, "requires bias_correction=True"),
    ({"betas": (0.9, 1.0)}, "betas must be two numbers in [0, 1)"),
    ({"eps": -1.0}, "eps must be finite and >= 0"),
])
def test_bad_hyper_parameters_are_named(kwargs, message):
    with pytest.raises(TrainingOpError, match=message.replace("(", r"\(").replace(")", r"\)")
                       .replace("[", r"\[")):
        OrtAdamW(**kwargs)


def test_an_optimizer_model_of_another_op_is_refused_with_what_it_holds():
    node = helper.make_node("LambOptimizer", ["a"] * 3, ["f"], domain="com.microsoft")
    model = helper.make_model(helper.make_graph([node], "g", [], []))
    with pytest.raises(TrainingOpError, match=r"optim\.onnx: expected one com\.microsoft::AdamWOptimizer"
                                              r" or SGDOptimizerV2 .*found com\.microsoft::LambOptimizer"):
        read_optimizer(model, "optim.onnx", 0.1)


def test_their_sgd_is_momentum_zero_and_replays_bit_for_bit():
    """SGDOptimizerV2 computes ``w + (-lr) * g``; ONNX Momentum(alpha=0, beta=1) ``X - R * G``."""
    t = trajectory("mlp_sgd")
    opt = read_optimizer(onnx.load(str(ORTT / "mlp_sgd" / "optimizer_model.onnx")), "sgd", float(t["lr"]))
    assert opt == Momentum(lr=float(t["lr"]), momentum=0.0)
    from onnx_training_ops.optim.momentum import momentum
    for n in t["trainable"]:
        for step in range(20):
            x, g = t[f"p/{n}"][step], t[f"g/{n}"][step]
            (x_new, _) = momentum(np.float32(t["lr"]), np.int64(step), x, g, np.zeros_like(x),
                                  **opt.attributes())
            assert np.array_equal(x_new, t[f"p/{n}"][step + 1]), (n, step)
