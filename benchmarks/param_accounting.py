"""Does torch's default export train torch's parameters? Every architecture of the survey, both exporters.

For each tiny random architecture of ``tests/param_parity.py`` (transformers' ALBERT, ELECTRA,
RoBERTa, DeBERTa-v2, MobileBERT, GPT-NeoX, Llama, Mistral, OPT, Phi, CLIP, Swin, ConvNeXt,
SegFormer; plain torch.nn) and each export (``torch.onnx.export(m, args, f)``: dynamo with
``optimize=True``; the same followed by ``record_torch_names(model, module)``; TorchScript
with ``do_constant_folding=True`` and the record), one line: the build's error (it names the
parameters it refuses and the remedy), or the largest gradient and two-step errors against
torch in float64, torch float32's own beside them, and whether the trainables are torch's
``requires_grad`` parameters and ``to_torch_state_dict()`` loads with ``strict=True``.

    PYTHONPATH=. python benchmarks/param_accounting.py [arch ...] [dynamo|record|torchscript ...] [fresh]

``fresh``: random-init weights as they come (equal LayerNorm weights and zero biases, which the
exporters merge); default: perturbed, as trained weights are.
"""

from __future__ import annotations

import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from param_parity import ARCHS, architecture, check  # noqa: E402

EXPORTS = {"dynamo": ("dynamo", False), "record": ("dynamo", True), "torchscript": ("torchscript", True)}


def main(argv: list[str]) -> None:
    names = [a for a in argv if a in ARCHS] or list(ARCHS)
    exports = [a for a in argv if a in EXPORTS] or list(EXPORTS)
    fresh = "fresh" in argv
    print(f"{'architecture':12s} {'export':12s} {'s':>5s}  result")
    for name in names:
        for label in exports:
            exporter, record = EXPORTS[label]
            start = time.perf_counter()
            try:
                module, args = architecture(name, perturbed=not fresh)
                with warnings.catch_warnings():
                    warnings.simplefilter("ignore")
                    result = check(module, args, exporter, record=record)
                if result.error:
                    text = "error: " + result.error[:400]
                else:
                    same = result.trainables == result.expected
                    text = (("ok  " if same and result.within(1e-4) and result.strict_load == "ok" else "DIFF ")
                            + result.summary())
            except Exception as error:  # noqa: BLE001 - an exporter's own failure is a line of the table
                text = f"export failed: {type(error).__name__}: {str(error).splitlines()[-1][:200]}"
            print(f"{name:12s} {label:12s} {time.perf_counter() - start:5.1f}  {text}", flush=True)


if __name__ == "__main__":
    main(sys.argv[1:])
