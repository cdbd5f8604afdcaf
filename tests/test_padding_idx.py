"""``nn.Embedding(padding_idx=k)`` trains as in torch (issue 29): the padding row gets no
gradient from its lookups (AdamW still decays it), with torch's default exporter (dynamo: read
from the node metadata) and the TorchScript exporter (``padding_rows=``). Checked against
torch itself: after a few AdamW steps on batches full of padding ids, every parameter and the
padding row equal torch's."""

from __future__ import annotations

import io
import warnings

import numpy as np
import onnx
import pytest

torch = pytest.importorskip("torch")

import onnx_training_ops as ot  # noqa: E402
from onnx_training_ops.builder.model_metadata import metadata  # noqa: E402
from onnx_training_ops.builder.padding_rows import detect_padding_rows  # noqa: E402

VOCAB, DIM, CLASSES = 12, 6, 3


class Tiny(torch.nn.Module):
    """Two tables with padding rows (0, and -1 = the last row), one tied to the output head."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.tied = tied
        self.words = torch.nn.Embedding(VOCAB, DIM, padding_idx=0)
        self.kinds = torch.nn.Embedding(4, DIM, padding_idx=-1)
        self.hidden = torch.nn.Linear(DIM, DIM)
        self.head = None if tied else torch.nn.Linear(DIM, CLASSES)
        with torch.no_grad():  # torch zeroes a padding row at init; any value stays put (but for decay)
            self.words.weight[0] = torch.randn(DIM)
            self.kinds.weight[3] = torch.randn(DIM)

    def forward(self, ids, kinds):
        h = torch.tanh(self.hidden(self.words(ids) + self.kinds(kinds)))
        if self.tied:  # a language-model head sharing the word table: it gives row 0 a gradient of its own
            return torch.nn.functional.linear(h, self.words.weight).mean(1)[:, :CLASSES]
        return self.head(h.mean(1))


def _export(module, dynamo: bool, names=("ids", "kinds"), **options):
    ids = torch.zeros(2, 5, dtype=torch.int64)
    args = (ids, torch.zeros(2, 5, dtype=torch.int64))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        if dynamo:
            dims = {0: torch.export.Dim("batch"), 1: torch.export.Dim("seq", max=32)}
            torch.onnx.export(module, args[:len(names)], f, input_names=list(names), output_names=["logits"],
                              dynamic_shapes={n: dims for n in names}, verbose=False)
        else:
            torch.onnx.export(module, args[:len(names)], f, input_names=list(names), output_names=["logits"],
                              dynamo=False, dynamic_axes={n: {0: "batch", 1: "seq"} for n in names}, **options)
    return onnx.load_from_string(f.getvalue())


def _batches(rng, steps, vocab=VOCAB):
    for _ in range(steps):
        ids = rng.integers(0, vocab, (3, 5))
        ids[:, -2:] = 0  # padded sequences: the padding id in every batch
        kinds = rng.integers(0, 4, (3, 5))
        kinds[0] = 3
        yield ids, kinds, rng.integers(0, CLASSES, 3)


def _train_both(module, training, steps=4, feeds=("ids", "kinds"), lr=5e-2, eps=1e-12):
    session = ot.TrainingSession(training)
    names = _our_names(module, session.state_dict())
    opt = torch.optim.AdamW(module.parameters(), lr=lr, eps=eps, weight_decay=0.1)
    rng = np.random.default_rng(0)
    for ids, kinds, labels in _batches(rng, steps):
        inputs = dict(zip(feeds, (ids, kinds)))
        ours = session.step({**inputs, "labels": labels})["loss"]
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(module(*(torch.from_numpy(v) for v in inputs.values())),
                                                 torch.from_numpy(labels))
        loss.backward()
        opt.step()
        np.testing.assert_allclose(float(ours), loss.item(), rtol=1e-5, atol=1e-6)
    return session.state_dict(), names


def _our_names(module, initial_state) -> dict[str, tuple[str, bool]]:
    """torch name -> (our trainable, transposed): the TorchScript exporter's default constant
    folding keeps a Linear weight as a transposed constant under a name of its own."""
    out = {}
    for name, p in module.named_parameters():
        value = p.detach().numpy()
        if name in initial_state:
            out[name] = (name, False)
            continue
        found = [k for k, v in initial_state.items() if v.shape == value.T.shape and np.array_equal(v, value.T)]
        assert len(found) == 1, (name, found)
        out[name] = (found[0], True)
    return out


def _assert_parameters(module, state, initial, names, decay_only=("words.weight", "kinds.weight")):
    for name, p in module.named_parameters():
        ours, transposed = names[name]
        np.testing.assert_allclose(state[ours].T if transposed else state[ours], p.detach().numpy(),
                                   rtol=1e-5, atol=1e-6, err_msg=name)
    # the padding rows: weight decay only, exactly as torch's
    for table, row in (("words.weight", 0), ("kinds.weight", 3)):
        torch_row = dict(module.named_parameters())[table].detach().numpy()[row]
        np.testing.assert_allclose(state[table][row], torch_row, rtol=1e-5, err_msg=table)
        if table in decay_only:
            np.testing.assert_allclose(state[table][row], initial[table][row] * (1 - 5e-2 * 0.1) ** 4, rtol=1e-6)


@pytest.mark.parametrize("tied", [False, True], ids=["untied", "tied_head"])
@pytest.mark.parametrize("dynamo", [True, False], ids=["dynamo", "torchscript"])
def test_padding_rows_train_as_in_torch(dynamo, tied):
    torch.manual_seed(0)
    module = Tiny(tied)
    # the TorchScript exporter's constant folding unties a tied weight (a transposed copy): kept tied without it
    model = _export(module, dynamo, **({"do_constant_folding": False} if tied and not dynamo else {}))
    initial = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    padding = None if dynamo else {"words.weight": 0, "kinds.weight": -1}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the dynamo exporter's merged parameters, restored
        training = ot.build_training_model(model, "cross_entropy", ot.AdamW(lr=5e-2, eps=1e-12, weight_decay=0.1),
                                           padding_rows=padding)
    assert metadata(training)["padding_rows"] == '{"kinds.weight": 3, "words.weight": 0}'
    state, names = _train_both(module, training)
    _assert_parameters(module, state, initial, names, ("kinds.weight",) if tied else ("words.weight", "kinds.weight"))
    if tied:  # the head's own gradient reached row 0: it moved by more than the decay
        assert not np.allclose(state["words.weight"][0], initial["words.weight"][0] * (1 - 5e-3) ** 4)


def test_train_mode_lookups_are_marked_too():
    """mode="train": the loss reads a training-mode copy of the forward pass; its lookups keep the rows."""
    torch.manual_seed(0)
    module = Tiny()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = ot.build_training_model(_export(module, True), "cross_entropy",
                                           ot.AdamW(lr=5e-2, eps=1e-12, weight_decay=0.1), mode="train")
    initial = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    state, names = _train_both(module, training)
    _assert_parameters(module, state, initial, names)


def test_dynamo_metadata_is_read():
    assert detect_padding_rows(_export(Tiny(), True).graph) == {"words.weight": 0, "kinds.weight": 3}
    assert detect_padding_rows(_export(Tiny(), False).graph) == {}  # TorchScript keeps nothing of it


def test_torchscript_without_the_argument_trains_the_row_and_none_opts_out():
    """What the docs say: the TorchScript export carries no padding_idx, so without
    ``padding_rows`` the row trains; ``None`` drops a row the dynamo export recorded."""
    torch.manual_seed(0)
    module = Tiny()
    for model, padding in ((_export(module, False), None),
                           (_export(module, True), {"words.weight": None, "kinds.weight": None})):
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            training = ot.build_training_model(model, "cross_entropy", ot.Adam(lr=1e-2), padding_rows=padding)
        assert "padding_rows" not in metadata(training)
        session = ot.TrainingSession(training)
        before = session.state_dict()["words.weight"][0].copy()
        session.step({"ids": np.zeros((2, 5), np.int64), "kinds": np.zeros((2, 5), np.int64),
                      "labels": np.array([0, 1])})
        assert not np.array_equal(session.state_dict()["words.weight"][0], before)


def test_gradients_of_backward_and_lazy_rows():
    """The accumulated gradient (backward / gradients) has a zero padding row, as torch's
    ``.grad``; a lazy (SparseAdam-like) table never moves its padding row."""
    torch.manual_seed(0)
    module = Tiny()
    model = _export(module, True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        dense = ot.build_training_model(model, "cross_entropy", ot.Adam(lr=1e-2))
        lazy = ot.build_training_model(model, "cross_entropy", ot.Adam(lr=1e-2),
                                       sparse_updates={"words.weight": "lazy"})
    ids, kinds, labels = next(_batches(np.random.default_rng(1), 1))
    probe = ot.TrainingSession(dense)
    probe.backward({"ids": ids, "kinds": kinds, "labels": labels})
    ours = probe.gradients()
    module.zero_grad()
    torch.nn.functional.cross_entropy(module(torch.from_numpy(ids), torch.from_numpy(kinds)),
                                      torch.from_numpy(labels)).backward()
    for name, p in module.named_parameters():
        np.testing.assert_allclose(ours[name], p.grad.numpy(), rtol=1e-5, atol=1e-7, err_msg=name)
    assert not ours["words.weight"][0].any() and not ours["kinds.weight"][3].any()
    probe = ot.TrainingSession(lazy)  # the lazy table's accumulated rows: the padding row is not touched
    before = probe.state_dict()["words.weight"].copy()
    probe.backward({"ids": ids, "kinds": kinds, "labels": labels})
    np.testing.assert_allclose(probe.gradients()["words.weight"], module.words.weight.grad.numpy(), rtol=1e-5,
                               atol=1e-7)
    probe.optimizer_step()
    assert np.array_equal(probe.state_dict()["words.weight"][0], before[0])
    session = ot.TrainingSession(lazy)
    before = session.state_dict()["words.weight"].copy()
    for ids, kinds, labels in _batches(np.random.default_rng(2), 3):
        session.step({"ids": ids, "kinds": kinds, "labels": labels})
    after = session.state_dict()["words.weight"]
    assert np.array_equal(after[0], before[0])
    assert not np.array_equal(after[1:], before[1:])


@pytest.mark.parametrize("padding, message", [
    ({"nope": 0}, r"'nope' is not an initializer"),
    ({"words.weight": VOCAB}, r"padding_rows\['words.weight'\] must be an integer row of its 12 rows"),
    ({"words.weight": 1.5}, r"must be an integer row"),
    ({"head.weight": 0}, r"no Gather on axis 0 of 'head.weight'"),
    ([("words.weight", 0)], r"padding_rows must map"),
])
def test_bad_padding_rows_are_named(padding, message):
    model = _export(Tiny(), False)
    with pytest.raises(ot.TrainingOpError, match=message):
        ot.build_training_model(model, "cross_entropy", ot.Adam(lr=1e-2), padding_rows=padding)


def test_bert_word_embeddings_pad_token():
    """transformers BERT: word embeddings use pad_token_id as padding_idx; both exporters with
    their defaults, AdamW: parameters and the padding row equal torch's."""
    transformers = pytest.importorskip("transformers")

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            config = transformers.BertConfig(vocab_size=VOCAB, hidden_size=8, num_hidden_layers=1,
                                             num_attention_heads=2, intermediate_size=16,
                                             max_position_embeddings=16, num_labels=CLASSES, pad_token_id=0,
                                             hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0)
            self.model = transformers.BertForSequenceClassification(config)

        def forward(self, ids):
            return self.model(input_ids=ids).logits

    for dynamo in (True, False):
        torch.manual_seed(0)
        module = Logits().eval()
        with torch.no_grad():  # no equal-valued tensors for the TorchScript exporter to merge
            for p in module.parameters():
                p.add_(torch.randn_like(p) * 0.05)
        model = _export(module, dynamo, names=("ids",))
        table = "model.bert.embeddings.word_embeddings.weight"
        initial = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            training = ot.build_training_model(model, "cross_entropy",
                                               ot.AdamW(lr=1e-2, eps=1e-12, weight_decay=0.1),
                                               padding_rows=None if dynamo else {table: 0})
        assert metadata(training)["padding_rows"] == f'{{"{table}": 0}}'
        state, names = _train_both(module, training, steps=3, feeds=("ids",), lr=1e-2)
        for name, p in module.named_parameters():
            if name.endswith("key.bias"):  # softmax ignores it: its gradient is rounding noise, Adam's steps too
                continue
            ours, transposed = names[name]
            np.testing.assert_allclose(state[ours].T if transposed else state[ours], p.detach().numpy(),
                                       rtol=1e-4, atol=1e-4, err_msg=name)
        torch_row = dict(module.named_parameters())[table].detach().numpy()[0]
        np.testing.assert_allclose(state[table][0], torch_row, rtol=1e-6)
        np.testing.assert_allclose(state[table][0], initial[table][0] * (1 - 1e-3) ** 3, rtol=1e-6)


