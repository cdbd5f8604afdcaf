"""The JavaScript trainer (js/) for real: Python writes the fixtures (tests/js_fixtures.py), then
``node --test`` trains them in onnxruntime-node and headless Chromium trains them in
onnxruntime-web (js/test/*.test.js); here the states and models they wrote come back to Python.

Needs node and js/node_modules (``cd js && npm ci --ignore-scripts``) and Debian's chromium:
``make test`` installs them. ``OTO_SKIP_BROWSER=1`` (``make test SKIP_BROWSER=1``) skips the
Chromium tests, with that reason.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import js_fixtures
import numpy as np
import onnxruntime as ort
import pytest
from node_runner import node_test

from onnx_training_ops.export import load_state, session_from_export
from onnx_training_ops.storage import safetensors

browser = pytest.mark.skipif(os.environ.get("OTO_SKIP_BROWSER", "") not in ("", "0"),
                             reason="OTO_SKIP_BROWSER is set (make test SKIP_BROWSER=1): no headless Chromium")


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    return js_fixtures.write_all(tmp_path_factory.mktemp("js"))


def _continue_one_step(fixtures: Path, name: str, state_file: str) -> dict:
    """A TrainingSession on the export's step model, loaded with ``state_file``, one step on."""
    session = session_from_export(fixtures / name / "export")
    load_state(session, fixtures / name / state_file)
    batches, _ = safetensors.read(fixtures / name / "batches.safetensors")
    rate = np.array(json.loads((fixtures / name / "expected.json").read_text())["learning_rates"][-1]["learning_rate"],
                    np.float32)
    result = session.step({**{k: v[0] for k, v in batches.items()}, "learning_rate": rate})
    return {"loss": result["loss"], **session.state_dict()}


def test_node_trains_the_models_like_python_and_python_continues(fixtures):
    """Node: each step's loss within 1e-5 of Python's (js/test/train.test.js); here: the state
    Node reached is what the export's step model reaches in Python's onnxruntime, and close to
    the TrainingSession's own (whose graph may use onnxruntime's contrib ops and our kernels,
    so it rounds differently); it loads into a TrainingSession and continues like Python's."""
    node_test(["test/train.test.js", "test/unit.test.js", "test/readme.test.js"], fixtures)
    for name in js_fixtures.MODELS:
        expected, _ = safetensors.read(fixtures / name / "expected_state.safetensors")
        exported, _ = safetensors.read(fixtures / name / "export_state.safetensors")
        trained, _ = safetensors.read(fixtures / name / "node_state.safetensors")
        assert set(trained) == set(expected) == set(exported)
        for key, value in expected.items():
            np.testing.assert_allclose(trained[key], exported[key], rtol=1e-6, atol=1e-8, err_msg=f"{name} {key}")
            np.testing.assert_allclose(exported[key], value, rtol=1e-5, atol=_rounding_tolerance(name, key),
                                       err_msg=f"{name} {key}")
        ours = _continue_one_step(fixtures, name, "node_state.safetensors")
        theirs = _continue_one_step(fixtures, name, "export_state.safetensors")
        for key, value in theirs.items():
            np.testing.assert_allclose(ours[key], value, rtol=1e-6, atol=1e-8, err_msg=f"{name} {key}")


def _rounding_tolerance(name: str, key: str) -> float:
    """Absolute tolerance between two float32 roundings of 200 steps. BERT's attention key
    bias has a gradient of exactly zero (softmax does not change when every score of a row
    shifts by the same q.b), so what it receives is rounding noise that Adam normalizes into
    steps of up to lr: two roundings drift apart by far more than ulps (measured 9.1e-6 after
    200 steps, 0.009 lr); allowed: 0.02 lr. The CNN's BatchNorm runs native kernels in the
    session (float64 sums) and standard ops in the export (float32 sums): measured up to
    3.9e-7 apart after 200 steps (values up to 1.8); allowed: 1e-6. The tiny GPT-2 (momentum SGD,
    its loss 4.6 -> 1.3 over the 200 steps) drifts most: 42 of its 57 state tensors pass 1e-7
    absolute, the worst a momentum buffer 2.8e-5 apart (values up to 0.6), the weights up to
    5.1e-7; allowed: 1e-4."""
    bert_lr = 1e-3  # js_fixtures._bert's AdamW
    if name == "gpt2":
        return 1e-4
    if name == "cnn":
        return 1e-6
    return 0.02 * bert_lr if name == "bert" and key.endswith("attention.self.key.bias") else 1e-7


