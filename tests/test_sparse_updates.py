"""Sparse/lazy updates of embedding tables against independent references: torch SparseAdam
with ``nn.Embedding(sparse=True)``, and the seeds' formulas (TF ``_apply_sparse_shared``,
mxRec ``lazy_adam``, ``sparse_apply_adagrad``, ``sparse_apply_momentum``, torch RMSprop on
rows) as float64 numpy loops — duplicate indices, negative indices and never-touched rows
included; validity, checkpoints and the fast path."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from onnx_training_ops import Adagrad, Adam, Momentum, RMSProp, TrainingSession, build_training_model
from onnx_training_ops.builder.model_metadata import metadata
from onnx_training_ops.errors import TrainingOpError

N, D, B, K = 40, 4, 6, 3  # rows, width, batch, lookups per example
STEPS = 30


def emb_model(dtype=np.float64, seed=0, extra_reader: str | None = None) -> onnx.ModelProto:
    """y = (sum_k E[ids[:, k]]) @ W: one Gather of the table E."""
    rng = np.random.default_rng(seed)
    tt = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes = [helper.make_node("Gather", ["E", "ids"], ["e"], axis=0, name="lookup"),
             helper.make_node("ReduceSum", ["e", "axis1"], ["s"], keepdims=0),
             helper.make_node("MatMul", ["s", "W"], ["y"])]
    if extra_reader:
        nodes.append(helper.make_node(extra_reader, ["E"], ["E_t"], name="extra"))
    outputs = [helper.make_tensor_value_info("y", tt, ["B", 1])]
    if extra_reader:
        outputs.append(helper.make_tensor_value_info("E_t", tt, None))
    graph = helper.make_graph(
        nodes, "emb", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", K])], outputs,
        [numpy_helper.from_array(rng.standard_normal((N, D)).astype(dtype), "E"),
         numpy_helper.from_array(rng.standard_normal((D, 1)).astype(dtype), "W"),
         numpy_helper.from_array(np.array([1], np.int64), "axis1")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def batches(seed=1, high=N - 10, negative=False):
    """Ids below ``high`` only (rows >= high are never touched), many duplicates."""
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(STEPS):
        ids = rng.integers(0, high, (B, K))
        ids[0, 1] = ids[0, 0]  # a duplicate in every batch
        if negative:
            ids[1, 0] = ids[1, 0] - N  # the same row, counted from the end
        out.append((ids, rng.standard_normal((B, 1))))
    return out


def table_grad(E, W, ids, target):
    """d mean((sum_k E[ids] @ W - target)^2) / dE as (unique rows, summed row gradients)."""
    s = E[ids].sum(axis=1)
    dy = 2.0 * (s @ W - target) / target.size
    ds = dy @ W.T
    flat = np.where(ids < 0, ids + N, ids).reshape(-1)
    rows = np.repeat(ds, K, axis=0)
    unique, inverse = np.unique(flat, return_inverse=True)
    g = np.zeros((len(unique), D))
    np.add.at(g, inverse, rows)
    return unique, g


def run_onnx(optimizer, mode, data, fast=True, dtype=np.float64):
    model = build_training_model(emb_model(dtype), "mse", optimizer, trainable=["E"],
                                 sparse_updates={"E": mode})
    session = TrainingSession(model, fast=fast)
    if mode == "lazy" or not isinstance(optimizer, Adam):  # the fast path updates the rows in place
        program = session._programs.steps[0]
        _, rows, rms = program.analysis.updates  # cut nodes, row updates, RMSProp
        groups = rows.groups + [g for g in rms.groups if g.rows]
        assert len(groups) == int(fast) and all(g.dedup for g in groups)
    for ids, target in data:
        session.step({"ids": ids, "target": target.astype(dtype)})
    return session.state_dict()


def numpy_reference(update, data, n_states):
    """``update(E, states, unique, g, t)`` in place, t = 1-based step, on a float64 copy."""
    init = {t.name: numpy_helper.to_array(t) for t in emb_model().graph.initializer}
    E, W = init["E"].copy(), init["W"]
    states = [np.zeros_like(E) for _ in range(n_states)]
    for t, (ids, target) in enumerate(data, 1):
        unique, g = table_grad(E, W, ids, target)
        update(E, states, unique, g, t)
    return E, states


def lazy_adam(lr, b1, b2, eps):  # mxRec lazy_adam (seed 004)
    def update(E, states, u, g, t):
        m, v = states
        lr_t = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        m[u] = b1 * m[u] + (1 - b1) * g
        v[u] = b2 * v[u] + (1 - b2) * g * g
        E[u] -= lr_t * m[u] / (np.sqrt(v[u]) + eps)
    return update


def tf_sparse_adam(lr, b1, b2, eps, decay=0.0):  # TF Adam._apply_sparse_shared (seed 003)
    def update(E, states, u, g, t):
        m, v = states
        g = g + decay * E[u]  # weight decay on the looked-up rows' gradient values only
        lr_t = lr * np.sqrt(1 - b2**t) / (1 - b1**t)
        m *= b1
        m[u] += g * (1 - b1)
        v *= b2
        v[u] += (g * g) * (1 - b2)
        E -= lr_t * m / (np.sqrt(v) + eps)
    return update


def sparse_adagrad(lr, eps):  # sparse_apply_adagrad, torch's eps placement
    def update(E, states, u, g, t):
        (h,) = states
        h[u] += g * g
        E[u] -= lr * g / (np.sqrt(h[u]) + eps)
    return update


def sparse_momentum(lr, mu):  # sparse_apply_momentum: accum = accum * mu + g; var -= lr * accum
    def update(E, states, u, g, t):
        (v,) = states
        v[u] = v[u] * mu + g
        E[u] -= lr * v[u]
    return update


def lazy_rmsprop(lr, alpha, eps, mu):  # torch RMSprop on the looked-up rows
    def update(E, states, u, g, t):
        sq, buf = states
        sq[u] = alpha * sq[u] + (1 - alpha) * g * g
        buf[u] = mu * buf[u] + g / (np.sqrt(sq[u]) + eps)
        E[u] -= lr * buf[u]
    return update


# attribute values exact in float32 (the domain ops' attributes are float32)
B1, B2, EPS = 0.875, 0.9921875, 2.0**-20
CASES = [
    ("lazy", Adam(lr=0.05, betas=(B1, B2), eps=EPS), lazy_adam(0.05, B1, B2, EPS), ("V", "H")),
    ("sparse", Adam(lr=0.05, betas=(B1, B2), eps=EPS), tf_sparse_adam(0.05, B1, B2, EPS), ("V", "H")),
    ("sparse", Adam(lr=0.05, betas=(B1, B2), eps=EPS, weight_decay=0.125),
     tf_sparse_adam(0.05, B1, B2, EPS, 0.125), ("V", "H")),
    ("lazy", Adagrad(lr=0.1, eps=EPS), sparse_adagrad(0.1, EPS), ("H",)),
    ("sparse", Adagrad(lr=0.1, eps=EPS), sparse_adagrad(0.1, EPS), ("H",)),
    ("lazy", Momentum(lr=0.05, momentum=0.75), sparse_momentum(0.05, 0.75), ("V",)),
    ("lazy", RMSProp(lr=0.01, alpha=0.9, eps=1e-6, momentum=0.5), lazy_rmsprop(0.01, 0.9, 1e-6, 0.5),
     ("square_avg", "momentum_buffer")),
]


@pytest.mark.parametrize("mode,optimizer,reference,states", CASES,
                         ids=[f"{type(c[1]).__name__}-{c[0]}" for c in CASES])
def test_matches_the_seed_formulas(mode, optimizer, reference, states):
    data = batches(negative=True)
    got = run_onnx(optimizer, mode, data)
    E, ref_states = numpy_reference(reference, data, len(states))
    np.testing.assert_allclose(got["E"], E, rtol=1e-10, atol=1e-12)
    for name, value in zip(states, ref_states):
        np.testing.assert_allclose(got[f"E.{name}"], value, rtol=1e-10, atol=1e-12, err_msg=name)
    if mode == "lazy" or not isinstance(optimizer, Adam):  # never-touched rows: exactly as they were
        init = numpy_helper.to_array(next(t for t in emb_model().graph.initializer if t.name == "E"))
        np.testing.assert_array_equal(got["E"][N - 10:], init[N - 10:])
        for name in states:
            assert not got[f"E.{name}"][N - 10:].any()


def test_lazy_adam_matches_torch_sparse_adam():
    torch = pytest.importorskip("torch")
    data = batches()
    got = run_onnx(Adam(lr=0.05, betas=(B1, B2), eps=EPS), "lazy", data)
    init = {t.name: numpy_helper.to_array(t) for t in emb_model().graph.initializer}
    emb = torch.nn.Embedding(N, D, sparse=True).double()
    with torch.no_grad():
        emb.weight.copy_(torch.from_numpy(init["E"].copy()))
    W = torch.from_numpy(init["W"].copy())
    opt = torch.optim.SparseAdam(emb.parameters(), lr=0.05, betas=(B1, B2), eps=EPS)
    for ids, target in data:
        opt.zero_grad()
        y = emb(torch.from_numpy(ids)).sum(1) @ W
        torch.nn.functional.mse_loss(y, torch.from_numpy(target)).backward()
        opt.step()
    np.testing.assert_allclose(got["E"], emb.weight.detach().numpy(), rtol=1e-10, atol=1e-12)
    state = opt.state[emb.weight]
    np.testing.assert_allclose(got["E.V"], state["exp_avg"].numpy(), rtol=1e-10, atol=1e-14)
    np.testing.assert_allclose(got["E.H"], state["exp_avg_sq"].numpy(), rtol=1e-10, atol=1e-14)


def test_sparse_adagrad_is_dense_adagrad_bit_for_bit():
    """Untouched rows have a zero gradient: H + 0 = H and X - 0 = X, so dense == sparse."""
    data = batches()
    dense = build_training_model(emb_model(), "mse", Adagrad(lr=0.1), trainable=["E"])
    session = TrainingSession(dense)
    for ids, target in data:
        session.step({"ids": ids, "target": target})
    lazy = run_onnx(Adagrad(lr=0.1), "lazy", data)
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(lazy[name], value, err_msg=name)


FAST_CASES = [("lazy", Adam(lr=0.05, weight_decay=0.01, post_weight_decay=0.001)), ("sparse", Adam(lr=0.05)),
              ("lazy", Adagrad(lr=0.1, lr_decay=0.01, weight_decay=0.01)),
              ("lazy", Momentum(lr=0.05, momentum=0.8, dampening=0.1)),
              ("lazy", Momentum(lr=0.05, momentum=0.8, nesterov=True)),
              ("lazy", RMSProp(lr=0.01, momentum=0.5, centered=True, weight_decay=0.01)),
              ("sparse", RMSProp(lr=0.01))]


@pytest.mark.parametrize("mode,optimizer", FAST_CASES, ids=[f"{type(o).__name__}-{m}" for m, o in FAST_CASES])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_fast_path_equals_graph_path(mode, optimizer, dtype):
    """The fused row drivers (in place on the touched rows) give the graph path's bits."""
    data = batches()[:8]
    fast = run_onnx(optimizer, mode, data, fast=True, dtype=dtype)
    graph = run_onnx(optimizer, mode, data, fast=False, dtype=dtype)
    for name, value in graph.items():
        np.testing.assert_array_equal(fast[name], value, err_msg=name)


