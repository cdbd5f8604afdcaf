"""The demo: train an MLP on scikit-learn's digits with an ONNX training model in stock onnxruntime.

``python -m onnx_training_ops train --out out/`` (also ``make demo``) builds an MLP
(64-128-10, ReLU) with ``onnx.helper``, turns it into a training model with
:func:`~onnx_training_ops.build_training_model` (cross-entropy + the chosen optimizer),
trains it with :class:`~onnx_training_ops.TrainingSession` on the 1797 8x8 digit images
that ship inside scikit-learn (no download), prints the held-out accuracy and writes to
the output folder: ``loss_curve.png`` (training loss per step and per epoch, held-out loss
per epoch), ``training_model.onnx`` (checkpoint: resumable), ``inference_model.onnx`` (the
trained weights, no training_info) and ``summary.json`` (accuracy, losses, steps/s).

Needs the ``demo`` extra: scikit-learn, tqdm, matplotlib.
"""

from __future__ import annotations

import json
import os
import sys
import time
from dataclasses import dataclass, field

import numpy as np
import onnx
from onnx import helper, numpy_helper

from .builder import build_training_model
from .optim.adagrad import Adagrad
from .optim.adam import Adam
from .optim.momentum import Momentum

DEFAULT_LR = {"adam": 2e-3, "momentum": 0.05, "adagrad": 0.05}


def make_mlp(
    sizes=(64, 128, 10),
    activation: str = "Relu",
    dtype=np.float32,
    seed: int = 0,
    input_name: str = "input",
    output_name: str = "logits",
    opset: int = 17,
) -> onnx.ModelProto:
    """An MLP inference model built with ``onnx.helper``: Gemm layers with ``activation`` between.

    Weights ``W{i}`` have shape (in, out) and are drawn like torch's ``nn.Linear``
    (uniform in +-1/sqrt(in)); biases ``b{i}`` likewise. Input ``[N, sizes[0]]``, output
    ``[N, sizes[-1]]``.
    """
    rng = np.random.default_rng(seed)
    elem = helper.np_dtype_to_tensor_dtype(np.dtype(dtype))
    nodes, inits = [], []
    x = input_name
    n_layers = len(sizes) - 1
    for i, (a, b) in enumerate(zip(sizes[:-1], sizes[1:])):
        bound = 1.0 / np.sqrt(a)
        inits.append(numpy_helper.from_array(rng.uniform(-bound, bound, (a, b)).astype(dtype), f"W{i}"))
        inits.append(numpy_helper.from_array(rng.uniform(-bound, bound, (b,)).astype(dtype), f"b{i}"))
        last = i == n_layers - 1
        z = output_name if last else f"z{i}"
        nodes.append(helper.make_node("Gemm", [x, f"W{i}", f"b{i}"], [z], name=f"layer{i}"))
        if not last:
            nodes.append(helper.make_node(activation, [z], [f"h{i}"], name=f"act{i}"))
            x = f"h{i}"
    graph = helper.make_graph(
        nodes, "mlp",
        [helper.make_tensor_value_info(input_name, elem, ["N", sizes[0]])],
        [helper.make_tensor_value_info(output_name, elem, ["N", sizes[-1]])],
        inits,
    )
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", opset)],
                              producer_name="onnx_training_ops.demo")
    model.ir_version = 10
    return model


def make_optimizer(name: str, lr: float | None = None):
    """``adam`` | ``momentum`` | ``adagrad`` with the demo's default learning rates."""
    name = name.lower()
    lr = DEFAULT_LR[name] if lr is None else lr
    if name == "adam":
        return Adam(lr=lr)
    if name == "momentum":
        return Momentum(lr=lr, momentum=0.9)
    if name == "adagrad":
        return Adagrad(lr=lr)
    raise ValueError(f"unknown optimizer {name!r}; choose adam, momentum or adagrad")


def load_digits_split(seed: int = 0, test_size: float = 0.25):
    """scikit-learn's digits, scaled to [0, 1], split stratified: (x_train, y_train, x_test, y_test)."""
    from sklearn.datasets import load_digits
    from sklearn.model_selection import train_test_split

    digits = load_digits()
    x = (digits.data / 16.0).astype(np.float32)
    y = digits.target.astype(np.int64)
    x_train, x_test, y_train, y_test = train_test_split(x, y, test_size=test_size, random_state=seed, stratify=y)
    return x_train, y_train, x_test, y_test


@dataclass
class DemoResult:
    accuracy: float
    losses: list
    seconds: float
    steps: int
    out_dir: str
    loss_curve: str | None
    training_model: str
    inference_model: str
    held_out_losses: list = field(default_factory=list)
    summary: str = ""


