"""One rank of the data-parallel demo: an MLP on scikit-learn's digits, trained by
:class:`~onnx_training_ops.distributed.DistributedTrainingSession`.

Every rank builds the same model, takes its slice of each global batch (the same shuffled
order on every rank), and the gradients are averaged over the ranks before each optimizer
step. Rank 0 writes a checkpoint after every epoch (atomically, with the epoch as a
property); a restarted job resumes from it on every rank, so ``--max-restarts`` after a
killed worker ends with the same parameters as an uninterrupted run.

At the end rank 0 writes, beside the checkpoint, what ``train`` writes in one process:
``inference_model.onnx``, ``loss_curve.png`` (training and held-out loss per epoch) and
``summary.json``. A checkpoint already trained for ``--epochs`` epochs, or trained with
another optimizer than ``--optimizer``, is an error (exit 2), not a silent no-op.

Run under torchrun (``python -m onnx_training_ops train --nproc 2`` does it for you)::

    torchrun --nproc-per-node 2 -m onnx_training_ops.demo_ddp --epochs 5 --out ddp_run

Needs the ``distributed`` and ``demo`` extras.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Sequence

import numpy as np

EXIT_USAGE = 2


def parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=5)
    parser.add_argument("--out", default="ddp_run", help="checkpoint directory (resumed from if it holds one)")
    parser.add_argument("--lr", type=float, default=None, help="learning rate (default: per optimizer, as train's)")
    parser.add_argument("--optimizer", choices=("adam", "momentum", "adagrad"), default="adam")
    parser.add_argument("--batch-size", type=int, default=64, help="the global batch, split over the ranks")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", choices=("cpu", "cuda"), default=None,
                        help="each rank's state: cpu (the update in the graph, host arrays) or cuda (cuda:LOCAL_RANK, "
                             "NCCL); default: host arrays with the fused kernels")
    parser.add_argument("--shard-optimizer-state", action="store_true",
                        help="ZeRO-1: each rank holds and updates the optimizer state of its share of the trainables")
    return parser.parse_args(argv)


def _session_options(world: int):
    """One rank's share of the cores for onnxruntime (ranks on one machine must not oversubscribe)."""
    import onnxruntime as ort

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    options = ort.SessionOptions()
    options.log_severity_level = 3  # errors reach us as exceptions; no warnings per rank
    options.intra_op_num_threads = max(1, (os.cpu_count() or 1) // max(1, local))
    return options


def refusal(path: str, epochs: int, optimizer: str) -> str:
    """Why the checkpoint at ``path`` cannot go on to ``epochs`` epochs with ``optimizer``, or ''
    (``train --nproc`` asks before it starts the ranks)."""
    from .builder.metadata import TrainingMetadata
    from .errors import TrainingOpError
    from .storage.model_files import load_model
    from .storage.tensors import proto_of
    from .training.inputs.checks import stored_properties

    try:
        meta = TrainingMetadata.from_model(proto_of(load_model(path)))
        properties = stored_properties(meta.properties or "{}")
    except TrainingOpError as error:
        return f"{path}: {error}"
    done = properties.get("epoch", 0)
    if isinstance(done, bool) or not isinstance(done, int) or done < 0:
        return (f"{path}: property 'epoch' is {done!r}; expected an integer >= 0 (the epochs the checkpoint "
                "holds): give another --out")
    history = properties.get("history", "[]")
    try:
        history = json.loads(history) if isinstance(history, str) else None
    except ValueError:
        history = None
    if not isinstance(history, list):
        return (f"{path}: property 'history' is {properties.get('history')!r}; expected a JSON list of "
                "[train, held-out] losses per epoch: give another --out")
    if done >= epochs:
        return (f"{path} already holds {done} epoch(s) and --epochs is {epochs}: nothing to train "
                "(raise --epochs to go on, or give another --out)")
    trained = (meta.optimizer or {}).get("type", "")
    if trained and trained.lower() != optimizer:
        return f"{path} was trained with {trained}; --optimizer {optimizer} cannot resume it (give another --out)"
    return ""


def main(argv: Sequence[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        from .distributed import DistributedTrainingSession, destroy_process_group, init_process_group
        init_process_group()
    except ImportError as error:
        print(error, file=sys.stderr)
        return EXIT_USAGE
    from .builder import build_training_model
    from .demo import load_digits_split, make_mlp, make_optimizer, plot_losses, write_summary
    from .schedules import CosineAnnealingLR
    from .training import TrainingSession

    x_train, y_train, x_val, y_val = load_digits_split(args.seed)
    steps_per_epoch = len(x_train) // args.batch_size
    path = os.path.join(args.out, "checkpoint.onnx")
    options = _session_options(int(os.environ.get("WORLD_SIZE", 1)))
    device = f"cuda:{os.environ.get('LOCAL_RANK', '0')}" if args.device == "cuda" else args.device
    if os.path.exists(path):
        refused = refusal(path, args.epochs, args.optimizer)
        if refused:  # every rank reads the same file: all stop, before any collective
            if int(os.environ.get("RANK", 0)) == 0:
                print(f"error: {refused}", file=sys.stderr)
            destroy_process_group()
            return EXIT_USAGE
        session = TrainingSession(path, sess_options=options, device=device)
    else:
        model = build_training_model(make_mlp((64, 128, 10), seed=args.seed), "cross_entropy",
                                     make_optimizer(args.optimizer, args.lr))
        session = TrainingSession(model, sess_options=options, device=device)
        session.set_lr_schedule(CosineAnnealingLR(T_max=args.epochs * steps_per_epoch))
    ddp = DistributedTrainingSession(session, check_every=steps_per_epoch,
                                     shard_optimizer_state=args.shard_optimizer_state)
    session = ddp.session  # sharded: reopened on this rank's shard
    rank, world = ddp.rank, ddp.world_size
    if args.batch_size % world:
        raise SystemExit(f"the global batch {args.batch_size} does not split over {world} ranks")
    rows = args.batch_size // world
    first = int(session.properties.get("epoch", 0))
    history = json.loads(session.properties.get("history", "[]"))  # [train, held-out] loss per epoch
    if rank == 0:
        os.makedirs(args.out, exist_ok=True)
        sharding = ", optimizer state sharded (ZeRO-1)" if ddp.sharded else ""
        where = f", state on {device}" if device else ""
        print(f"{world} rank(s), {rows} rows each per step{sharding}{where}; epochs {first}..{args.epochs - 1}",
              flush=True)
    start = time.perf_counter()
    for epoch in range(first, args.epochs):
        order = np.random.default_rng(epoch).permutation(len(x_train))  # the same on every rank
        losses = []
        for k in range(steps_per_epoch):
            index = order[k * args.batch_size + rank * rows:k * args.batch_size + (rank + 1) * rows]
            losses.append(float(ddp.step({"input": x_train[index], "labels": y_train[index]})["loss"]))
        train_loss = ddp.average(float(np.mean(losses)))
        held_out = float(session.evaluate({"input": x_val, "labels": y_val})["loss"])
        history.append([train_loss, held_out])
        session.properties["epoch"] = epoch + 1
        session.properties["history"] = json.dumps(history)
        ddp.save(path)
        if rank == 0:
            logits = session.run(None, {"input": x_val})[0]
            accuracy = float(np.mean(logits.argmax(1) == y_val))
            print(f"epoch {epoch}: train loss {train_loss:.4f}, held-out loss {held_out:.4f}, "
                  f"val accuracy {accuracy:.3f}", flush=True)
    elapsed = time.perf_counter() - start
    digest = ddp.check_parameters()
    if rank == 0:
        steps = (args.epochs - first) * steps_per_epoch
        print(f"{steps / elapsed:.0f} steps/s; state {digest[:16]} on all ranks", flush=True)
        _write_outputs(session, args, history, accuracy, steps, elapsed, world, plot_losses, write_summary)
    destroy_process_group()
    return 0


def _write_outputs(session, args, history, accuracy, steps, seconds, world, plot_losses, write_summary) -> None:
    """Rank 0: the inference model, the loss plot and the summary, as ``train`` writes them."""
    inference = os.path.join(args.out, "inference_model.onnx")
    session.export_inference_model(inference)
    curve = os.path.join(args.out, "loss_curve.png")
    train_losses, held_out = [h[0] for h in history], [h[1] for h in history]
    plot_losses(train_losses, curve, title=f"digits MLP, {world} ranks, accuracy {accuracy:.3f}",
                held_out=held_out, per_epoch=True)
    summary = write_summary(args.out, optimizer=args.optimizer, learning_rates=session.learning_rates,
                            epochs=args.epochs,
                            batch_size=args.batch_size, ranks=world, steps=steps, seconds=seconds,
                            accuracy=accuracy, train_losses_per_epoch=train_losses,
                            held_out_losses_per_epoch=held_out)
    print(f"wrote {inference}, {curve}, {summary}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
