"""Recipe: train a torch.nn CNN with BatchNorm in train mode (a small ResNet-style network).

torchvision's C ops do not load beside the CPU torch of this project's environment, so the
network is plain ``torch.nn``: a stem convolution, two residual blocks (Conv-BN-ReLU-Conv-BN
plus the shortcut), global average pooling and a Linear head; a torchvision model exports
the same way.

Export the module in **eval** mode (``module.eval()``: BatchNorm reads its running
statistics, which both exporters keep as initializers) and build with ``mode="train"``: the
step then runs a training-mode copy of the forward pass, BatchNorm on batch statistics with
the running statistics updated as state (momentum 0.1, unbiased variance, as torch), while
the main graph stays the eval-mode graph for inference. The loss of the first step equals
``module.train()``'s, and so do the running statistics after it.

Run: ``python examples/recipes/cnn.py [--exporter dynamo|torchscript]``.
"""

from __future__ import annotations

import os
import tempfile

import numpy as np
from _common import export_and_build, parser, perturbed

from onnx_training_ops import Momentum, TrainingSession


def make_model(classes: int = 10, width: int = 8):
    """A small ResNet-style ``torch.nn`` network (seed 0), BatchNorm parameters perturbed to be distinct."""
    import torch
    from torch import nn

    class Block(nn.Module):
        def __init__(self, c):
            super().__init__()
            self.conv1, self.bn1 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)
            self.conv2, self.bn2 = nn.Conv2d(c, c, 3, padding=1, bias=False), nn.BatchNorm2d(c)

        def forward(self, x):
            return torch.relu(x + self.bn2(self.conv2(torch.relu(self.bn1(self.conv1(x))))))

    class SmallResNet(nn.Module):
        def __init__(self):
            super().__init__()
            self.stem, self.bn = nn.Conv2d(3, width, 3, padding=1, bias=False), nn.BatchNorm2d(width)
            self.blocks = nn.Sequential(Block(width), Block(width))
            self.head = nn.Linear(width, classes)

        def forward(self, x):
            x = self.blocks(torch.relu(self.bn(self.stem(x))))
            return self.head(x.mean(dim=(2, 3)))

    torch.manual_seed(0)
    return perturbed(SmallResNet(), 0.1, where=lambda name: "bn" in name)


def main(exporter: str = "dynamo", steps: int = 3, out_dir: str | None = None) -> dict:
    """Export (eval), build (mode="train"), train; return losses, torch's train-mode loss and statistics."""
    import torch

    out_dir = out_dir or tempfile.mkdtemp(prefix="recipe_cnn_")
    model = make_model()
    rng = np.random.default_rng(0)
    x = rng.normal(size=(8, 3, 16, 16)).astype(np.float32)
    y = rng.integers(0, 10, 8).astype(np.int64)
    reference = make_model().train()  # the same weights: torch's training-mode step of the same batch
    torch_loss = torch.nn.functional.cross_entropy(reference(torch.from_numpy(x)), torch.from_numpy(y))
    path = os.path.join(out_dir, "model.onnx")
    training = export_and_build(model, {"images": x}, path, exporter, "cross_entropy",
                                Momentum(lr=0.05, momentum=0.9), sequence=False, mode="train")
    session = TrainingSession(training)
    losses = [float(session.step({"images": x, "labels": y})["loss"])]
    statistics = session.to_torch_state_dict(tensors=False)  # running statistics after one step
    losses += [float(session.step({"images": x, "labels": y})["loss"]) for _ in range(steps - 1)]
    print(f"cnn ({exporter}): {session.summary().trainable_count:,} parameters trained; torch's train-mode loss "
          f"{float(torch_loss.detach()):.6f}, ours {losses[0]:.6f}; after {steps} steps {losses[-1]:.6f}")
    return {"losses": losses, "torch_loss": float(torch_loss.detach()), "session": session, "path": path,
            "torch_state_after_one_step": {k: v.detach().numpy() for k, v in reference.state_dict().items()},
            "state_after_one_step": statistics, "feeds": {"images": x}}


if __name__ == "__main__":
    a = parser(__doc__).parse_args()
    main(a.exporter, a.steps)
