"""The public API stays where the README and docs say it is.

Every name of ``onnx_training_ops.__all__``, and every ``from onnx_training_ops... import ...``
and dotted ``onnx_training_ops.x.y`` the README, docs/ and examples/ mention.
"""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

import onnx_training_ops
from onnx_training_ops.autodiff.rules_shape import PADDING_ROW_KEY
from onnx_training_ops.export.manifest import FEEDBACK_KEY
from onnx_training_ops.storage.checkpoint import CHECKSUM_KEY

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md")), *sorted((ROOT / "examples").rglob("*.py"))]
FROM_IMPORT = re.compile(r"from (onnx_training_ops(?:\.\w+)*) import (?:\(([^)]*)\)|([\w, ]+))")
DOTTED = re.compile(r"`(onnx_training_ops(?:\.\w+)+)")
NOT_PYTHON = {CHECKSUM_KEY, FEEDBACK_KEY, PADDING_ROW_KEY}  # metadata_props keys the documents name in the same form


def _resolve(dotted: str):
    """The module or attribute ``dotted`` names (importing modules along the way)."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        for attr in parts[cut:]:
            obj = getattr(obj, attr)
        return obj
    raise ModuleNotFoundError(dotted)


def _mentions() -> list[tuple[str, str]]:
    found = set()
    for path in DOCUMENTS:
        text = path.read_text()
        for module, wrapped, names in FROM_IMPORT.findall(text):
            for item in (wrapped or names).split(","):
                name = item.split(" as ")[0].strip()
                if name.isidentifier():
                    found.add((path.name, f"{module}.{name}"))
        for dotted in DOTTED.findall(text):
            if dotted not in NOT_PYTHON:
                found.add((path.name, dotted))
    return sorted(found)


@pytest.mark.parametrize("name", onnx_training_ops.__all__)
def test_every_name_in_all_imports_from_the_package(name):
    assert getattr(onnx_training_ops, name) is not None


def test_the_documents_mention_many_names():
    assert len(_mentions()) > 40  # the scan below is not vacuous


@pytest.mark.parametrize("where,dotted", _mentions())
def test_every_name_the_documents_mention_resolves(where, dotted):
    _resolve(dotted)
