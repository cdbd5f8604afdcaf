"""Fault suite of the JavaScript trainer (``js/test/fault.test.js``): damaged, foreign and hostile
manifests, files, batches and learning rates give a ``TrainerError`` naming the file, field or
input; nothing changes on failure; nothing hangs (issue 29 items 1, 4, 5, 11-17; issue 32 item 3).

Also the npm package as a user receives it (``js/test/pack.test.js``, issue 32 item 5).

Python writes small fixtures (the MLP and the CNN exported after two training steps, and the
browser example); node runs the suite against them.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
from pathlib import Path

import js_fixtures
import pytest
from node_runner import node_test

from onnx_training_ops.storage import safetensors


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    out = tmp_path_factory.mktemp("js_fault")
    for name in ("mlp", "cnn"):
        js_fixtures.write_model(name, out, steps=2)
    js_fixtures.write_example(out)
    return out


def _node_test(file: str, fixtures: Path) -> None:
    out = node_test([file], fixtures, timeout=300)
    assert "# fail 0" in out and "# pass 0" not in out


def test_the_js_fault_suite(fixtures):
    """The suite passes; the state it exported carries the SHA-256 of its data section in
    ``__metadata__`` (notes/MANIFEST.md item 2), as Python's hashlib computes it."""
    _node_test("test/fault.test.js", fixtures)
    data = (fixtures / "mlp" / "js_exported_state.safetensors").read_bytes()
    (length,) = struct.unpack("<Q", data[:8])
    metadata = json.loads(data[8:8 + length])["__metadata__"]
    assert metadata == {"format": "onnx-training-ops/export", "sha256": hashlib.sha256(data[8 + length:]).hexdigest()}
    tensors, _ = safetensors.decode(data)
    manifest = json.loads((fixtures / "mlp" / "export" / "manifest.json").read_text())
    assert set(tensors) == {e["name"] for e in manifest["state"]}


def test_the_npm_tarball_installs_and_trains(fixtures):
    """``npm pack``; the tarball installed into an empty folder (``npm install --offline``) holds the
    LICENSE and what its README links to, and the README's loop trains the digits MLP from it
    (js/test/pack.test.js)."""
    if shutil.which("npm") is None:
        pytest.fail("npm is not installed (make test installs it with apt-get)")
    _node_test("test/pack.test.js", fixtures)