def test_node_writes_a_self_contained_trained_inference_model(fixtures):
    """trainer.inferenceModel(): the trained weights embedded; Python's onnxruntime runs it and
    it computes what the eval model computes with those weights."""
    for name in js_fixtures.MODELS:
        path = fixtures / name / "node_inference.onnx"
        if not path.exists():
            node_test(["test/train.test.js"], fixtures)
        model = ort.InferenceSession(path.read_bytes())
        state, _ = safetensors.read(fixtures / name / "node_state.safetensors")
        batches, _ = safetensors.read(fixtures / name / "batches.safetensors")
        feeds = {i.name: batches[i.name][0] for i in model.get_inputs()}
        evaluation = ort.InferenceSession(str(fixtures / name / "export" / "eval.onnx"))
        eval_feeds = {i.name: (state[i.name] if i.name in state else batches[i.name][0])
                      for i in evaluation.get_inputs()}
        output = model.get_outputs()[0].name
        np.testing.assert_allclose(model.run([output], feeds)[0], evaluation.run([output], eval_feeds)[0],
                                   rtol=1e-6, atol=1e-6)


@browser
def test_chromium_trains_the_models_and_the_browser_example(fixtures):
    """onnxruntime-web (wasm) in headless Chromium: each step's loss within 1e-5 of Python's, the
    final state close to Python's; the example page's downloaded model scores what the page said."""
    node_test(["test/browser.test.js"], fixtures)
    for name in js_fixtures.MODELS:
        report = json.loads((fixtures / name / "browser_report.json").read_text())
        assert report["worstLoss"] <= 1e-5 and report["steps"] == js_fixtures.STEPS
        expected, _ = safetensors.read(fixtures / name / "expected_state.safetensors")
        trained, _ = safetensors.read(fixtures / name / "browser_state.safetensors")
        for key, value in expected.items():
            np.testing.assert_allclose(trained[key], value, rtol=1e-3, atol=1e-5, err_msg=f"{name} {key}")
    example = json.loads((fixtures / "example" / "browser_example.json").read_text())
    data, _ = safetensors.read(fixtures / "example" / "data.safetensors")
    downloaded = ort.InferenceSession((fixtures / "example" / "downloaded.onnx").read_bytes())
    logits = downloaded.run(None, {"input": data["test_x"]})[0]
    accuracy = float(np.mean(logits.argmax(-1) == data["test_y"]))
    assert abs(accuracy - example["accuracyAfter"]) <= 1 / len(data["test_y"])
    assert example["accuracyAfter"] > example["accuracyBefore"]


def test_chromium_trains_on_webgpu(fixtures):
    """onnxruntime-web's WebGPU provider in headless Chromium (SwiftShader's adapter here):
    js/test/webgpu.test.js checks that every node of each model's WebGPU step is on
    WebGpuExecutionProvider and that 50 steps stay within 1e-4 of wasm and of Python (it skips,
    with the reason, when the browser offers no adapter); js/test/webgpu.unit.test.js checks the
    host program against Python's bit for bit and the fallback in Node. Here: the report is
    complete."""
    out = node_test(["test/webgpu.unit.test.js", "test/webgpu.test.js"], fixtures)
    if "# skipped" in out and "# skipped 0" not in out:
        pytest.skip("Chromium offers no WebGPU adapter here (see js/test/webgpu.test.js)")
    report = json.loads((fixtures / "webgpu_report.json").read_text())
    assert [m["name"] for m in report["models"]] == list(js_fixtures.MODELS)
    for model in report["models"]:
        assert any("All nodes placed on [WebGpuExecutionProvider]" in line for line in model["placement"])
        assert model["worstVsWasm"] <= 1e-4 and model["worstVsPython"] <= 1e-4