def test_the_command_line_takes_padding_rows(tmp_path, capsys):
    from onnx_training_ops.cli import main

    onnx.save(_export(Tiny(), False), tmp_path / "tiny.onnx")
    out = tmp_path / "train.onnx"
    assert main(["build", str(tmp_path / "tiny.onnx"), str(out), "--loss", "cross_entropy",
                 "--padding-row", "words.weight=0", "--padding-row", "kinds.weight=-1"]) == 0
    assert metadata(onnx.load(out))["padding_rows"] == '{"kinds.weight": 3, "words.weight": 0}'
    capsys.readouterr()
    assert main(["build", str(tmp_path / "tiny.onnx"), str(tmp_path / "o.onnx"), "--loss", "cross_entropy",
                 "--padding-row", "words.weight"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "expected TABLE=ROW" in err[0], err
    assert not (tmp_path / "o.onnx").exists()


def test_an_exported_step_keeps_the_padding_row(tmp_path):
    """export_step writes the step in standard ops (the Gradient expanded): the row stays put there too."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = ot.build_training_model(_export(Tiny(), True), "cross_entropy", ot.Adam(lr=1e-2))
    from onnx_training_ops.export import export_step, session_from_export

    export_step(training, tmp_path / "export")
    session = session_from_export(tmp_path / "export")
    before = {k: v.copy() for k, v in session.state_dict().items() if k in ("words.weight", "kinds.weight")}
    for ids, kinds, labels in _batches(np.random.default_rng(3), 2):
        session.step({"ids": ids, "kinds": kinds, "labels": labels, "learning_rate": np.float32(1e-2)})
    after = session.state_dict()
    assert np.array_equal(after["words.weight"][0], before["words.weight"][0])
    assert np.array_equal(after["kinds.weight"][3], before["kinds.weight"][3])
    assert not np.array_equal(after["words.weight"][1:], before["words.weight"][1:])


def test_a_padding_row_that_cannot_be_kept():
    """Read from the export, it warns and the row trains (the build goes on); given, it is an error."""
    from onnx_training_ops.builder.padding_rows import mark_lookups

    table = onnx.numpy_helper.from_array(np.zeros((4, 2), np.float32), "table")
    matmul = onnx.helper.make_node("MatMul", ["x", "table"], ["y"], name="matmul")
    with pytest.warns(UserWarning, match=r"padding_idx 0 of 'table' \(read from the export\) is not kept.*trains"):
        assert mark_lookups({"table": 0}, [table], [matmul]) == {}
    with pytest.raises(ot.TrainingOpError, match="padding_rows: no Gather on axis 0 of 'table'"):
        mark_lookups({"table": 0}, [table], [matmul], given={"table"})


@pytest.mark.parametrize("dims, dynamic", [((5, 3), False), ((5, 2, 3), False), ((5, 3), True)])
def test_the_gather_rule_leaves_out_the_padding_positions(dims, dynamic):
    """d sum(Gather(table, ids)) / d table counts each row's lookups; the marked row gets none
    (negative ids counting from the end included, a table of rank 3, dynamic shapes)."""
    from gradient_utils import gradient_model, run_expanded

    from onnx_training_ops.autodiff.rules_shape import PADDING_ROW_KEY

    node = onnx.helper.make_node("Gather", ["table", "ids"], ["y"], name="lookup")
    node.metadata_props.add(key=PADDING_ROW_KEY, value="1")
    table = np.arange(np.prod(dims), dtype=np.float32).reshape(dims)
    ids = np.array([[1, 0, 4, 1], [-4, 2, 0, 1]], np.int64)  # -4 is row 1
    grads = run_expanded(gradient_model([node], {"table": table, "ids": ids}, "y", ["table"], opset=17,
                                        dynamic=dynamic), {"table": table, "ids": ids})
    counts = np.bincount(ids.reshape(-1) % dims[0], minlength=dims[0]).astype(np.float32)
    counts[1] = 0
    np.testing.assert_array_equal(grads["d_table"], np.broadcast_to(counts.reshape(-1, *[1] * (len(dims) - 1)), dims))


def test_a_lazy_table_with_a_padding_row_keeps_the_sessions_row_path():
    """The mask sits before the deduplication: the session still sums the rows itself."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        lazy = ot.build_training_model(_export(Tiny(), True), "cross_entropy", ot.Adam(lr=1e-2),
                                       sparse_updates={"words.weight": "lazy"})
    session = ot.TrainingSession(lazy)
    _, rows, _ = session._programs.steps[0].analysis.updates
    assert len(rows.groups) == 1 and rows.groups[0].dedup


@pytest.mark.parametrize("dynamo", [False, True], ids=["torchscript", "dynamo"])
def test_export_for_training_records_the_rows(tmp_path, dynamo):
    """export_for_training has the module: it records each padding_idx, so a TorchScript export
    needs no padding_rows either; trained against torch as above."""
    from onnx_training_ops.builder.padding_rows import TORCH_PADDING_KEY
    from onnx_training_ops.export.from_torch import export_for_training

    torch.manual_seed(0)
    module = Tiny()
    initial = {n: p.detach().numpy().copy() for n, p in module.named_parameters()}
    args = (torch.zeros(2, 5, dtype=torch.int64), torch.zeros(2, 5, dtype=torch.int64))  # two tensors, not one twice
    model = export_for_training(module, args, tmp_path / "tiny.onnx", input_names=["ids", "kinds"],
                                output_names=["logits"], dynamo=dynamo,
                                dynamic_axes={"ids": {0: "batch", 1: "seq"}, "kinds": {0: "batch", 1: "seq"}})
    recorded = next(m.value for m in model.metadata_props if m.key == TORCH_PADDING_KEY)
    assert recorded == '{"kinds.weight": 3, "words.weight": 0}'
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = ot.build_training_model(tmp_path / "tiny.onnx", "cross_entropy",
                                           ot.AdamW(lr=5e-2, eps=1e-12, weight_decay=0.1))
    assert metadata(training)["padding_rows"] == recorded
    state, names = _train_both(module, training)
    _assert_parameters(module, state, initial, names)


def test_a_device_resident_session_keeps_the_padding_row():
    """TrainingSession(device=...) runs the export's standard-op graphs: the same rows as the host."""
    torch.manual_seed(0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        training = ot.build_training_model(_export(Tiny(), True), "cross_entropy", ot.AdamW(lr=1e-2))
    host, device = ot.TrainingSession(training), ot.TrainingSession(training, device="cpu")
    before = host.state_dict()["words.weight"][0].copy()
    for ids, kinds, labels in _batches(np.random.default_rng(4), 2):
        for session in (host, device):
            session.step({"ids": ids, "kinds": kinds, "labels": labels})
    for name, value in host.state_dict().items():
        np.testing.assert_allclose(device.state_dict()[name], value, rtol=1e-5, atol=1e-7, err_msg=name)
    np.testing.assert_allclose(device.state_dict()["words.weight"][0], before * (1 - 1e-2 * 1e-2) ** 2, rtol=1e-6)
