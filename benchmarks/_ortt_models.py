"""onnxruntime-training on the real models of :mod:`.zoo` (runs in its own Python, loaded by
``_ortt_worker.py``; imports nothing of this package).

* **Artifacts** from the same export our contenders train: AdamW with the same
  hyper-parameters (lr 1e-4, betas 0.9/0.999, eps 1e-8, weight decay 0.01), the same
  trainable tensors (the rest frozen: BatchNorm running statistics), the same loss
  (cross-entropy; for GPT-2 the causal-LM shift, :class:`CausalLMLoss`).
* **The LayerNormalization fix, on this copy only:** onnxruntime-training 1.19's
  LayerNormalization gradient needs the optional Mean and InvStdDev outputs, which the
  TorchScript exporter leaves out (onnxruntime issue 19427). :func:`add_layernorm_outputs`
  names them on each node of the copy it builds artifacts from; the export on disk, and what
  every other contender trains, is unchanged. The number of nodes patched is reported.
"""

import os
import tempfile

LR = 1e-4
TRAIN_CONFIG = {"betas": (0.9, 0.999), "eps": 1e-8, "weight_decay": 0.01}


def add_layernorm_outputs(model) -> int:
    """Give every LayerNormalization node of ``model`` its Mean and InvStdDev outputs; the count."""
    patched = 0
    for node in model.graph.node:
        if node.op_type == "LayerNormalization" and node.domain in ("", "ai.onnx") and len(node.output) < 3:
            base = node.output[0]
            while len(node.output) < 3:
                node.output.append(f"{base}/ortt_fix_{len(node.output)}")
            patched += 1
    return patched


def causal_lm_loss():
    """An onnxblock loss: ``logits[:, :-1]`` ([B, S, V]) against ``labels[:, 1:]``, as
    transformers' causal-LM loss (classes on the last axis, flattened to [B*(S-1), V])."""
    import numpy as np
    import onnx
    from onnx import helper, numpy_helper
    from onnxruntime.training import onnxblock
    from onnxruntime.training.onnxblock import _graph_utils

    class CausalLMLoss(onnxblock.Block):
        def build(self, logits: str, labels: str = "labels"):
            graph = self.base.graph
            out = next(o for o in graph.output if o.name == logits)
            label_dims = [d.dim_value or d.dim_param for d in out.type.tensor_type.shape.dim[:-1]]
            label_info = helper.make_tensor_value_info(labels, onnx.TensorProto.INT64, label_dims)
            graph.input.append(label_info)

            def const(value):
                name = _graph_utils.generate_graph_name("causal_lm.const")
                graph.initializer.append(numpy_helper.from_array(np.asarray(value, np.int64), name))
                return name

            def node(op, inputs, **attrs):
                name = _graph_utils.generate_graph_name(f"causal_lm.{op}")
                graph.node.append(helper.make_node(op, inputs, [name], name=name, **attrs))
                return name

            one, axis1 = const([1]), const([1])
            shifted = node("Slice", [logits, const([0]), const([-1]), axis1])
            flat_logits = node("Reshape", [shifted, const([-1, out.type.tensor_type.shape.dim[-1].dim_value])])
            targets = node("Slice", [labels, one, const([2**62]), axis1])
            flat_labels = node("Reshape", [targets, const([-1])])
            loss = _graph_utils.generate_graph_name("loss")
            graph.node.append(helper.make_node(
                "SoftmaxCrossEntropyLoss", [flat_logits, flat_labels],
                [loss, _graph_utils.generate_graph_name("log_prob")], reduction="mean",
                name=_graph_utils.generate_graph_name("SoftmaxCrossEntropyLoss")))
            return loss

    return CausalLMLoss()


def build_artifacts(onnx_path: str, family: str, trainable: list, out_dir: str) -> dict:
    """Artifacts in ``out_dir`` for the export at ``onnx_path``; facts to report."""
    import onnx
    from onnxruntime.training import artifacts, onnxblock

    model = onnx.load(onnx_path)
    patched = add_layernorm_outputs(model)
    floats = [t.name for t in model.graph.initializer if t.data_type == onnx.TensorProto.FLOAT]
    frozen = [n for n in floats if n not in set(trainable)]
    loss = causal_lm_loss() if family == "gpt2" else artifacts.LossType.CrossEntropyLoss
    optimizer = onnxblock.optim.AdamW(betas=TRAIN_CONFIG["betas"], eps=TRAIN_CONFIG["eps"],
                                      weight_decay=TRAIN_CONFIG["weight_decay"])
    artifacts.generate_artifacts(model, requires_grad=list(trainable), frozen_params=frozen, loss=loss,
                                 optimizer=optimizer, artifact_directory=out_dir)
    return {"layernorm_nodes_patched": patched, "trainable": len(trainable), "frozen": len(frozen)}


def open_training(out_dir: str, threads: int, profile_prefix: str | None = None):
    """(Module, Optimizer) over the artifacts in ``out_dir``."""
    import onnxruntime
    from onnxruntime.training.api import CheckpointState, Module, Optimizer

    onnxruntime.set_default_logger_severity(3)

    def options(prefix):
        so = onnxruntime.SessionOptions()
        so.intra_op_num_threads = threads  # 0: onnxruntime's default
        if prefix:
            so.enable_profiling = True
            so.profile_file_prefix = prefix
        return so

    state = CheckpointState.load_checkpoint(os.path.join(out_dir, "checkpoint"))
    module = Module(os.path.join(out_dir, "training_model.onnx"), state, os.path.join(out_dir, "eval_model.onnx"),
                    session_options=options(profile_prefix))
    # the optimizer's session takes the module's options: with the same profile prefix both
    # sessions would write one file (named by the second) at once
    module._session_options = options(profile_prefix and profile_prefix + "_optimizer")
    optimizer = Optimizer(os.path.join(out_dir, "optimizer_model.onnx"), module)
    optimizer.set_learning_rate(LR)
    module.train()
    return module, optimizer


def model_runner(onnx_path: str, family: str, trainable: list, batches: list, threads: int,
                 profile_prefix: str | None = None):
    """``(run(steps), facts, close)``: steps cycle through ``batches`` (feed dicts)."""
    import shutil

    out_dir = tempfile.mkdtemp(prefix="ortt_model_")
    facts = build_artifacts(onnx_path, family, trainable, out_dir)
    module, optimizer = open_training(out_dir, threads, profile_prefix)
    names = module.input_names()
    feeds = [[b[n] for n in names] for b in batches]

    def run(steps):
        for i in range(steps):
            module(*feeds[i % len(feeds)])
            optimizer.step()
            module.lazy_reset_grad()

    def close():
        nonlocal module, optimizer
        del module, optimizer  # the profiles are written when the sessions end
        import gc
        gc.collect()
        shutil.rmtree(out_dir, ignore_errors=True)

    return run, facts, close
