"""The exported step of LoRA on onnxruntime-genai's int4 Llama, trained by the JavaScript trainer
(issue 38 item 6): onnxruntime-node and onnxruntime-web's wasm in headless Chromium run its
contrib ops (MatMulNBits, GroupQueryAttention, SkipSimplifiedLayerNormalization, and
GatherBlockQuantized in the backward); each step's loss within 1e-5 of Python's (js/test/lora.test.js)
and the adapters they reach close to Python's. Its WebGPU step (export_step(target="webgpu")) trains
in Chromium on WebGPU (SwiftShader's adapter here) with every node on WebGPU, within 1e-4 of wasm
and Python per step. Needs node, js/node_modules and Chromium, as
tests/test_export_js.py (``OTO_SKIP_BROWSER=1`` leaves Chromium out)."""

from __future__ import annotations

import json
import os

import js_fixtures
import numpy as np
import pytest
from node_runner import node_test

from onnx_training_ops.storage import safetensors

pytest.importorskip("onnxruntime_genai")
pytest.importorskip("torch")


def test_the_int4_llamas_adapters_train_in_node_and_chromium_like_in_python(tmp_path):
    js_fixtures.write_probes(tmp_path)  # the WebGPU harness's IsNaN probe
    directory = js_fixtures.write_model("lora_int4", tmp_path, js_fixtures.LORA_STEPS,
                                        state_after=(js_fixtures.LORA_WEBGPU_STEPS,))
    node_test(["test/lora.test.js"], tmp_path)
    runs = {"node_state.safetensors": "expected_state.safetensors"}
    if os.environ.get("OTO_SKIP_BROWSER", "") in ("", "0"):
        runs["browser_state.safetensors"] = "expected_state.safetensors"
        if (directory / "webgpu_report.json").exists():  # Chromium offered a WebGPU adapter (SwiftShader here)
            report = json.loads((directory / "webgpu_report.json").read_text())
            assert any("All nodes placed on [WebGpuExecutionProvider]" in line for line in report["placement"])
            assert report["report"]["steps"] == js_fixtures.LORA_WEBGPU_STEPS
            runs["webgpu_state.safetensors"] = f"expected_state_{js_fixtures.LORA_WEBGPU_STEPS}.safetensors"
    for run, reference in runs.items():
        expected, _ = safetensors.read(directory / reference)
        trained, _ = safetensors.read(directory / run)
        assert set(trained) == set(expected)
        for key, value in expected.items():
            if "lora_" in key:  # the adapters, after 20 (WebGPU: 3) AdamW steps (lr 1e-2), in float32 rounding
                np.testing.assert_allclose(trained[key], value, rtol=1e-4, atol=1e-5, err_msg=f"{run} {key}")
            else:
                np.testing.assert_array_equal(trained[key], value, err_msg=f"{run} {key}")
