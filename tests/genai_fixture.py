"""A tiny onnxruntime-genai Llama kept in the repository (``fixtures/genai/llama-int4``, 164 KB):
the builder's ``-p int4 -e cpu`` graph (``--extra_options accuracy_level=1``) of the random-init
2-layer Llama of :mod:`genai_models`, so that tests run it where onnxruntime-genai is not
installed (the GPU machines). Rewrite it with ``python tests/genai_fixture.py`` (needs the genai
extra and torch)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

LLAMA_INT4 = Path(__file__).parent / "fixtures" / "genai" / "llama-int4"


def llama_int4() -> Path:
    """The fixture's folder (``model.onnx``, ``model.onnx.data``, ``genai_config.json``...)."""
    return LLAMA_INT4


def write() -> None:
    sys.path.insert(0, str(Path(__file__).parent))
    from genai_models import genai_model

    with tempfile.TemporaryDirectory() as tmp:
        folder = genai_model("llama", "int4", Path(tmp), accuracy_level=1)
        shutil.rmtree(LLAMA_INT4, ignore_errors=True)
        LLAMA_INT4.mkdir(parents=True)
        for name in ("model.onnx", "model.onnx.data", "genai_config.json"):
            shutil.copy(folder / name, LLAMA_INT4 / name)
    print(f"wrote {LLAMA_INT4}: {sum(f.stat().st_size for f in LLAMA_INT4.iterdir()) / 1024:.0f} KB")


if __name__ == "__main__":
    write()
