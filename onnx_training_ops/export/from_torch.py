"""Export a torch module for training: the exporter settings that keep every parameter, and torch's names.

``torch.onnx.export``'s defaults are made for inference and lose parameters a training model
needs: the dynamo exporter's default ``optimize=True`` merges initializers of equal value,
removes zero biases and folds some embedding lookups into constants; the TorchScript
exporter's default ``do_constant_folding=True`` stores Linear weights transposed under names
such as ``onnx::MatMul_398``. :func:`export_for_training` exports with

* ``dynamo=True, optimize=False`` (default): one initializer per parameter, torch's names;
* ``dynamo=False, do_constant_folding=False``: torch's names, except that parameters of
  equal value become ``Identity`` aliases of one initializer (the builder unties them);

then records where each ``state_dict`` entry went
(:func:`~onnx_training_ops.training.state.torch_names.record_torch_names`), so that
``TrainingSession.to_torch_state_dict()`` gives the trained weights back under torch's
names, and warns about parameters the export lost (unused by ``forward``, or folded).
"""

from __future__ import annotations

import json
import os
import warnings
from collections.abc import Mapping, Sequence
from typing import Any

import onnx

from ..builder.padding_rows import TORCH_PADDING_KEY
from ..errors import TrainingOpError
from ..storage.save import save_model
from ..training.state.torch_names import record_torch_names, recorded_names


def export_for_training(
    module: Any,
    args: tuple,
    path: str | os.PathLike,
    *,
    input_names: Sequence[str],
    output_names: Sequence[str],
    dynamo: bool = True,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    opset_version: int | None = None,
) -> onnx.ModelProto:
    """``torch.onnx.export`` with the settings that keep every parameter, and torch's names recorded.

    Args:
        module: the ``torch.nn.Module`` (put it in eval mode; ``build_training_model(...,
            mode="train")`` gives BatchNorm and Dropout their training behaviour).
        args: the example inputs, positional (wrap a model taking keywords, e.g. a
            transformers model, in a module whose ``forward`` takes them in order and returns
            the logits tensor).
        path: where to write the model (small models inline; atomically).
        input_names: names of the graph inputs, one per element of ``args``.
        output_names: names of the graph outputs.
        dynamo: the dynamo exporter (``optimize=False``) or, False, TorchScript
            (``do_constant_folding=False``).
        dynamic_axes: ``{input name: {axis: dim name}}`` for sizes that vary (batch,
            sequence); default: the batch axis of every input.
        opset_version: the ai.onnx opset (default: the exporter's).

    Returns:
        The exported model, carrying the torch-name mapping in its metadata.

    Raises:
        TrainingOpError: torch is not installed, or the export failed (its message included).
    """
    try:
        import torch
    except ImportError as error:
        raise TrainingOpError("export_for_training needs torch: pip install 'onnx-training-ops[torch]'") from error
    if len(input_names) != len(args):
        raise TrainingOpError(f"export_for_training: {len(args)} example inputs but {len(input_names)} input_names")
    axes = dict(dynamic_axes) if dynamic_axes is not None else {n: {0: "batch"} for n in input_names}
    kwargs: dict[str, Any] = {"input_names": list(input_names), "output_names": list(output_names)}
    if opset_version is not None:
        kwargs["opset_version"] = opset_version
    if dynamo:
        kwargs.update(dynamo=True, optimize=False,
                      dynamic_shapes=tuple({a: torch.export.Dim.AUTO for a in axes.get(n, {})} or None
                                           for n in input_names))
    else:
        kwargs.update(dynamo=False, do_constant_folding=False, dynamic_axes={k: dict(v) for k, v in axes.items()})
    tmp = os.fspath(path) + ".export.onnx"
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            torch.onnx.export(module, tuple(args), tmp, **kwargs)
        model = onnx.load(tmp)
    except Exception as error:  # noqa: BLE001 - the exporter's own failure, told in one line
        raise TrainingOpError(f"torch.onnx.export(dynamo={dynamo}) failed: {str(error).splitlines()[0]}") from error
    finally:
        for leftover in (tmp, tmp + ".data"):
            if os.path.exists(leftover):
                os.remove(leftover)
    record_torch_names(model, module)
    _record_padding_rows(model, module)
    _warn_lost(model, module)
    save_model(model, path)
    return model


def _record_padding_rows(model: onnx.ModelProto, module: Any) -> None:
    """Record each ``nn.Embedding(padding_idx=...)``'s row under its initializer's name
    (:data:`~onnx_training_ops.builder.padding_rows.TORCH_PADDING_KEY`): the TorchScript
    export keeps nothing of it, and the builder reads it from there."""
    import torch

    tables = {f"{name}.weight" if name else "weight": m.padding_idx for name, m in module.named_modules()
              if isinstance(m, torch.nn.Embedding) and m.padding_idx is not None}
    mapping = recorded_names(model) or {}
    rows = {init: tables[t] for init, entry in mapping.items() if not entry.get("transpose")
            for t in entry["torch"] if t in tables}
    kept = [m for m in model.metadata_props if m.key != TORCH_PADDING_KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if rows:
        model.metadata_props.add(key=TORCH_PADDING_KEY, value=json.dumps(dict(sorted(rows.items()))))


def _warn_lost(model: onnx.ModelProto, module: Any) -> None:
    """Warn about parameters of ``module`` that no initializer holds (unused, or folded away)."""
    from ..training.state.torch_names import recorded_names

    kept = {name for entry in (recorded_names(model) or {}).values() for name in entry["torch"]}
    lost = [n for n, _ in module.named_parameters(remove_duplicate=False) if n not in kept]
    if lost:
        warnings.warn(f"the export holds no initializer for {len(lost)} parameter(s) of the module: "
                      f"{', '.join(lost[:8])}{' ...' if len(lost) > 8 else ''} (unused by forward, or folded "
                      "into constants): they will not train", stacklevel=3)
