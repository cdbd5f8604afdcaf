"""Friction items of issue 29 (core D): each a one-line error or warning that says what to do,
instead of onnxruntime's error from deep in the graph, a silent no-op or a silent pause."""

from __future__ import annotations

import io
import subprocess
import sys
import warnings

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

import onnx_training_ops as ot
from onnx_training_ops import schedules as S
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.kernels import compile_notice

VOCAB, HIDDEN = 11, 4


def _embedding_model() -> onnx.ModelProto:
    """ids [batch, seq] -> Gather(table) * mask [batch, seq, 1] -> mean over seq -> Gemm -> logits."""
    rng = np.random.default_rng(0)
    nodes = [
        helper.make_node("Gather", ["table", "input_ids"], ["emb"], name="embed"),
        helper.make_node("Cast", ["attention_mask"], ["maskf"], to=TensorProto.FLOAT),
        helper.make_node("Unsqueeze", ["maskf", "axis2"], ["mask3"]),
        helper.make_node("Mul", ["emb", "mask3"], ["masked"], name="node_mul_14"),
        helper.make_node("ReduceMean", ["masked", "axis1"], ["pooled"], keepdims=0),
        helper.make_node("Gemm", ["pooled", "W", "b"], ["logits"]),
    ]
    inits = [numpy_helper.from_array(rng.standard_normal((VOCAB, HIDDEN)).astype(np.float32), "table"),
             numpy_helper.from_array(rng.standard_normal((HIDDEN, 3)).astype(np.float32), "W"),
             numpy_helper.from_array(np.zeros(3, np.float32), "b"),
             numpy_helper.from_array(np.array([2], np.int64), "axis2"),
             numpy_helper.from_array(np.array([1], np.int64), "axis1")]
    graph = helper.make_graph(
        nodes, "emb",
        [helper.make_tensor_value_info("input_ids", TensorProto.INT64, ["batch", "sequence"]),
         helper.make_tensor_value_info("attention_mask", TensorProto.INT64, ["batch", "sequence"])],
        [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["batch", 3])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 18)])
    model.ir_version = 8
    return model


@pytest.fixture(scope="module")
def session():
    return ot.TrainingSession(ot.build_training_model(_embedding_model(), "cross_entropy", ot.Adam()))


def _feeds(ids=None, mask=None):
    ids = np.arange(8).reshape(2, 4) % VOCAB if ids is None else ids
    return {"input_ids": ids, "attention_mask": np.ones(ids.shape, np.int64) if mask is None else mask,
            "labels": np.array([0, 2])}


@pytest.mark.parametrize("where", ["step", "evaluate", "backward", "run"])
def test_attention_mask_of_another_length_is_named(session, where):
    feeds = _feeds(mask=np.ones((2, 3), np.int64))
    with pytest.raises(ot.TrainingOpError, match=r"feed 'input_ids' has 4 at axis 1 but feed 'attention_mask' has 3|"
                                                 r"feed 'attention_mask' has 3 at axis 1 but feed 'input_ids' has 4") \
            as info:
        if where == "run":
            session.run(["logits"], {k: v for k, v in feeds.items() if k != "labels"})
        else:
            getattr(session, where)(feeds)
    assert "'sequence'" in str(info.value) and str(info.value).startswith(where)


@pytest.mark.parametrize("bad", [VOCAB, 100, -VOCAB - 1])
def test_token_id_past_the_vocabulary_is_named(session, bad):
    ids = np.arange(8).reshape(2, 4) % VOCAB
    ids[1, 2] = bad
    before = session.state_dict()["table"].copy()
    with pytest.raises(ot.TrainingOpError, match=rf"step: feed 'input_ids' holds {bad} at \[1, 2\], but it indexes "
                                                 rf"the {VOCAB} rows of 'table' \(Gather node 'embed'\)"):
        session.step(_feeds(ids))
    np.testing.assert_array_equal(session.state_dict()["table"], before)  # nothing changed
    session.step(_feeds())  # a good batch still trains