def test_valid_onnx_save_reload_resume_bit_exact(tmp_path):
    model = build_training_model(emb_model(np.float32), "mse", Adam(lr=0.01), sparse_updates={"E*": "lazy"})
    onnx.checker.check_model(model, full_check=True)
    assert metadata(model)["sparse_updates"] == '{"E": "lazy"}'
    data = [(ids, t.astype(np.float32)) for ids, t in batches()]
    session = TrainingSession(model)
    for ids, target in data[:5]:
        session.step({"ids": ids, "target": target})
    path = str(tmp_path / "emb.onnx")
    session.save(path)
    reloaded = onnx.load(path)
    onnx.checker.check_model(reloaded, full_check=True)
    resumed = TrainingSession(reloaded)
    for ids, target in data[5:12]:
        session.step({"ids": ids, "target": target})
        resumed.step({"ids": ids, "target": target})
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(resumed.state_dict()[name], value, err_msg=name)


def test_only_gather_tables_and_known_modes():
    with pytest.raises(TrainingOpError, match="read only by Gather"):
        build_training_model(emb_model(extra_reader="Identity"), "mse", Adam(), output="y",
                             sparse_updates={"E": "lazy"})
    with pytest.raises(TrainingOpError, match="one of"):
        build_training_model(emb_model(), "mse", Adam(), sparse_updates={"E": "fast"})
    with pytest.raises(TrainingOpError, match="matches no trainable"):
        build_training_model(emb_model(), "mse", Adam(), sparse_updates={"emb.*": "lazy"})
    dense = build_training_model(emb_model(), "mse", Adam(), sparse_updates={"*": "dense"})
    assert "sparse_updates" not in metadata(dense)


