"""Packaging and output hygiene (issue 9's docs/packaging row)."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]


def test_license_file_and_typing_marker_ship():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    assert project["project"]["license"] == "MIT"
    assert "MIT License" in (ROOT / "LICENSE").read_text()
    assert "LICENSE" in project["project"]["license-files"]
    assert (ROOT / "onnx_training_ops" / "py.typed").exists()
    assert "py.typed" in project["tool"]["setuptools"]["package-data"]["onnx_training_ops"]


def test_the_numba_cache_warning_names_numba_cache_dir(monkeypatch):
    from onnx_training_ops.kernels import _numba_kernels as k

    real = k.njit

    def no_locator(*args, cache=False, **kwargs):
        if not cache:
            return real(*args, cache=False, **kwargs)

        def decorate(func):
            raise RuntimeError("cannot cache function: no locator available")
        return decorate

    monkeypatch.setattr(k, "njit", no_locator)
    monkeypatch.setattr(k, "_WARNED", False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        k._jit(False)(lambda x: x)
    assert any("NUMBA_CACHE_DIR" in str(w.message) for w in caught)


def test_the_demo_progress_bar_writes_no_carriage_returns_into_a_log(tmp_path, capsys):
    pytest.importorskip("sklearn")
    pytest.importorskip("tqdm")
    from onnx_training_ops.demo import train
    train(out_dir=str(tmp_path), epochs=1, progress=True)
    err = capsys.readouterr().err  # stderr is not a terminal here
    assert "\r" not in err and "epoch 1/1, loss" in err


def test_a_native_kernel_compiles_uncached_where_numba_cannot_cache(monkeypatch):
    """No writable cache directory: the lazily compiled cfunc still works, with one warning."""
    from onnx_training_ops.kernels import _ort_api

    real = _ort_api.cfunc

    def no_locator(signature, cache=False, **kwargs):
        if cache:
            def decorate(func):
                raise RuntimeError("cannot cache function 'f': no locator available for file '<string>'")
            return decorate
        return real(signature, cache=False, **kwargs)

    monkeypatch.setattr(_ort_api, "cfunc", no_locator)
    monkeypatch.setattr(_ort_api, "_uncached_warned", False)
    lazy = _ort_api.LazyCFunc(_ort_api.kernel_destroy.signature, _ort_api._destroy_trampoline)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert lazy.address and lazy.address == lazy.address
    assert [str(w.message) for w in caught if "NUMBA_CACHE_DIR" in str(w.message)]