def test_a_real_bert_export_gets_the_named_errors():
    torch = pytest.importorskip("torch")
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    config = transformers.BertConfig(vocab_size=30, hidden_size=8, num_hidden_layers=1, num_attention_heads=2,
                                     intermediate_size=16, max_position_embeddings=16, num_labels=2)
    model = transformers.BertForSequenceClassification(config).eval()
    ids = torch.randint(1, 30, (2, 6))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(model, (ids, torch.ones_like(ids)), f, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["input_ids", "attention_mask"],
                          output_names=["logits"], dynamic_axes={n: {0: "batch", 1: "sequence"}
                                                                 for n in ("input_ids", "attention_mask")})
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        s = ot.TrainingSession(ot.build_training_model(onnx.load_from_string(f.getvalue()), "cross_entropy",
                                                       ot.Adam()))
    good = {"input_ids": ids.numpy(), "attention_mask": np.ones((2, 6), np.int64), "labels": np.array([0, 1])}
    s.step(good)
    with pytest.raises(ot.TrainingOpError, match="feed 'attention_mask' has 5 at axis 1 but feed 'input_ids' has 6"):
        s.step({**good, "attention_mask": np.ones((2, 5), np.int64)})
    bad = good["input_ids"].copy()
    bad[0, 0] = 30
    with pytest.raises(ot.TrainingOpError, match=r"feed 'input_ids' holds 30 at \[0, 0\].*30 rows of "
                                                 r"'bert.embeddings.word_embeddings.weight'"):
        s.step({**good, "input_ids": bad})


def test_mode_train_without_dropout_or_batchnorm_warns():
    with pytest.warns(UserWarning, match=r"mode='train' changes nothing for this model: it holds no Dropout or "
                                         r"BatchNormalization.*model.train\(\)"):
        ot.build_training_model(make_mlp(sizes=(6, 8, 4)), "cross_entropy", ot.Adam(), mode="train")


def test_mode_train_with_dropout_does_not_warn():
    model = make_mlp(sizes=(6, 8, 4))
    relu = next(n for n in model.graph.node if n.op_type == "Relu")
    out = relu.output[0]
    relu.output[0] = "pre_dropout"
    model.graph.node.insert(list(model.graph.node).index(relu) + 1,
                            helper.make_node("Dropout", ["pre_dropout"], [out]))
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ot.build_training_model(model, "cross_entropy", ot.Adam(), mode="train")


@pytest.mark.parametrize("make", [lambda: S.WarmupLinearLR(warmup_steps=100, total_steps=10),
                                  lambda: S.WarmupCosineLR(warmup_steps=100, total_steps=10),
                                  lambda: S.OneCycleLR(max_lr=0.1, total_steps=10, pct_start=0.7, three_phase=True)])
def test_inconsistent_schedules_refused(make):
    with pytest.raises(ot.TrainingOpError, match=r"warmup_steps <= total_steps|pct_start <= 0.5"):
        make()


def test_consistent_schedules_still_accepted():
    full = S.WarmupLinearLR(warmup_steps=10, total_steps=10)  # warm-up to the end, as transformers allows
    assert full.lr(1.0, 9) == 0.9 and full.lr(1.0, 10) == 0.0
    S.WarmupCosineLR(warmup_steps=0, total_steps=10)
    S.OneCycleLR(max_lr=0.1, total_steps=10, pct_start=0.5, three_phase=True)
    swapped = S.WarmupLinearLR(warmup_steps=10, total_steps=3, allow_warmup_past_total=True)  # onnxruntime-training's
    assert swapped.lr(1.0, 5) == 0.5 and swapped.lr(1.0, 10) == 0.0
    text = S.to_json(swapped, 4)
    assert S.from_json(text) == (swapped, 4)
    assert "allow_warmup_past_total" not in S.to_json(S.WarmupLinearLR(1, 3), 0)  # the default is not written


@pytest.mark.parametrize("loss", ["cross_entropy", "mse"])
def test_sixteen_bit_models_say_what_to_do(loss):
    with pytest.raises(ot.TrainingOpError, match=r"output 'logits' is float16 .*export the model in float32.*"
                                                 r"precision='fp16' or 'bf16'"):
        ot.build_training_model(make_mlp(sizes=(6, 8, 4), dtype=np.float16), loss, ot.Adam())


