"""``onnx-training-ops train TRAINING.onnx --data FILE --out DIR``: train a training model on a data file.

Each epoch shuffles the samples (the order depends on ``--seed`` and the epoch only), steps
through them in batches of ``--batch-size`` (the last one smaller), evaluates ``--eval-data``
if given, then writes to ``--out``, in this order (each file atomically):

* ``metrics.jsonl``: one JSON object per epoch (``epoch``, ``steps``, ``train_loss``,
  ``eval_loss``, ``lr``, ``seconds``);
* ``loss_curve.png``: training (and held-out) loss per epoch (matplotlib, the demo extra);
* ``checkpoint.onnx``: the training model with its state, the epoch and the run's settings
  (the session's ``properties``) and the schedule's position. A second run with the same
  ``--out`` continues from it (dropping log rows past its epoch): the same result as one
  long run.

At the end, ``inference_model.onnx``: the trained weights without training_info.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import sys
import time
from collections.abc import Mapping

import numpy as np

from ..errors import TrainingOpError
from ..storage.checkpoint import atomic_write
from .data import match_feeds, read_table
from .progress import progress_bar

CHECKPOINT, METRICS, CURVE, INFERENCE = "checkpoint.onnx", "metrics.jsonl", "loss_curve.png", "inference_model.onnx"


def parse_schedule(text: str, total_steps: int):
    """``NAME[:key=value,...]`` -> a schedule of :mod:`onnx_training_ops.schedules`.

    Args:
        text: ``cosine``, ``linear``, ``step:step_size=100,gamma=0.5``, ``exponential:gamma=0.99``,
            ``warmup_cosine:warmup_steps=50``, ``warmup_linear:warmup_steps=50``,
            ``onecycle:max_lr=0.01`` (torch's argument names).
        total_steps: the run's optimizer steps: the default of ``T_max``, ``total_steps``, ``total_iters``.

    Returns:
        The schedule object.

    Raises:
        TrainingOpError: an unknown name, a malformed or unknown argument.
    """
    from .. import schedules

    kinds = {"cosine": (schedules.CosineAnnealingLR, "T_max"), "linear": (schedules.LinearLR, "total_iters"),
             "step": (schedules.StepLR, None), "exponential": (schedules.ExponentialLR, None),
             "warmup_cosine": (schedules.WarmupCosineLR, "total_steps"),
             "warmup_linear": (schedules.WarmupLinearLR, "total_steps"),
             "onecycle": (schedules.OneCycleLR, "total_steps")}
    name, _, rest = text.partition(":")
    if name not in kinds:
        raise TrainingOpError(f"--schedule {text!r}: expected one of {', '.join(kinds)} (then :key=value,...)")
    cls, total = kinds[name]
    kwargs: dict = {total: total_steps} if total else {}
    for item in filter(None, rest.split(",")):
        key, eq, value = item.partition("=")
        if not eq:
            raise TrainingOpError(f"--schedule {text!r}: expected key=value, found {item!r}")
        try:
            kwargs[key.strip()] = int(value) if value.strip().lstrip("-").isdigit() else float(value)
        except ValueError as error:
            raise TrainingOpError(f"--schedule {text!r}: {key} must be a number, found {value!r}") from error
    try:
        return cls(**kwargs)
    except TypeError as error:
        raise TrainingOpError(f"--schedule {text!r}: {error}") from error


def _batches(n: int, batch_size: int, seed: int, epoch: int):
    order = np.random.default_rng([seed, epoch]).permutation(n)
    return [order[i:i + batch_size] for i in range(0, n, batch_size)]


def _evaluate(session, data: Mapping[str, np.ndarray]) -> float:
    """The held-out loss, in one ``evaluate`` call (TrainingSession.evaluate on batches of
    changing size fails on main today: one size each epoch keeps it working)."""
    return float(session.evaluate(data)["loss"])


def _read_metrics(path: str, done: int) -> list[dict]:
    """The log's rows up to epoch ``done`` (a crash after the log, before the checkpoint, left
    later ones). The log only reports: a damaged one (edited, cut short, not text) never stops a
    resume. Its readable rows are kept, the file as found is copied to ``metrics.jsonl.damaged``
    and one line on stderr says so."""
    if not os.path.exists(path):
        return []
    with open(path, "rb") as f:
        raw = f.read()
    rows, bad = [], []
    for number, line in enumerate(raw.splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:  # JSONDecodeError, or bytes that are not UTF-8
            row = None
        if isinstance(row, dict) and isinstance(row.get("epoch"), int) and isinstance(row.get("train_loss"), float):
            rows.append(row)
        else:
            bad.append(number)
    if bad:
        atomic_write(path + ".damaged", raw)
        print(f"warning: {path}: line(s) {', '.join(map(str, bad[:5]))}{'...' if len(bad) > 5 else ''} are not "
              f"rows this command wrote; the run resumes from its checkpoint all the same (the file as found: "
              f"{path}.damaged)", file=sys.stderr)
    return [r for r in rows if r["epoch"] <= done]


def _plot(path: str, rows: list[dict]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4))
    epochs = [r["epoch"] for r in rows]
    ax.plot(epochs, [r["train_loss"] for r in rows], marker="o", label="training loss")
    if any(r.get("eval_loss") is not None for r in rows):
        ax.plot(epochs, [r["eval_loss"] for r in rows], marker="o", label="held-out loss")
    ax.set_xlabel("epoch")
    ax.set_ylabel("loss")
    ax.legend()
    fig.tight_layout()
    buffer = io.BytesIO()
    fig.savefig(buffer, format="png")
    plt.close(fig)
    atomic_write(path, buffer.getvalue())


def _run_settings(args: argparse.Namespace, samples: int | None) -> dict:
    """What a resumed run must share with the first (kept in the checkpoint's properties)."""
    settings = {"cli.batch_size": args.batch_size, "cli.seed": args.seed}
    return settings if samples is None else {**settings, "cli.samples": samples}


def _open(args: argparse.Namespace):
    """The session: the checkpoint in --out when there is one (checked against this run), else the model."""
    from ..training import TrainingSession

    checkpoint = os.path.join(args.out, CHECKPOINT)
    resumed = os.path.exists(checkpoint)
    # --threads: 0 is onnxruntime's default, one per core; None the package's default
    session = TrainingSession(checkpoint if resumed else args.model, threads=args.threads, device=args.device)
    if resumed:
        props = session.properties
        for key, value in _run_settings(args, None).items():
            if props.get(key) != value:
                raise TrainingOpError(f"{checkpoint} was written by a run with --{key[4:].replace('_', '-')} "
                                      f"{props.get(key)}, this run asks {value}: use another --out to start afresh")
        sized = props.get("cli.schedule_epochs")
        if sized is not None and sized != args.epochs:
            raise TrainingOpError(f"{checkpoint}: its learning-rate schedule was sized for --epochs {sized}, this run "
                                  f"asks {args.epochs}: rerun with --epochs {sized}, or use another --out")
        if args.schedule and props.get("cli.schedule") != args.schedule:
            raise TrainingOpError(f"{checkpoint} was written with --schedule {props.get('cli.schedule')}, this run "
                                  f"asks {args.schedule}: the checkpoint keeps its schedule; use another --out")
    return session, resumed


def train_model(args: argparse.Namespace) -> int:
    """The ``train TRAINING.onnx`` command (see the module docstring).

    Args:
        args: the parsed command line.

    Returns:
        The exit status (0).

    Raises:
        TrainingOpError: bad data, model or options (exit status 2).
    """
    _check_options(args)
    plot = _plots(args)
    # the data read and checked first: a bad file fails before the session opens (and compiles)
    table = read_table(args.data)
    eval_table = read_table(args.eval_data) if args.eval_data else None
    session, resumed = _open(args)
    labels = session.metadata.get("labels")
    rates = set(session.learning_rates)  # --lr/--schedule set them, never a data column
    data = match_feeds(table(labels), [f for f in session.feeds if f.name not in rates], args.data)
    eval_data = None
    if eval_table is not None:
        eval_data = match_feeds(eval_table(labels), session.eval_feeds(), args.eval_data)
    n = len(next(iter(data.values())))
    checkpoint, inference = os.path.join(args.out, CHECKPOINT), os.path.join(args.out, INFERENCE)
    steps_per_epoch = -(-n // args.batch_size)
    done = _epochs_done(session, resumed, n, checkpoint, args.data)
    if not resumed and args.schedule:
        session.set_lr_schedule(parse_schedule(args.schedule, args.epochs * steps_per_epoch))
    os.makedirs(args.out, exist_ok=True)
    metrics_path = os.path.join(args.out, METRICS)
    rows = _read_metrics(metrics_path, done)
    if done == args.epochs and not _is_current(inference, session):  # stopped after its last checkpoint
        session.export_inference_model(inference)
        print(f"{checkpoint} already holds all {done} epoch(s): wrote {inference}, which the interrupted run had "
              "not written")
        return 0
    if done >= args.epochs:  # no silent no-op (as the data-parallel demo)
        raise TrainingOpError(f"{checkpoint} already holds {done} epoch(s) and --epochs is "
                              f"{args.epochs}: nothing to train (raise --epochs, or use another --out)")
    if resumed:
        print(f"resuming from {checkpoint} after epoch {done}", file=sys.stderr)
    bar = None if args.no_progress else progress_bar((args.epochs - done) * steps_per_epoch, "training")
    try:
        for epoch in range(done + 1, args.epochs + 1):
            start, losses = time.perf_counter(), []
            lr = next(iter(session.learning_rates.values()), None) if args.lr is None else args.lr
            for idx in _batches(n, args.batch_size, args.seed, epoch):
                losses.append(float(session.step({k: v[idx] for k, v in data.items()}, lr=args.lr)["loss"]))
                if bar is not None:
                    bar.update(1)
            row = {"epoch": epoch, "steps": epoch * steps_per_epoch, "train_loss": float(np.mean(losses)),
                   "eval_loss": _evaluate(session, eval_data) if eval_data else None,
                   "lr": lr, "seconds": round(time.perf_counter() - start, 3)}
            if bar is not None:
                bar.set_postfix(epoch=epoch, loss=f"{row['train_loss']:.4f}")
            else:
                print(json.dumps(row), file=sys.stderr)
            rows.append(row)  # the log first: a resumed run drops rows past its checkpoint's epoch
            atomic_write(metrics_path, "".join(json.dumps(r) + "\n" for r in rows).encode())
            if plot:
                _plot(os.path.join(args.out, CURVE), rows)
            session.properties.update({"epoch": epoch, **_run_settings(args, n)})
            if args.schedule and not resumed:
                session.properties.update({"cli.schedule": args.schedule, "cli.schedule_epochs": args.epochs})
            session.save(checkpoint)
        if bar is not None:
            bar.close()
        session.export_inference_model(inference)
    except KeyboardInterrupt:
        if bar is not None:
            bar.close()
        raise KeyboardInterrupt(f"the same command resumes from {checkpoint}" if os.path.exists(checkpoint)
                                else "no checkpoint was written yet: the same command starts again") from None
    last = rows[-1]
    print(f"trained {args.epochs} epoch{'' if args.epochs == 1 else 's'}: training loss {last['train_loss']:.4f}"
          + (f", held-out loss {last['eval_loss']:.4f}" if last["eval_loss"] is not None else "")
          + f"; wrote {os.path.join(args.out, '')}{{{CHECKPOINT}, {METRICS}, {INFERENCE}"
          + ("" if not plot else f", {CURVE}") + "}")
    return 0


def _epochs_done(session, resumed: bool, n: int, checkpoint: str, data: str) -> int:
    """The epochs the checkpoint holds (0 when starting afresh); a TrainingOpError when it was
    trained on another number of samples."""
    if not resumed:
        return 0
    if session.properties.get("cli.samples", n) != n:
        raise TrainingOpError(f"{checkpoint} was trained on {session.properties['cli.samples']} "
                              f"samples, --data {data} holds {n}: use another --out to start afresh")
    return int(session.properties.get("epoch", 0))


def _check_options(args: argparse.Namespace) -> None:
    """TrainingOpError for options ``train TRAINING.onnx`` does not take or that conflict."""
    demo_only = {"--nproc": args.nproc > 1, "--shard-optimizer-state": args.shard_optimizer_state,
                 "--max-restarts": args.max_restarts != 0, "--min-accuracy": args.min_accuracy != 0.0,
                 "--optimizer": args.optimizer is not None}
    if any(demo_only.values()):
        raise TrainingOpError(f"{', '.join(k for k, v in demo_only.items() if v)}: "
                              "options of the demo (train without "
                              "a model); a training model holds its optimizer "
                              "(choose it with `onnx-training-ops build`)")
    if not args.data:
        raise TrainingOpError("train TRAINING.onnx needs --data FILE (.npz, .safetensors or .csv)")
    if args.lr is not None and args.schedule:
        raise TrainingOpError("give --lr or --schedule, not both (a schedule starts from the model's learning rate)")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise TrainingOpError(f"--out {args.out!r} is a file; give a directory")


def _plots(args: argparse.Namespace) -> bool:
    """Whether the loss curve is drawn (a note on stderr where matplotlib is missing)."""
    if args.no_plot:
        return False
    if importlib.util.find_spec("matplotlib") is None:
        print(f"note: no {CURVE}: matplotlib is not installed (pip install 'onnx-training-ops[cli]'; --no-plot "
              "silences this)", file=sys.stderr)
        return False
    return True


def _is_current(path: str, session) -> bool:
    """Whether ``path`` is the inference model of the session's weights (a run stopped between
    its last checkpoint and this file leaves it missing, or an earlier run's)."""
    from ..storage.model_files import as_model

    if not os.path.exists(path):
        return False
    try:
        found = as_model(path, copy=False)
    except TrainingOpError:  # damaged: written again
        return False
    want = as_model(session.export_inference_model(), copy=False)
    have = {t.name: t for t in found.model_proto.graph.initializer}
    return list(found.model_proto.graph.node) == list(want.model_proto.graph.node) and all(
        t.name in have and np.array_equal(found.array(have[t.name]), want.array(t))
        for t in want.model_proto.graph.initializer) and len(have) == len(want.model_proto.graph.initializer)
