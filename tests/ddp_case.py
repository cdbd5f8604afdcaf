"""The model and batches shared by the data-parallel tests and their worker processes."""

from __future__ import annotations

import os

import numpy as np

from onnx_training_ops import Adam, build_training_model
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.schedules import StepLR

SIZES, BATCH = (8, 16, 4), 16


def open_session(model, engine: str):
    """``model`` on ``engine``: ``host`` (fused kernels on host arrays), ``cpu`` (``device="cpu"``:
    the update in the graph, host arrays), ``device`` (the same with the state in OrtValues
    onnxruntime allocated, as on a GPU: a private option) or ``cuda`` (``cuda:LOCAL_RANK``)."""
    from onnx_training_ops import TrainingSession

    if engine == "host":
        return TrainingSession(model)
    if engine == "cuda":  # TF32 off: float32 parity with the CPU
        import torch

        gpu = int(os.environ.get("LOCAL_RANK", 0)) % torch.cuda.device_count()
        return TrainingSession(model, [("CUDAExecutionProvider", {"device_id": gpu, "use_tf32": "0"}),
                                       "CPUExecutionProvider"])
    if engine == "cpu":
        return TrainingSession(model, device="cpu")
    from onnx_training_ops.training.engine import checked_config  # OrtValues on the CPU: a private option

    config = checked_config(["CPUExecutionProvider"], None, "raise", None, None, None, "cpu", 0, None, None, None,
                            "device")
    return TrainingSession._opened(model, config)


def training_model(dtype=np.float64, clip: bool = True):
    """An MLP with Adam, gradient clipping (unless ``clip`` is false) and a StepLR schedule."""
    from onnx_training_ops import TrainingSession

    model = build_training_model(make_mlp(SIZES, activation="Tanh", dtype=dtype, seed=3), "cross_entropy",
                                 Adam(lr=1e-2), clip_grad_norm=1.0 if clip else None)
    session = TrainingSession(model)
    session.set_lr_schedule(StepLR(step_size=5, gamma=0.5))
    return session.training_model()


def batch(k: int, dtype=np.float64) -> tuple[np.ndarray, np.ndarray]:
    """Global batch number ``k``."""
    rng = np.random.default_rng(1000 + k)
    return rng.standard_normal((BATCH, SIZES[0])).astype(dtype), rng.integers(0, SIZES[-1], BATCH).astype(np.int64)


def batchnorm_training_model():
    """Linear -> BatchNorm1d -> Tanh -> Linear from torch (float32), mode="train": BatchNorm
    running statistics are per-rank state (buffers)."""
    import io
    import warnings

    import onnx
    import torch

    torch.manual_seed(0)
    module = torch.nn.Sequential(torch.nn.Linear(SIZES[0], SIZES[1]), torch.nn.BatchNorm1d(SIZES[1]),
                                 torch.nn.Tanh(), torch.nn.Linear(SIZES[1], SIZES[2]))
    f = io.BytesIO()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(module.eval(), (torch.zeros(BATCH, SIZES[0]),), f, dynamo=False, opset_version=17,
                          do_constant_folding=False, input_names=["input"], output_names=["logits"],
                          dynamic_axes={"input": {0: "N"}})
    return build_training_model(onnx.load_from_string(f.getvalue()), "cross_entropy", Adam(lr=1e-2), mode="train")


TABLE_ROWS, TABLE_DIM, LOOKUPS = 30, 4, 3


def embedding_training_model():
    """y = (sum_k E[ids[:, k]]) @ W, MSE, lazy Adam on the table E (only looked-up rows change)."""
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(0)
    graph = helper.make_graph(
        [helper.make_node("Gather", ["E", "ids"], ["e"], axis=0),
         helper.make_node("ReduceSum", ["e", "axis1"], ["s"], keepdims=0),
         helper.make_node("MatMul", ["s", "W"], ["y"])],
        "embedding", [helper.make_tensor_value_info("ids", TensorProto.INT64, ["B", LOOKUPS])],
        [helper.make_tensor_value_info("y", TensorProto.DOUBLE, ["B", 1])],
        [numpy_helper.from_array(rng.standard_normal((TABLE_ROWS, TABLE_DIM)), "E"),
         numpy_helper.from_array(rng.standard_normal((TABLE_DIM, 1)), "W"),
         numpy_helper.from_array(np.array([1], np.int64), "axis1")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    onnx.checker.check_model(model)
    return build_training_model(model, "mse", Adam(lr=1e-2), sparse_updates={"E": "lazy"})


def embedding_batch(k: int) -> dict[str, np.ndarray]:
    """Global batch ``k``: ids below TABLE_ROWS - 10 (the last rows are never touched)."""
    rng = np.random.default_rng(2000 + k)
    return {"ids": rng.integers(0, TABLE_ROWS - 10, (BATCH, LOOKUPS)).astype(np.int64),
            "target": rng.standard_normal((BATCH, 1))}
