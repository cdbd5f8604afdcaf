"""onnxruntime-training's side of ``python -m benchmarks memory --ortt-python PATH``.

Runs in *another* Python (onnxruntime-training 1.19.2: numpy < 2, onnx <= 1.16) and
imports nothing of this package: :mod:`.zoo` (specs, batches) and :mod:`.rss` (phases) are
loaded by path. ``python _ortt_memory_worker.py MODEL_PATH SPEC_JSON STEPS LR WEIGHT_DECAY``
prints one JSON line: the phases (``build``: ``generate_artifacts``; ``session``:
``CheckpointState`` + ``Module`` + ``Optimizer``; ``first_step``; ``steady``), the losses
and the steady step times.

Two changes to the export, both needed by onnxruntime-training and neither changing the
math: LayerNormalization nodes get their optional Mean and InvStdDev outputs (its gradient
builder needs them, onnxruntime issue 19427; torch does not export them), and GPT-2's
causal-LM loss is an ``onnxblock`` (logits ``[:, :-1]`` against labels ``[:, 1:]``,
flattened, ``SoftmaxCrossEntropyLoss`` mean), as the builder's ``shift_labels=True``.
"""

import importlib.util
import json
import os
import shutil
import statistics
import sys
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))


def _load(name):
    spec = importlib.util.spec_from_file_location(f"_bench_{name}", os.path.join(HERE, f"{name}.py"))
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module


zoo = _load("zoo")
rss = _load("rss")


def _with_layernorm_statistics(path, out_dir):
    """The model at ``path`` with Mean/InvStdDev outputs on every LayerNormalization, in
    ``out_dir`` (its external data linked beside it, not copied)."""
    import onnx

    model = onnx.load(path, load_external_data=False)
    for i, node in enumerate(model.graph.node):
        if node.op_type == "LayerNormalization" and len(node.output) == 1:
            node.output.extend([f"ln_mean_{i}", f"ln_inv_std_{i}"])
    for name in os.listdir(os.path.dirname(path)):
        if name.endswith(".data"):
            os.symlink(os.path.join(os.path.dirname(path), name), os.path.join(out_dir, name))
    out = os.path.join(out_dir, "model.onnx")
    onnx.save(model, out)
    return out


def _causal_lm_loss():
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper
    from onnxruntime.training import onnxblock

    class CausalLMLoss(onnxblock.Block):
        """Next-token cross-entropy: logits[:, :-1] against labels[:, 1:], mean."""

        def build(self, logits):
            g = self.base.graph
            vocab = next(o for o in g.output if o.name == logits).type.tensor_type.shape.dim[-1].dim_value
            consts = {"cl.zero": [0], "cl.one": [1], "cl.minus_one": [-1], "cl.big": [2**62],
                      "cl.flat_logits": [-1, vocab], "cl.flat_labels": [-1]}
            g.initializer.extend(numpy_helper.from_array(np.array(v, np.int64), k) for k, v in consts.items())
            g.input.append(helper.make_tensor_value_info("labels", onnx.TensorProto.INT64, ["batch", "seq"]))
            g.node.extend([
                helper.make_node("Slice", [logits, "cl.zero", "cl.minus_one", "cl.one"], ["cl.logits"]),
                helper.make_node("Slice", ["labels", "cl.one", "cl.big", "cl.one"], ["cl.labels"]),
                helper.make_node("Reshape", ["cl.logits", "cl.flat_logits"], ["cl.logits2"]),
                helper.make_node("Reshape", ["cl.labels", "cl.flat_labels"], ["cl.labels1"]),
                helper.make_node("SoftmaxCrossEntropyLoss", ["cl.logits2", "cl.labels1"], ["loss", "cl.log_prob"],
                                 reduction="mean"),
            ])
            return "loss"

    return CausalLMLoss()


def main(argv):
    path, spec_json, steps, lr, weight_decay = argv[0], argv[1], int(argv[2]), float(argv[3]), float(argv[4])
    import numpy as np
    import onnx
    import onnxruntime
    from onnxruntime.training import artifacts, onnxblock
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    onnxruntime.set_default_logger_severity(3)
    fields = json.loads(spec_json)
    spec = zoo.Spec(**{k: tuple(v) if isinstance(v, list) else v for k, v in fields.items()})
    feeds = zoo.batches(spec, min(steps, 16))
    meter = rss.Phases()
    work = tempfile.mkdtemp(prefix="ortt_memory_")
    try:
        with meter.phase("build"):
            model_path = _with_layernorm_statistics(path, work)
            graph = onnx.load(model_path, load_external_data=False).graph
            params = [t.name for t in graph.initializer
                      if t.data_type == onnx.TensorProto.FLOAT and len(t.dims) >= 1]
            del graph
            loss = _causal_lm_loss() if spec.family == "gpt2" else artifacts.LossType.CrossEntropyLoss
            out_dir = os.path.join(work, "artifacts")
            os.makedirs(out_dir)
            artifacts.generate_artifacts(model_path, requires_grad=params, loss=loss,
                                         optimizer=onnxblock.optim.AdamW(eps=1e-8, weight_decay=weight_decay),
                                         artifact_directory=out_dir)
        with meter.phase("session"):
            state = CheckpointState.load_checkpoint(os.path.join(out_dir, "checkpoint"))
            module = Module(os.path.join(out_dir, "training_model.onnx"), state,
                            os.path.join(out_dir, "eval_model.onnx"))
            optimizer = Optimizer(os.path.join(out_dir, "optimizer_model.onnx"), module)
            optimizer.set_learning_rate(lr)
            module.train()
        names = [i for i in spec.input_names] + ["labels"]
        losses, times = [], []

        def step(i):
            feed = feeds[i % len(feeds)]
            t0 = time.perf_counter()
            loss_value = module(*[feed[n] for n in names])
            optimizer.step()
            module.lazy_reset_grad()
            times.append(time.perf_counter() - t0)
            losses.append(float(np.asarray(loss_value)))

        with meter.phase("first_step"):
            step(0)
        with meter.phase("steady"):
            for i in range(1, steps):
                step(i)
        report = meter.report()
        report.update(losses=losses, first_step_s=times[0],
                      steady_step_s=statistics.median(times[1:]) if len(times) > 1 else None)
        print(json.dumps(report))
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main(sys.argv[1:])
