"""What the recipes share: distinct random weights, the logits wrapper both exporters take, export then
build, and the command line."""

from __future__ import annotations

import argparse
import warnings
from collections.abc import Callable

import numpy as np
import onnx

from onnx_training_ops import build_training_model
from onnx_training_ops.export.from_torch import export_for_training


def perturbed(model, scale: float = 0.02, where: Callable[[str], bool] = lambda name: True):
    """``model`` in eval mode, ``N(0, scale^2)`` noise (torch's global generator) added to each parameter
    ``where`` accepts by name: fresh LayerNorm/BatchNorm weights of 1 and zero biases would be equal tensors."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if where(name):
                p.add_(torch.randn_like(p) * scale)
    return model.eval()


def wrap(model):
    """A module with ``forward(input_ids, attention_mask, token_type_ids=None) -> logits``: keyword inputs in,
    one tensor out, what both exporters take (transformers' models return a ModelOutput)."""
    import torch

    class Wrapped(torch.nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.model = inner

        def forward(self, input_ids, attention_mask, token_type_ids=None):
            types = {} if token_type_ids is None else {"token_type_ids": token_type_ids}
            return self.model(input_ids=input_ids, attention_mask=attention_mask, **types).logits

    return Wrapped(model)


def export_and_build(module, inputs: dict[str, np.ndarray], path: str, exporter: str, loss, optimizer,
                     sequence: bool = True, **build) -> onnx.ModelProto:
    """Export ``module`` on ``inputs`` (in its forward's order) to ``path`` with ``export_for_training``, then
    :func:`build_training_model` on the ``logits`` output.

    Args:
        module: the torch module (in eval mode).
        inputs: the sample inputs, by the names the ONNX inputs take.
        path: where the inference model is written.
        exporter: ``"dynamo"`` or ``"torchscript"``.
        loss: the loss of :func:`build_training_model`.
        optimizer: the optimizer of :func:`build_training_model`.
        sequence: every input's axes 0 and 1 are dynamic (batch, seq); False: static shapes.
        **build: more keyword arguments of :func:`build_training_model` (``trainable``, ``mode``).

    Returns:
        The training model.
    """
    import torch

    export_for_training(module, tuple(torch.from_numpy(v) for v in inputs.values()), path,
                        input_names=list(inputs), output_names=["logits"], dynamo=exporter == "dynamo",
                        dynamic_axes={k: {0: "batch", 1: "seq"} for k in inputs} if sequence else None)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # TorchScript: "untied N parameters the exporter merged" (equal tensors)
        return build_training_model(path, loss, optimizer, **build)


def parser(doc: str) -> argparse.ArgumentParser:
    """The recipe's command line: ``--exporter dynamo|torchscript``, ``--steps N``; its description the
    first line of ``doc``."""
    ap = argparse.ArgumentParser(description=doc.splitlines()[0])
    ap.add_argument("--exporter", choices=("dynamo", "torchscript"), default="dynamo")
    ap.add_argument("--steps", type=int, default=3)
    return ap
