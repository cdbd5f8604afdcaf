"""Fine-tune a model exported by ``torch.onnx.export`` — in onnxruntime, no torch at training time.

1. a small torch CNN-free classifier is trained briefly in torch on half of scikit-learn's
   digits and exported to ONNX (``dynamo=False``: the TorchScript exporter, no onnxscript);
2. :func:`onnx_training_ops.build_training_model` turns the exported model into a training
   model (cross-entropy, Adam); :class:`onnx_training_ops.TrainingSession` fine-tunes it on
   the other half;
3. the fine-tuned inference model is exported and checked in plain onnxruntime.

Run: ``python examples/finetune_torch_export.py [OUT_DIR]``.
"""

from __future__ import annotations

import os
import sys
import tempfile
import warnings

import numpy as np
import onnxruntime as ort
import torch

from onnx_training_ops import Adam, TrainingSession, build_training_model
from onnx_training_ops.demo import load_digits_split


def accuracy(logits: np.ndarray, labels: np.ndarray) -> float:
    return float(np.mean(np.argmax(logits, axis=1) == labels))


def main(out_dir: str | None = None, epochs: int = 10) -> dict:
    out_dir = out_dir or tempfile.mkdtemp(prefix="finetune_")
    os.makedirs(out_dir, exist_ok=True)
    x_train, y_train, x_test, y_test = load_digits_split(seed=0)
    half = len(x_train) // 2

    # 1. pretrain a little in torch, export
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 10))
    opt = torch.optim.SGD(net.parameters(), lr=0.05)
    for _ in range(3):
        for i in range(0, half, 64):
            opt.zero_grad()
            loss = torch.nn.functional.cross_entropy(net(torch.from_numpy(x_train[i:i + 64])),
                                                     torch.from_numpy(y_train[i:i + 64]))
            loss.backward()
            opt.step()
    exported = os.path.join(out_dir, "exported.onnx")
    with warnings.catch_warnings():  # the TorchScript exporter is deprecated, and the one installed
        warnings.simplefilter("ignore", DeprecationWarning)
        torch.onnx.export(
            net, (torch.zeros(1, 64),), exported, input_names=["pixels"], output_names=["logits"],
            dynamic_axes={"pixels": {0: "batch"}, "logits": {0: "batch"}}, dynamo=False,
        )
    before = accuracy(ort.InferenceSession(exported, providers=["CPUExecutionProvider"])
                      .run(None, {"pixels": x_test})[0], y_test)

    # 2. fine-tune the exported model in onnxruntime
    session = TrainingSession(build_training_model(exported, "cross_entropy", Adam(lr=2e-3)))
    rng = np.random.default_rng(0)
    x_ft, y_ft = x_train[half:], y_train[half:]
    for _ in range(epochs):
        order = rng.permutation(len(x_ft))
        for i in range(0, len(order), 32):
            idx = order[i:i + 32]
            session.step({"pixels": x_ft[idx], "labels": y_ft[idx]})
    after = accuracy(session.run(["logits"], {"pixels": x_test})[0], y_test)

    # 3. the fine-tuned inference model
    path = os.path.join(out_dir, "finetuned.onnx")
    session.export_inference_model(path)
    check = accuracy(ort.InferenceSession(path, providers=["CPUExecutionProvider"])
                     .run(None, {"pixels": x_test})[0], y_test)
    print(f"trainable tensors: {session.metadata['trainable']}")
    print(f"held-out accuracy: exported {before:.3f} -> fine-tuned {after:.3f} (plain onnxruntime: {check:.3f})")
    print(f"fine-tuned inference model: {path}")
    return {"before": before, "after": after, "exported_check": check, "path": path}


if __name__ == "__main__":
    main(sys.argv[1] if len(sys.argv) > 1 else None)