def train(
    out_dir: str = "out",
    epochs: int = 30,
    optimizer: str = "adam",
    lr: float | None = None,
    seed: int = 0,
    batch_size: int = 64,
    hidden: int = 128,
    progress: bool = True,
    plot: bool = True,
    verbose: bool = True,
    threads: int | None = None,
    device: str | None = None,
) -> DemoResult:
    """Train the digits MLP; write the loss curve, the checkpoint and the inference model to ``out_dir``.
    ``threads``: the session's intra-op threads (None: the package's default); ``device``: the
    session's (``"cpu"``, ``"cuda"``; None: host arrays with the fused kernels)."""
    from .training import TrainingSession

    x_train, y_train, x_test, y_test = load_digits_split(seed)
    opt = make_optimizer(optimizer, lr)
    model = build_training_model(make_mlp((64, hidden, 10), seed=seed), "cross_entropy", opt)
    session = TrainingSession(model, threads=threads, device=device)
    rng = np.random.default_rng(seed)
    n = len(x_train)
    steps_per_epoch = (n + batch_size - 1) // batch_size
    losses: list[float] = []
    # the session compiled (or loaded from numba's cache) the kernels its steps run: the clock starts now
    bar = None
    # a terminal gets a tqdm bar; a log file or CI plain lines, one per epoch (tqdm's
    # carriage-return redraws would pile up there)
    interactive = progress and sys.stderr.isatty()
    if interactive:
        from tqdm import tqdm

        bar = tqdm(total=epochs * steps_per_epoch, desc=f"training ({type(opt).__name__})",
                   unit="step")
    start = time.perf_counter()
    feeds = {}
    held_out_losses: list[float] = []
    held_out = {"input": x_test, "labels": y_test}
    for epoch in range(epochs):
        order = rng.permutation(n)
        epoch_loss = 0.0
        for i in range(steps_per_epoch):
            idx = order[i * batch_size:(i + 1) * batch_size]
            feeds["input"] = x_train[idx]
            feeds["labels"] = y_train[idx]
            loss = float(session.step(feeds)["loss"])
            losses.append(loss)
            epoch_loss += loss
            if bar is not None:
                bar.update(1)
        held_out_losses.append(float(session.evaluate(held_out)["loss"]))
        if bar is not None:
            bar.set_postfix(epoch=epoch + 1, loss=f"{epoch_loss / steps_per_epoch:.4f}")
        elif progress:
            print(f"training ({type(opt).__name__}): epoch {epoch + 1}/{epochs}, "
                  f"loss {epoch_loss / steps_per_epoch:.4f}", file=sys.stderr, flush=True)
    seconds = time.perf_counter() - start
    if bar is not None:
        bar.close()
    logits = session.run(["logits"], {"input": x_test})[0]
    accuracy = float(np.mean(np.argmax(logits, axis=1) == y_test))

    os.makedirs(out_dir, exist_ok=True)
    curve = None
    if plot:
        curve = os.path.join(out_dir, "loss_curve.png")
        plot_losses(losses, curve, steps_per_epoch, title=f"digits MLP, {type(opt).__name__}, accuracy {accuracy:.3f}",
                    held_out=held_out_losses)
    training_path = session.save(os.path.join(out_dir, "training_model.onnx"))
    inference_path = os.path.join(out_dir, "inference_model.onnx")
    session.export_inference_model(inference_path)
    summary = write_summary(out_dir, optimizer=type(opt).__name__, lr=opt.lr, epochs=epochs, batch_size=batch_size,
                            steps=len(losses), seconds=seconds, accuracy=accuracy, train_losses_per_epoch=[
                                float(np.mean(losses[i:i + steps_per_epoch]))
                                for i in range(0, len(losses), steps_per_epoch)],
                            held_out_losses_per_epoch=held_out_losses)
    result = DemoResult(accuracy, losses, seconds, len(losses), os.path.abspath(out_dir), curve,
                        os.path.abspath(training_path), os.path.abspath(inference_path), held_out_losses, summary)
    if verbose:
        print(f"held-out accuracy: {accuracy:.4f} on {len(y_test)} test images "
              f"({len(losses)} steps in {seconds:.1f} s, {len(losses) / seconds:.0f} steps/s)")
        print(f"wrote to {result.out_dir}:")
        if curve:
            print(f"  loss curve       {os.path.abspath(curve)}")
        print(f"  training model   {result.training_model}  (checkpoint: TrainingSession(path) resumes)")
        print(f"  inference model  {result.inference_model}")
        print(f"  summary          {result.summary}")
    return result


def write_summary(out_dir: str, **fields) -> str:
    """``summary.json`` in ``out_dir`` (written atomically): the run's numbers, with the
    machine's load average, since steps/s depend on it."""
    from .storage.checkpoint import atomic_write

    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    steps, seconds = fields.get("steps"), fields.get("seconds")
    extra = {"steps_per_s": steps / seconds if steps and seconds else None, "loadavg": load, "cpus": os.cpu_count()}
    path = os.path.join(out_dir, "summary.json")
    atomic_write(path, (json.dumps({**fields, **extra}, indent=1) + "\n").encode())
    return os.path.abspath(path)


def plot_losses(losses, path: str, steps_per_epoch: int | None = None, title: str = "training loss",
                held_out=(), per_epoch: bool = False) -> str:
    """Write the loss curve to ``path`` as PNG (Agg backend): the training loss per step and
    its per-epoch mean (``per_epoch``: ``losses`` are already epoch means), and ``held_out``,
    the held-out loss after each epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    epochs = np.arange(1, len(held_out) + 1)
    if per_epoch:
        ax.plot(np.arange(1, len(losses) + 1), losses, marker="o", ms=3, label="training, epoch mean")
    else:
        ax.plot(np.arange(1, len(losses) + 1), losses, lw=0.8, alpha=0.5, label="training, per step")
        if steps_per_epoch and len(losses) >= steps_per_epoch:
            k = len(losses) // steps_per_epoch
            means = np.asarray(losses[: k * steps_per_epoch]).reshape(k, steps_per_epoch).mean(axis=1)
            ax.plot(np.arange(1, k + 1) * steps_per_epoch, means, marker="o", ms=3, label="training, epoch mean")
        epochs = epochs * (steps_per_epoch or 1)
    if len(held_out):
        ax.plot(epochs, held_out, marker="s", ms=3, label="held-out, after each epoch")
    ax.set_yscale("log")
    ax.set_xlabel("epoch" if per_epoch else "step")
    ax.set_ylabel("cross-entropy loss")
    ax.set_title(title)
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path
