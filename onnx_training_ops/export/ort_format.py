"""``export-step --ort``: ORT-format models and the reduced-build operator config, for mobile.

onnxruntime's own converter (``onnxruntime.tools.convert_onnx_models_to_ort``, optimization
style "Fixed", its default level) writes ``step.ort`` and ``eval.ort`` and lists the kernels
they need. The config written here (``required_operators.config``, the format onnxruntime's
``build.sh --include_ops_by_config`` reads: ``domain;opset;Op1,Op2``) is that list joined with
every op of the ONNX step and eval models themselves, so a reduced build also runs a model
that another onnxruntime version optimized differently.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import shutil
import tempfile
from collections.abc import Iterable
from pathlib import Path

import onnx

from ..errors import TrainingOpError
from ..storage import checkpoint
from ..walk import all_graphs

CONFIG = "required_operators.config"
Ops = dict[str, dict[int, set[str]]]  # domain -> since-version -> op types


def read_config(text: str) -> Ops:
    """The ops of an operator config (comments and blank lines skipped)."""
    ops: Ops = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        domain, opset, names = line.split(";", 2)
        ops.setdefault(domain, {}).setdefault(int(opset), set()).update(
            n.split("{")[0] for n in names.split(",") if n)
    return ops


def write_config(ops: Ops, sources: Iterable[str]) -> str:
    lines = ["# onnx-training-ops export-step --ort: the kernels of"]
    lines += [f"# - {name}" for name in sources]
    for domain in sorted(ops):
        for opset in sorted(ops[domain]):
            lines.append(f"{domain};{opset};{','.join(sorted(ops[domain][opset]))}")
    return "\n".join(lines) + "\n"


def model_ops(model: onnx.ModelProto) -> Ops:
    """Each op of ``model`` under the opset version its schema was last changed in (what the
    config names), standard domains only."""
    imported = {o.domain or "ai.onnx": o.version for o in model.opset_import}
    ops: Ops = {}
    for graph in all_graphs(model.graph):
        for node in graph.node:
            domain = node.domain or "ai.onnx"
            schema = onnx.defs.get_schema(node.op_type, imported[domain], "" if domain == "ai.onnx" else domain)
            ops.setdefault(domain, {}).setdefault(schema.since_version, set()).add(node.op_type)
    return ops


def merge(into: Ops, more: Ops) -> Ops:
    for domain, versions in more.items():
        for opset, names in versions.items():
            into.setdefault(domain, {}).setdefault(opset, set()).update(names)
    return into


def convert(out_dir: str | os.PathLike, names: list[str]) -> dict[str, dict]:
    """Convert ``names`` (ONNX files in ``out_dir``) to ORT format beside them and write the
    operator config; returns the manifest's ``files`` entries."""
    try:
        from onnxruntime.tools.convert_onnx_models_to_ort import OptimizationStyle, convert_onnx_models_to_ort
    except ImportError as error:  # pragma: no cover - onnxruntime ships its tools
        raise TrainingOpError(f"--ort needs onnxruntime's tools package: {error}") from None
    out_dir = Path(out_dir)
    with tempfile.TemporaryDirectory(dir=out_dir, prefix=".ort-") as tmp:
        source, target = Path(tmp) / "onnx", Path(tmp) / "ort"
        source.mkdir()
        for name in names:
            shutil.copyfile(out_dir / name, source / name)
        log = io.StringIO()
        logging.disable(logging.INFO)  # the converter logs each file it writes
        try:
            with contextlib.redirect_stdout(log), contextlib.redirect_stderr(log):
                convert_onnx_models_to_ort(source, output_dir=target, optimization_styles=[OptimizationStyle.Fixed])
        except Exception as error:  # noqa: BLE001 - the converter raises whatever onnxruntime raised
            raise TrainingOpError(f"--ort: onnxruntime's converter failed: {error}\n{log.getvalue()[-2000:]}") from None
        finally:
            logging.disable(logging.NOTSET)
        ops = read_config((target / CONFIG).read_text())
        for name in names:
            merge(ops, model_ops(onnx.load(out_dir / name, load_external_data=False)))
        entries = {}
        for name in names:
            ort_name = Path(name).with_suffix(".ort").name
            checkpoint.atomic_write(out_dir / ort_name, (target / ort_name).read_bytes())
            entries[f"{Path(name).stem.replace('.', '_')}_ort"] = {"path": ort_name}
    checkpoint.atomic_write(out_dir / CONFIG, write_config(ops, names).encode())
    entries["operator_config"] = {"path": CONFIG}
    return entries