def test_embedding_benchmark_runs(capsys):
    from benchmarks.__main__ import main

    assert main(["embeddings", "--rows", "500", "--dim", "8", "--lookups", "64",
                 "--steps", "3", "--dense-steps", "1"]) == 0
    out = capsys.readouterr().out
    assert "onnx lazy Adam" in out and "lazy vs dense" in out


def two_lookup_model() -> onnx.ModelProto:
    """E read by two Gathers (int64 and int32 ids): one table, its gradient rows from both."""
    rng = np.random.default_rng(2)
    nodes = [helper.make_node("Gather", ["E", "a"], ["ea"], axis=0),
             helper.make_node("Gather", ["E", "b"], ["eb"], axis=0),
             helper.make_node("ReduceSum", ["ea", "axis1"], ["sa"], keepdims=0),
             helper.make_node("ReduceSum", ["eb", "axis1"], ["sb"], keepdims=0),
             helper.make_node("Mul", ["sa", "sb"], ["y"])]
    graph = helper.make_graph(
        nodes, "two", [helper.make_tensor_value_info("a", TensorProto.INT64, ["B", 2]),
                       helper.make_tensor_value_info("b", TensorProto.INT32, ["B", 3])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, ["B", D])],
        [numpy_helper.from_array(rng.standard_normal((N, D)).astype(np.float32), "E"),
         numpy_helper.from_array(np.array([1], np.int64), "axis1")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


@pytest.mark.parametrize("mode", ["eval", "train"])
def test_two_lookups_of_one_table(mode):
    model = build_training_model(two_lookup_model(), "mse", Adam(lr=0.05), sparse_updates={"E": "lazy"},
                                 mode=mode)
    rng = np.random.default_rng(0)
    feeds = [{"a": rng.integers(0, 10, (B, 2)), "b": rng.integers(-N, -N + 10, (B, 3)).astype(np.int32),
              "target": rng.standard_normal((B, D)).astype(np.float32)} for _ in range(4)]
    states = []
    for fast in (True, False):
        session = TrainingSession(model, fast=fast)
        for f in feeds:
            session.step(f)
        states.append(session.state_dict())
    for name, value in states[1].items():
        np.testing.assert_array_equal(states[0][name], value, err_msg=name)
    init = numpy_helper.to_array(two_lookup_model().graph.initializer[0])
    changed = np.flatnonzero((states[0]["E"] != init).any(axis=1))
    assert set(changed) <= set(range(10)) and len(changed) > 5  # b's negative ids are rows 0..9 too
    assert not states[0]["E.V"][10:].any()


@pytest.mark.parametrize("optimizer", [RMSProp(lr=0.01, momentum=0.5), Adam(lr=0.01)],
                         ids=["RMSProp", "Adam"])
def test_batch_size_may_change_between_steps(optimizer):
    """The fast path's row updates read batch-shaped values: not preallocated to the first batch."""
    (i1, t1), (i2, t2) = batches()[:2]
    sessions = [TrainingSession(build_training_model(emb_model(), "mse", optimizer, sparse_updates={"E": "lazy"}),
                                fast=fast) for fast in (True, False)]
    for s in sessions:
        s.step({"ids": i1, "target": t1})
        s.step({"ids": i2[:4], "target": t2[:4]})
    for name, value in sessions[1].state_dict().items():
        np.testing.assert_array_equal(sessions[0].state_dict()[name], value, err_msg=name)
