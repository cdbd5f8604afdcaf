"""Training smoke test for `make test-min`: build, train 50 steps, save, resume."""

import os
import tempfile

import numpy as np
import onnx
import onnxruntime

import onnx_training_ops as ot
from onnx_training_ops.demo import make_mlp

print("onnx", onnx.__version__, "onnxruntime", onnxruntime.__version__, "numpy", np.__version__)
session = ot.TrainingSession(ot.build_training_model(make_mlp((16, 32, 4), seed=1),
                                                     "cross_entropy", ot.Adam(lr=1e-2)))
rng = np.random.default_rng(0)
batch = {"input": rng.standard_normal((8, 16)).astype(np.float32),
         "labels": rng.integers(0, 4, 8).astype(np.int64)}
losses = [float(session.step(batch)["loss"]) for _ in range(50)]
assert losses[-1] < 0.1 * losses[0], losses
path = os.path.join(tempfile.mkdtemp(), "ckpt.onnx")
session.save(path)
resumed = ot.TrainingSession(path)
assert resumed.step(batch)["loss"] == session.step(batch)["loss"]
print(f"training smoke test passed: loss {losses[0]:.3f} -> {losses[-1]:.4f}, resume bit-exact")
