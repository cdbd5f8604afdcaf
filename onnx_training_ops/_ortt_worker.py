"""onnxruntime-training's MLP step, for ``python -m onnx_training_ops bench --ortt-python PATH``.

Runs in *another* Python (onnxruntime-training 1.19.2 needs numpy < 2 and onnx <= 1.16,
so it lives in its own virtualenv) and imports nothing of this package. Speaks the bench's
worker protocol: prints ``{"ready": ...}``, then for each line ``N`` on stdin runs N training
steps (``train_step`` + ``Optimizer.step`` + ``lazy_reset_grad``, AdamW lr 1e-3) and prints
``{"seconds": ...}``.

Usage: ``python _ortt_worker.py SIZES BATCH`` (SIZES like ``64,128,10``).
"""

import json
import os
import sys
import tempfile
import time


def build(sizes, batch, out_dir):
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.training import artifacts

    rng = np.random.default_rng(0)
    nodes, inits, prev = [], [], "input"
    for i, (fan_in, fan_out) in enumerate(zip(sizes[:-1], sizes[1:])):
        bound = 1 / np.sqrt(fan_in)
        inits += [numpy_helper.from_array(rng.uniform(-bound, bound, (fan_in, fan_out)).astype(np.float32), f"W{i}"),
                  numpy_helper.from_array(rng.uniform(-bound, bound, fan_out).astype(np.float32), f"b{i}")]
        out = "logits" if i == len(sizes) - 2 else f"h{i}"
        nodes.append(helper.make_node("Gemm", [prev, f"W{i}", f"b{i}"], [out if out == "logits" else f"z{i}"]))
        if out != "logits":
            nodes.append(helper.make_node("Relu", [f"z{i}"], [out]))
        prev = out
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", sizes[0]])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", sizes[-1]])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in inits],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=out_dir)


def main():
    sizes = [int(s) for s in sys.argv[1].split(",")]
    batch = int(sys.argv[2])
    import numpy as np
    import onnxruntime
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    onnxruntime.set_default_logger_severity(3)

    out_dir = tempfile.mkdtemp(prefix="ortt_")
    build(sizes, batch, out_dir)
    state = CheckpointState.load_checkpoint(os.path.join(out_dir, "checkpoint"))
    module = Module(os.path.join(out_dir, "training_model.onnx"), state, os.path.join(out_dir, "eval_model.onnx"))
    optimizer = Optimizer(os.path.join(out_dir, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(1e-3)
    rng = np.random.default_rng(0)
    x = rng.standard_normal((batch, sizes[0])).astype(np.float32)
    y = rng.integers(0, sizes[-1], batch).astype(np.int64)
    module.train()

    def run(steps):
        for _ in range(steps):
            module(x, y)
            optimizer.step()
            module.lazy_reset_grad()

    run(50)
    print(json.dumps({"ready": "ortt"}), flush=True)
    for line in sys.stdin:
        steps = int(line)
        t0 = time.perf_counter()
        run(steps)
        print(json.dumps({"seconds": time.perf_counter() - t0}), flush=True)


if __name__ == "__main__":
    main()
