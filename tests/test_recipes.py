"""The recipes (examples/recipes) with tiny configs, each with both exporters: the first step's
loss equals torch's, training lowers it, and the trained weights load back into a fresh torch
module that then computes what the trained ONNX model computes."""

import logging
import sys
import warnings
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "examples" / "recipes"))

import bert_classifier  # noqa: E402
import causal_lm  # noqa: E402
import cnn  # noqa: E402

EXPORTERS = ["torchscript", "dynamo"]


@pytest.fixture(autouse=True)
def quiet():
    logging.disable(logging.WARNING)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield
    logging.disable(logging.NOTSET)


def _check_round_trip(result, fresh, strict=True):
    """The session's weights under torch's names load into ``fresh``, which then matches the ONNX model."""
    session = result["session"]
    state = session.to_torch_state_dict()
    missing, unexpected = fresh.load_state_dict(state, strict=strict)
    feeds = result["feeds"]
    expected = session.run(["logits"], feeds)[0]
    with torch.no_grad():
        got = fresh(*[torch.from_numpy(v) for v in feeds.values()]).numpy()
    np.testing.assert_allclose(got, expected, rtol=1e-4, atol=1e-5)
    return missing, unexpected


@pytest.mark.parametrize("exporter", EXPORTERS)
@pytest.mark.parametrize("family", ["gpt2", "llama"])
def test_causal_lm(tmp_path, family, exporter):
    result = causal_lm.main(family, exporter, steps=3, out_dir=str(tmp_path))
    assert result["losses"][0] == pytest.approx(result["torch_loss"], rel=1e-5)
    assert result["losses"][-1] < result["losses"][0]
    feeds = {k: result["feeds"][k] for k in ("input_ids", "attention_mask")}
    _check_round_trip({**result, "feeds": feeds}, causal_lm.wrap(causal_lm.make_model(family)))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_bert_classifier(tmp_path, exporter):
    result = bert_classifier.main(exporter, steps=3, out_dir=str(tmp_path))
    assert result["losses"][0] == pytest.approx(result["torch_loss"], rel=1e-5)
    assert result["losses"][-1] < result["losses"][0]
    summary = result["session"].summary()
    assert summary.trainable_count == sum(p.numel() for p in bert_classifier.make_model().parameters())
    _check_round_trip(result, bert_classifier.wrap(bert_classifier.make_model()))


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_cnn_in_train_mode(tmp_path, exporter):
    result = cnn.main(exporter, steps=3, out_dir=str(tmp_path))
    assert result["losses"][0] == pytest.approx(result["torch_loss"], rel=1e-5)
    assert result["losses"][-1] < result["losses"][0]
    ours, theirs = result["state_after_one_step"], result["torch_state_after_one_step"]
    for name in [k for k in theirs if "running" in k]:  # BatchNorm statistics after one train-mode step
        np.testing.assert_allclose(ours[name], theirs[name], rtol=1e-5, atol=1e-6)
    fresh = cnn.make_model().eval()
    missing, unexpected = _check_round_trip(result, fresh, strict=False)
    assert not unexpected and all(k.endswith("num_batches_tracked") for k in missing)  # an int64 count, unused


@pytest.mark.parametrize("exporter", EXPORTERS)
def test_lora(tmp_path, exporter):
    pytest.importorskip("peft")
    import lora

    result = lora.main(exporter, steps=3, out_dir=str(tmp_path))
    assert result["losses"][0] == pytest.approx(result["torch_loss"], rel=1e-5)
    assert result["losses"][-1] < result["losses"][0]
    session = result["session"]
    assert [t.name for t in session.summary().trainable] == result["trainable"]
    assert all("lora_" in name for name in result["trainable"]) and len(result["trainable"]) == 8
    fresh = lora.wrap(lora.make_lora_model())
    before = {k: v.clone() for k, v in fresh.state_dict().items()}
    _check_round_trip({**result, "feeds": {"input_ids": np.zeros((2, 16), np.int64) + 3,
                                           "attention_mask": np.ones((2, 16), np.int64)}}, fresh)
    after = fresh.state_dict()
    changed = {k for k in before if not torch.equal(before[k], after[k])}
    assert changed == set(result["trainable"])  # only the adapters trained; the base stayed as exported
