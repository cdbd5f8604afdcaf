"""The documentation site builds strictly, and its reference covers the public API.

``mkdocs build --strict`` fails on a broken link or anchor, a missing page in the nav, an
unresolved ``:::`` reference or cross-reference, and any mkdocstrings/griffe warning (a
docstring parameter the signature lacks...). The theme's fonts are off, so the build needs no
network.
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from onnx_training_ops.autodiff import supported_ops

ROOT = Path(__file__).resolve().parents[1]
REFERENCE = ROOT / "docs" / "reference"
MISSING = [m for m in ("mkdocs", "material", "mkdocstrings", "mkdocstrings_handlers.python")
           if importlib.util.find_spec(m.split(".")[0]) is None]


def _directives() -> set[str]:
    found = set()
    for page in REFERENCE.glob("*.md"):
        found.update(re.findall(r"^::: ([\w.]+)", page.read_text(), re.M))
    return found


@pytest.mark.skipif(bool(MISSING), reason=f"the docs extra is not installed (missing {MISSING}): "
                                          "pip install 'onnx-training-ops[docs]'")
def test_the_site_builds_strictly(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(ROOT), "NO_MKDOCS_2_WARNING": "1"}
    run = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir", str(tmp_path / "site")],
                         cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-4000:]
    assert (tmp_path / "site" / "reference" / "cli" / "index.html").is_file()
    cli = (tmp_path / "site" / "reference" / "cli" / "index.html").read_text()
    assert "onnx-training-ops export-step" in cli and "--portable" in cli  # generated from the parser
    api = (tmp_path / "site" / "reference" / "sessions" / "index.html").read_text()
    assert "set_lr_schedule" in api and "Raises" in api  # docstrings rendered, inherited methods included
    # the docstrings' reST roles (:class:`X`, :meth:`save`...) are cross-references: links where
    # the site documents the target, the name in code font elsewhere, never the role's text
    for page in (tmp_path / "site").rglob("*.html"):
        text = page.read_text()
        assert not re.search(r":(?:class|func|meth|mod|attr|data|exc|obj|const):(?:<code>|`)", text), page
    assert 'href="#onnx_training_ops.TrainingSession.save"><code>save</code></a>' in api
    assert 'href="#onnx_training_ops.NonFiniteLossError"><code>NonFiniteLossError</code></a>' in api


# The public API: the package's __all__ and that of each public module, and the entry points of
# modules without one that the guides import from (the modules kernels and schedules have
# their entries per function and class below)
PUBLIC_MODULES = ["onnx_training_ops", "onnx_training_ops.export", "onnx_training_ops.migrate",
                  "onnx_training_ops.distributed", "onnx_training_ops.storage"]
ENTRY_POINTS = ["onnx_training_ops.export.from_torch.export_for_training", "onnx_training_ops.training.summary.summary",
                "onnx_training_ops.training.summary.ModelSummary"]


def _public_names() -> list[str]:
    names = [f"{module}.{name}" for module in PUBLIC_MODULES for name in importlib.import_module(module).__all__]
    return sorted(set(names) - {"onnx_training_ops.kernels", "onnx_training_ops.schedules"}) + ENTRY_POINTS


def _object(path: str):
    """What ``path`` names: a module, or an attribute of a module or class."""
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(_object(module), name)


@pytest.mark.parametrize("name", _public_names())
def test_every_public_name_has_a_reference_entry(name):
    """An entry under this path, or under another path of the same object (onnx_training_ops.OrtAdamW
    documents onnx_training_ops.migrate.OrtAdamW)."""
    documented = [_object(path) for path in _directives()]
    assert any(obj is _object(name) for obj in documented), f"docs/reference has no ::: entry for {name}"


def test_every_schedule_and_reference_kernel_has_a_reference_entry():
    from onnx_training_ops import schedules

    classes = {n for n, v in vars(schedules).items() if isinstance(v, type) and v.__module__ == schedules.__name__
               and not n.startswith("_")}
    assert classes and {f"onnx_training_ops.schedules.{n}" for n in classes} <= _directives()
    kernels = {f"onnx_training_ops.kernels.{n}" for n in ("adam", "momentum", "adagrad")}
    assert kernels <= _directives()


def test_the_documents_state_the_number_of_ops_with_rules():
    stated = set()
    for path in [ROOT / "README.md", *(ROOT / "docs").rglob("*.md")]:
        stated.update(int(n) for n in re.findall(r"\b(\d+) ops (?:have|with) (?:rules|derivative rules)",
                                                 path.read_text()))
        stated.update(int(n) for n in re.findall(r"beyond the (\d+) ops", path.read_text()))
    assert stated == {len(supported_ops())}
