"""The real-model benchmark's contenders in this package's Python: ours (fast path and
``fast=False``), torch eager and ``torch.compile``. onnxruntime-training runs in its own
Python (:mod:`._ortt_models`).

Every contender trains the model of a :class:`.zoo.Spec` with AdamW (lr 1e-4, betas
0.9/0.999, eps 1e-8, weight decay 0.01) on the same cycle of :func:`.zoo.batches`, with
``threads`` intra-op threads (0: each one's own default; ours picks one thread for a small
model). ``runner(...)`` returns ``run(steps)`` and facts to report.
"""

from __future__ import annotations

import glob
import os
import tempfile
from collections.abc import Callable

from . import zoo
from .ort_profile import summarize

LR = 1e-4
BETAS = (0.9, 0.999)
EPS = 1e-8
WEIGHT_DECAY = 0.01
BATCHES = 16

CONTENDERS = {
    "ours_fast": "ours: TrainingSession, fast path",
    "ours_graph": "ours: TrainingSession(fast=False)",
    "ours_lean": "ours: fast path, no arena / memory pattern / prepacking",
    "torch_eager": "torch eager, AdamW (foreach)",
    "torch_compile": "torch.compile, AdamW (foreach)",
}


def training_model(spec: zoo.Spec, cache: str | None = None, precision: str = "fp32"):
    """Our training model of ``spec``'s export (AdamW as above; ``precision``: mixed precision)."""
    import onnx

    from onnx_training_ops.builder import AdamW, build_training_model

    model = onnx.load(zoo.export(spec, cache))
    return build_training_model(model, zoo.loss(spec), AdamW(lr=LR, betas=BETAS, eps=EPS,
                                                            weight_decay=WEIGHT_DECAY), mode=spec.mode,
                                precision=precision)


def ours(spec: zoo.Spec, fast: bool, threads: int, cache: str | None = None,
         profile_prefix: str | None = None, lean: bool = False):
    """``(run, facts, session)`` for our TrainingSession; ``lean``: with the large-model
    session options (:data:`onnx_training_ops.training.options.options.LARGE_MODEL_OPTIONS`)."""
    import onnxruntime as ort

    from onnx_training_ops.runtime.options import default_intra_op_threads
    from onnx_training_ops.training import TrainingSession
    from onnx_training_ops.training.options.options import apply_memory_options

    training = training_model(spec, cache)
    if not threads:  # our own default (what a TrainingSession without options picks)
        threads = default_intra_op_threads(sum(a.size for a in _trainable_arrays(training)))
    so = ort.SessionOptions()
    so.intra_op_num_threads = threads
    apply_memory_options(so, large=lean)  # what a session without sess_options gets (lean: a large model's)
    if profile_prefix:
        so.enable_profiling = True
        so.profile_file_prefix = profile_prefix
    session = TrainingSession(training, fast=fast, sess_options=so)
    feeds = zoo.batches(spec, BATCHES)
    step = session.step

    def run(steps: int) -> None:
        for i in range(steps):
            step(feeds[i % BATCHES])

    return run, {"trainable": len(trainable_names(training))}, session


def _trainable_arrays(training):
    from onnx import numpy_helper

    names = set(trainable_names(training))
    return [numpy_helper.to_array(t) for t in training.graph.initializer if t.name in names]


def trainable_names(training) -> list[str]:
    """The tensors one of our training models trains (the other contenders train the same)."""
    from onnx_training_ops.builder import metadata

    return [n for n in metadata(training).get("trainable", "").split(",") if n]


def torch_runner(spec: zoo.Spec, compiled: bool, threads: int) -> Callable[[int], None]:
    """torch eager (or ``torch.compile``d) training steps, AdamW as above."""
    import torch

    if threads:  # 0: torch's own default
        torch.set_num_threads(threads)
    module = zoo.torch_model(spec)
    forward = torch.compile(module) if compiled else module
    opt = torch.optim.AdamW(module.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WEIGHT_DECAY)
    tensors = [{k: torch.from_numpy(v) for k, v in b.items()} for b in zoo.batches(spec, BATCHES)]
    names = spec.input_names

    def run(steps: int) -> None:
        for i in range(steps):
            b = tensors[i % BATCHES]
            opt.zero_grad()
            zoo.torch_loss(spec, forward(*[b[n] for n in names]), b["labels"]).backward()
            opt.step()

    return run


def runner(contender: str, spec: zoo.Spec, threads: int, cache: str | None = None):
    """``(run(steps), facts)`` for ``contender`` (a key of :data:`CONTENDERS`)."""
    if contender in ("ours_fast", "ours_graph", "ours_lean"):
        run, facts, session = ours(spec, contender != "ours_graph", threads, cache, lean=contender == "ours_lean")
        return run, facts
    if contender in ("torch_eager", "torch_compile"):
        return torch_runner(spec, contender == "torch_compile", threads), {}
    raise KeyError(f"unknown contender {contender!r}; known: {', '.join(CONTENDERS)}")


def profile_ours(spec: zoo.Spec, fast: bool, threads: int, steps: int, cache: str | None = None) -> dict:
    """Run ``steps`` profiled steps of ours; the profile's summary (:func:`.ort_profile.summarize`)."""
    prefix = os.path.join(tempfile.mkdtemp(prefix="ours_profile_"), "p")
    run, facts, session = ours(spec, fast, threads, cache, prefix)
    run(steps)
    out = {**summarize(session.end_profiling()), **facts}
    for p in glob.glob(prefix + "*"):
        os.remove(p)
    os.rmdir(os.path.dirname(prefix))
    return out