def test_sixteen_bit_weights_behind_a_float_output():
    model = make_mlp(sizes=(6, 8, 4), dtype=np.float16)
    out = model.graph.output[0]
    last = next(n for n in model.graph.node if out.name in n.output)
    last.output[0] = "logits16"
    model.graph.node.append(helper.make_node("Cast", ["logits16"], [out.name], to=TensorProto.FLOAT))
    model.graph.input[0].type.tensor_type.elem_type = TensorProto.FLOAT16
    out.type.tensor_type.elem_type = TensorProto.FLOAT
    with pytest.raises(ot.TrainingOpError,
                       match="weights are float16/bfloat16: .*build with precision='fp16' or 'bf16'"):
        ot.build_training_model(model, "cross_entropy", ot.Adam())


def test_a_numba_compile_is_announced_once(monkeypatch, capsys):
    import numba

    monkeypatch.setattr(compile_notice, "_announced", False)

    @numba.njit(cache=False)
    def twice(x):
        return 2 * x

    with compile_notice.announce_compiles():
        twice(1)
        twice(1.5)  # a second compile: still one line
    with compile_notice.announce_compiles():
        numba.njit(cache=False)(lambda x: x + 1)(1)
    assert capsys.readouterr().err.count(compile_notice.MESSAGE) == 1


def test_no_announcement_without_a_compile(monkeypatch, capsys):
    """Kernels already in memory (or loaded from numba's disk cache: no compiler pass runs)."""
    ot.TrainingSession(ot.build_training_model(make_mlp(sizes=(6, 8, 4)), "cross_entropy", ot.Adam()))
    capsys.readouterr()
    monkeypatch.setattr(compile_notice, "_announced", False)
    ot.TrainingSession(ot.build_training_model(make_mlp(sizes=(6, 8, 4)), "cross_entropy", ot.Adam()))
    assert compile_notice.MESSAGE not in capsys.readouterr().err


def test_a_compile_on_the_first_step_is_announced(monkeypatch, capsys):
    """A kernel the first step compiles on first use (here the label check, made fresh so that
    numba really compiles it): the same one line, on the first step only; a first step that
    compiles nothing stays silent."""
    import numba

    from onnx_training_ops.training.inputs import checks

    def build():
        return ot.TrainingSession(ot.build_training_model(make_mlp(sizes=(6, 8, 4)), "cross_entropy", ot.Adam()))

    feeds = {"input": np.ones((3, 6), np.float32), "labels": np.array([0, 1, 3])}
    session = build()
    monkeypatch.setattr(compile_notice, "_announced", False)
    capsys.readouterr()
    session.step(feeds)  # its kernels are in memory: nothing compiles, nothing said
    assert compile_notice.MESSAGE not in capsys.readouterr().err

    session = build()
    kernel = checks._in_range.py_func
    monkeypatch.setattr(checks, "_in_range", numba.njit(cache=False)(kernel))
    session.step(feeds)
    assert capsys.readouterr().err.count(compile_notice.MESSAGE) == 1
    monkeypatch.setattr(compile_notice, "_announced", False)
    monkeypatch.setattr(checks, "_in_range", numba.njit(cache=False)(kernel))
    session.step(feeds)  # later steps are not watched: no listener per step
    assert compile_notice.MESSAGE not in capsys.readouterr().err
    session.evaluate(feeds)  # the first evaluate is, and compiles nothing new
    assert compile_notice.MESSAGE not in capsys.readouterr().err


def test_a_cache_load_is_silent_in_a_fresh_process():
    """A fresh process whose kernels come from numba's disk cache (this suite has compiled them
    by now, into the same cache) prints nothing; only a real compile would."""
    ot.TrainingSession(ot.build_training_model(make_mlp(sizes=(6, 8, 4)), "cross_entropy", ot.Adam()))
    code = ("import onnx_training_ops as ot; from onnx_training_ops.demo import make_mlp; "
            "ot.TrainingSession(ot.build_training_model(make_mlp(sizes=(6, 8, 4)), 'cross_entropy', ot.Adam()))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    if "numba cannot cache" in done.stderr:
        pytest.skip("numba has no writable cache directory here: every process compiles (and says so)")
    assert compile_notice.MESSAGE not in done.stderr
