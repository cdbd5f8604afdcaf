"""onnxruntime-training's side of ``python -m benchmarks --ortt-python PATH``.

Runs in *another* Python (onnxruntime-training 1.19.2 needs numpy < 2 and onnx <= 1.16,
so it lives in its own virtualenv) and imports nothing of this package (its stdlib/numpy
modules ``timing``, ``dataset``, ``zoo``, ``ort_profile`` and ``_ortt_models`` by path).
Three modes:

* ``python _ortt_worker.py mlp SIZES BATCH`` (SIZES like ``64,128,10``): the MLP worker
  protocol of :mod:`.mlp`: prints ``{"ready": ...}``, then for each line ``N`` on stdin runs
  N training steps (``train_step`` + ``Optimizer.step`` + ``lazy_reset_grad``, AdamW lr
  1e-3) and prints ``{"seconds": ...}``.
* ``python _ortt_worker.py step NS MIN_TIME MAX_REPS`` (NS like ``100000,1000000``): one
  AdamW ``Optimizer.step()`` on a parameter of n float32 per size, the gradient computed
  once by a training step beforehand; prints ``{"adam/n": {"median_s", "min_s", "reps"}}``
  timed by :func:`.timing.time_step`, as the bench's own contenders.
* ``python _ortt_worker.py model ONNX SPEC_JSON TRAINABLE_JSON THREADS WARMUP_SECONDS
  [--profile STEPS]``: a real model of :mod:`.zoo` (:mod:`._ortt_models`), served as in
  ``mlp`` mode; with ``--profile``, that many profiled steps and the profile's summary
  (:mod:`.ort_profile`).
"""

import json
import os
import shutil
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from dataset import BATCHES, WARMUP_STEPS, mlp_batches  # noqa: E402  (by path: this package is not importable here)
from timing import serve, time_step, warm_up  # noqa: E402


def build(sizes, batch, out_dir):
    import numpy as np
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
    graph = helper.make_graph(nodes, "mlp",
                              [helper.make_tensor_value_info("input", TensorProto.FLOAT, ["n", sizes[0]])],
                              [helper.make_tensor_value_info("logits", TensorProto.FLOAT, ["n", sizes[-1]])], inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    artifacts.generate_artifacts(model, requires_grad=[t.name for t in inits],
                                 loss=artifacts.LossType.CrossEntropyLoss, optimizer=artifacts.OptimType.AdamW,
                                 artifact_directory=out_dir)


def build_step(n, out_dir):
    """Artifacts for ``y = w * x``, one parameter ``w`` of n float32, MSE loss, AdamW."""
    import numpy as np
    from onnx import TensorProto, helper, numpy_helper
    from onnxruntime.training import artifacts

    w = numpy_helper.from_array(np.random.default_rng(0).standard_normal(n).astype(np.float32), "w")
    graph = helper.make_graph([helper.make_node("Mul", ["w", "x"], ["y"])], "one_parameter",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [n])],
                              [helper.make_tensor_value_info("y", TensorProto.FLOAT, [n])], [w])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    artifacts.generate_artifacts(model, requires_grad=["w"], loss=artifacts.LossType.MSELoss,
                                 optimizer=artifacts.OptimType.AdamW, artifact_directory=out_dir)


def session_options():
    """onnxruntime's defaults, or the bench's pinned thread count (``threads.ENV``, set by the parent)."""
    import onnxruntime

    so = onnxruntime.SessionOptions()
    pinned = os.environ.get("ONNX_TRAINING_OPS_BENCH_THREADS")
    if pinned:
        so.intra_op_num_threads = int(pinned)
    return so


def step_main(sizes, min_time, max_reps):
    import numpy as np
    import onnxruntime
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    onnxruntime.set_default_logger_severity(3)
    out = {}
    for n in sizes:
        out_dir = tempfile.mkdtemp(prefix="ortt_step_")
        build_step(n, out_dir)
        state = CheckpointState.load_checkpoint(os.path.join(out_dir, "checkpoint"))
        module = Module(os.path.join(out_dir, "training_model.onnx"), state, os.path.join(out_dir, "eval_model.onnx"),
                        session_options=session_options())
        optimizer = Optimizer(os.path.join(out_dir, "optimizer_model.onnx"), module)
        optimizer.set_learning_rate(1e-3)
        rng = np.random.default_rng(1)
        module.train()
        module(rng.standard_normal(n).astype(np.float32), rng.standard_normal(n).astype(np.float32))  # the gradient
        out[f"adam/{n}"] = time_step(optimizer.step, min_time, max_reps)
        del optimizer, module, state
        shutil.rmtree(out_dir, ignore_errors=True)
    print(json.dumps(out))


def mlp_main(sizes, batch):
    import onnxruntime
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    onnxruntime.set_default_logger_severity(3)

    out_dir = tempfile.mkdtemp(prefix="ortt_")
    build(sizes, batch, out_dir)
    state = CheckpointState.load_checkpoint(os.path.join(out_dir, "checkpoint"))
    module = Module(os.path.join(out_dir, "training_model.onnx"), state, os.path.join(out_dir, "eval_model.onnx"),
                        session_options=session_options())
    optimizer = Optimizer(os.path.join(out_dir, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(1e-3)
    batches = mlp_batches(sizes, batch)
    module.train()

    def run(steps):
        for i in range(steps):
            module(*batches[i % BATCHES])
            optimizer.step()
            module.lazy_reset_grad()

    run(WARMUP_STEPS)
    serve(run, {"ready": "ortt"})


def model_main(onnx_path, spec_json, trainable_path, threads, warmup_seconds, profile_steps=None):
    """A real model of :mod:`.zoo` (see :mod:`._ortt_models`): serve timed steps, or with
    ``profile_steps`` run that many profiled steps and print the profile's summary."""
    import glob

    from _ortt_models import model_runner
    from ort_profile import summarize
    from zoo import Spec, batches

    fields = json.loads(spec_json)
    spec = Spec(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    with open(trainable_path) as f:
        trainable = json.load(f)
    prefix = os.path.join(tempfile.mkdtemp(prefix="ortt_profile_"), "p") if profile_steps else None
    run, facts, close = model_runner(onnx_path, spec.family, trainable, batches(spec, 16), threads, prefix)
    if not profile_steps:
        serve(run, {"ready": "ortt", "step_s": warm_up(run, min_seconds=warmup_seconds), **facts})
        close()
        return
    run(profile_steps)
    close()
    paths = glob.glob(prefix + "*.json")
    print(json.dumps({**summarize(paths), **facts}))
    shutil.rmtree(os.path.dirname(prefix), ignore_errors=True)


def main(argv):
    if argv[:1] == ["mlp"] and len(argv) == 3:
        mlp_main([int(s) for s in argv[1].split(",")], int(argv[2]))
    elif argv[:1] == ["model"] and len(argv) == 6:
        model_main(argv[1], argv[2], argv[3], int(argv[4]), float(argv[5]))
    elif argv[:1] == ["model"] and len(argv) == 8 and argv[6] == "--profile":
        model_main(argv[1], argv[2], argv[3], int(argv[4]), float(argv[5]), int(argv[7]))
    elif argv[:1] == ["step"] and len(argv) == 4:
        step_main([int(s) for s in argv[1].split(",")], float(argv[2]), int(argv[3]))
    else:
        sys.exit("usage: _ortt_worker.py mlp SIZES BATCH | step NS MIN_TIME MAX_REPS | "
                 "model ONNX SPEC_JSON TRAINABLE_JSON THREADS WARMUP_SECONDS [--profile STEPS]")


if __name__ == "__main__":
    main(sys.argv[1:])
