"""Command line: ``python -m onnx_training_ops COMMAND ...`` (also ``onnx-training-ops``), COMMAND
one of ``{build,train,summary,prepare,export-step,conformance,import-ortt}``; docs/cli.md
walks through it. ``build`` (:mod:`.build`), ``train TRAINING.onnx`` (:mod:`.train`, data
files: :mod:`.data`) and ``summary`` (:mod:`.summary`) have modules of their own; ``train``
without a model trains the demo.

Exit status: 0 success; 1 the command ran and reports a failure (a conformance case
failed, the demo's accuracy is below ``--min-accuracy``); 2 bad usage or input (argparse's
own errors, an unreadable or invalid model, a missing extra); 3 an internal error (a bug of
this package: the traceback is printed, please report it); 130 interrupted (Ctrl-C); 141 the
reader of stdout went away (``summary | head``: quietly, as SIGPIPE ends Unix tools).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from ._command import add_command
from .extras import MissingExtra
from .extras import require as _require

EXIT_OK, EXIT_FAILED, EXIT_USAGE, EXIT_INTERNAL, EXIT_INTERRUPTED = 0, 1, 2, 3, 130
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE: what the shell reports for a tool its reader stopped


def _positive_int(text: str) -> int:
    value = int(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be a positive integer, got {value}")
    return value


def _prepare(args: argparse.Namespace) -> int:
    import os

    from ..errors import TrainingOpError
    from ..runtime.pipeline import prepare
    from ..storage.save import save_model

    if os.path.isdir(args.output):
        raise TrainingOpError(f"output {args.output!r} is a directory; give a file name")
    model = prepare(args.input, portable=True) if args.portable else prepare(args.input)
    save_model(model, args.output)
    print(f"prepared {args.input} -> {args.output}" + (" (portable: standard ONNX ops only)" if args.portable else ""))
    return EXIT_OK


def _import_ortt(args: argparse.Namespace) -> int:
    import os

    from ..errors import TrainingOpError
    from ..storage.save import save_model
    from ..storage.tensors import proto_of

    _require("flatbuffers", "migrate")
    from ..builder.metadata import TrainingMetadata
    from ..migrate import import_onnxruntime_training

    if os.path.isdir(args.output):
        raise TrainingOpError(f"output {args.output!r} is a directory; give a file name")
    model = import_onnxruntime_training(args.artifacts, checkpoint=args.checkpoint, lr=args.lr)
    save_model(model, args.output)
    step = (TrainingMetadata.from_model(proto_of(model)).imported_from or {}).get("step")  # a LargeModel too
    print(f"imported {args.artifacts} ({args.checkpoint}, {step} steps done) -> {args.output}: "
          f"TrainingSession({args.output!r}) continues the run")
    return EXIT_OK


def _export_step(args: argparse.Namespace) -> int:
    import os

    from ..errors import TrainingOpError
    from ..export import export_step

    if os.path.exists(args.output) and not os.path.isdir(args.output):
        raise TrainingOpError(f"output {args.output!r} is a file; give a directory")

    def shapes(specs: list[str] | None, flag: str) -> dict[str, list[int]] | None:
        found = {}
        for spec in specs or []:
            name, sep, dims = spec.partition("=")
            try:
                found[name] = [int(d) for d in dims.split(",")]
            except ValueError:
                sep = ""
            if not sep or not name:
                raise TrainingOpError(f"{flag} {spec!r}: expected NAME=D,D,... (e.g. input=32,64)")
        return found or None

    manifest = export_step(args.input, args.output, eval_outputs=args.eval_outputs, ort=args.ort,
                           packed=args.packed, flat_optimizer=args.flat_optimizer, target=args.target,
                           input_shapes=shapes(args.input_shapes, "--input-shape"),
                           eval_input_shapes=shapes(args.eval_input_shapes, "--eval-input-shape"))
    print(f"exported {args.input} -> {args.output}: " + ", ".join(f["path"] for f in manifest["files"].values())
          + ", manifest.json")
    return EXIT_OK


def _conformance(args: argparse.Namespace) -> int:
    from ..conformance import format_table, run_conformance

    results = run_conformance(portable=args.portable)
    if args.portable:
        print("portable form (optimizer nodes lowered to standard ONNX ops, plain onnxruntime)")
    print(format_table(results))
    return 0 if all(r.passed for r in results) else 1


def _train_data_parallel(args: argparse.Namespace) -> int:
    """``train --nproc N``: torchrun (static rendezvous on a free local port) runs N ranks of
    :mod:`onnx_training_ops.demo_ddp`; its exit status is ours."""
    import os
    import socket
    import subprocess

    from ..demo_ddp import refusal
    from ..errors import TrainingOpError

    _require("sklearn", "demo")
    _require("torch", "distributed")
    checkpoint = os.path.join(args.out, "checkpoint.onnx")
    refused = refusal(checkpoint, args.epochs, args.optimizer) if os.path.exists(checkpoint) else ""
    if refused:  # before any rank starts (torchrun would report a rank's exit 2 as 1)
        raise TrainingOpError(refused)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.nproc),
               "--master-addr", "127.0.0.1", "--master-port", str(port), "--max-restarts", str(args.max_restarts),
               "-m", "onnx_training_ops.demo_ddp", "--epochs", str(args.epochs), "--out", args.out,
               "--optimizer", args.optimizer, "--batch-size", str(args.batch_size), "--seed", str(args.seed)]
    if args.lr is not None:
        command += ["--lr", str(args.lr)]
    if args.shard_optimizer_state:
        command.append("--shard-optimizer-state")
    if args.device is not None:
        command += ["--device", args.device]
    return subprocess.run(command).returncode


def _train(args: argparse.Namespace) -> int:
    if args.model is not None:  # train TRAINING.onnx --data ...: a user's model
        from .train import train_model

        return train_model(args)
    for option, given in (("--data", args.data), ("--eval-data", args.eval_data), ("--schedule", args.schedule),
                          ("--threads", args.threads)):
        if given is not None:
            from ..errors import TrainingOpError

            raise TrainingOpError(f"{option} needs a training model: onnx-training-ops train TRAINING.onnx "
                               f"{option} ... (without one, train runs the digits demo)")
    args.optimizer = args.optimizer or "adam"
    if args.nproc > 1:
        if args.device not in (None, "cpu", "cuda"):
            from ..errors import TrainingOpError

            raise TrainingOpError(f"--device {args.device} with --nproc: give cpu or cuda (each rank takes "
                                  "cuda:LOCAL_RANK)")
        return _train_data_parallel(args)
    if args.shard_optimizer_state:
        raise MissingExtra("--shard-optimizer-state needs --nproc 2 or more (it shards over processes)")
    for module in ("sklearn",) + (() if args.no_plot else ("matplotlib",)) + (() if args.no_progress else ("tqdm",)):
        _require(module, "demo")
    from ..demo import train

    result = train(
        out_dir=args.out, epochs=args.epochs, optimizer=args.optimizer, lr=args.lr, seed=args.seed,
        batch_size=args.batch_size, progress=not args.no_progress, plot=not args.no_plot, device=args.device,
    )
    if result.accuracy < args.min_accuracy:
        print(f"held-out accuracy {result.accuracy:.3f} is below --min-accuracy "
              f"{args.min_accuracy:.3f}", file=sys.stderr)
        return EXIT_FAILED
    return EXIT_OK


def build_parser() -> argparse.ArgumentParser:
    from .._version import __version__

    parser = argparse.ArgumentParser(
        prog="onnx-training-ops", description="Run ONNX training-domain graphs in onnxruntime.",
        epilog="exit status: 0 ok, 1 failure reported (conformance, --min-accuracy), "
               "2 usage or input error, 3 internal error (a bug: please report), 130 interrupted, "
               "141 stdout closed by its reader",
    )
    parser.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    commands = parser.add_subparsers(dest="command", required=True)
    from . import build, summary

    build.add_parser(commands)
    p = add_command(
        commands, "prepare", _prepare, help="rewrite a model so that onnxruntime runs it",
        description="Validate a model of the ai.onnx.preview.training domain and write the "
                    "onnxruntime-ready form: Gradient expanded, recurrent ops unrolled where "
                    "differentiated, multi-tensor optimizer nodes split, exact attributes "
                    "encoded, IR/opset fitted (training_info graphs included).",
        input="the model to prepare: an .onnx file (a training model or any graph using the training domain)",
        output="where to write the prepared .onnx file (written atomically)")
    p.add_argument("--portable", action="store_true",
                   help="lower the optimizer nodes to standard ONNX ops instead: the result runs in any "
                        "onnxruntime (any language binding) or onnx.reference with nothing registered")
    m = add_command(
        commands, "import-ortt", _import_ortt,
        help="turn onnxruntime-training artifacts + checkpoint into one training model",
        description="Read an onnxruntime-training artifact folder (eval_model.onnx, optimizer_model.onnx, "
                    "a checkpoint) and write one ONNX training model holding the checkpoint's parameters, "
                    "AdamW moments, step and properties (needs the migrate extra).",
        artifacts="the folder generate_artifacts wrote", output="the training model to write (atomically)")
    m.add_argument("--checkpoint", default="checkpoint",
                   help="the checkpoint's file name in the folder, or a path (default: checkpoint)")
    m.add_argument("--lr", type=float, default=None,
                   help="learning rate of the imported model (default: the checkpoint's initial learning rate)")
    e = add_command(
        commands, "export-step", _export_step,
        help="write a training step any onnxruntime runs (JavaScript, Java, mobile)",
        description="Write the training step, eval and inference models in standard ONNX ops (state "
                    "and learning rates as plain inputs), the state as .safetensors and manifest.json, "
                    "for the JavaScript trainer (js/) or any onnxruntime binding; see docs/export.md.",
        input="a training model or a checkpoint (.onnx with training_info)",
        output="the directory to write (created; files written atomically)")
    e.add_argument("--eval-output", dest="eval_outputs", action="append", default=None, metavar="NAME",
                   help="a value the eval model returns beside the loss (repeatable; default: the "
                        "main graph's outputs)")
    e.add_argument("--ort", action="store_true",
                   help="also write ORT-format models and required_operators.config (onnxruntime mobile "
                        "and reduced builds)")
    e.add_argument("--packed", action="store_true",
                   help="also write step.packed.onnx: the state packed into one input and one output per "
                        "dtype (faster in bindings that convert each tensor per run, such as onnxruntime-node)")
    e.add_argument("--target", choices=("portable", "webgpu"), default="portable",
                   help="webgpu: also write step.webgpu.onnx, a step whose every node runs on onnxruntime-web's "
                        "WebGPU provider (no LogSoftmax/OneHot/Sum, no float64, the update count on the host, "
                        "static shapes); the portable step stays as the wasm fallback")
    e.add_argument("--input-shape", dest="input_shapes", action="append", default=None, metavar="NAME=D,D,...",
                   help="the static shape of a data input with symbolic dims (--target webgpu; repeatable)")
    e.add_argument("--eval-input-shape", dest="eval_input_shapes", action="append", default=None,
                   metavar="NAME=D,D,...", help="the same for the WebGPU eval model (default: --input-shape)")
    e.add_argument("--flat-optimizer", action="store_true",
                   help="for a GPU: each optimizer runs over all its tensors laid end to end (a few kernels "
                        "instead of ~16 per tensor; the same values; slower on a CPU)")
    summary.add_parser(commands)
    c = add_command(commands, "conformance", _conformance, help="run the domain's ONNX conformance cases")
    c.add_argument("--portable", action="store_true",
                   help="run them on the portable form (prepare --portable) in plain onnxruntime")
    for name in ("train", "demo"):  # `make demo` runs `python -m onnx_training_ops demo --out out/demo`
        t = commands.add_parser(
            name, help="train a training model on a data file (train TRAINING.onnx --data FILE); without a "
                       "model, the demo: an MLP on scikit-learn's digits (needs the demo extra)",
            description="With a training model (from `build`): train it on --data (.npz/.safetensors: arrays "
                        "named as the inputs; .csv: a header naming them, the label column last or named), "
                        "with a progress bar, metrics.jsonl, loss_curve.png and checkpoint.onnx in --out "
                        "(a second run continues from it), then inference_model.onnx. Without a model: "
                        "train an MLP on scikit-learn's digits (shipped with the package, no download); "
                        "writes the models, a loss plot and summary.json to --out; with --nproc, "
                        "a checkpoint per epoch as well.")
        _train_arguments(t)
    return parser


def _threads(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = -1
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be a whole number >= 0, found {text!r}")
    return value


def _train_arguments(t: argparse.ArgumentParser) -> None:
    t.add_argument("model", nargs="?", default=None,
                   help="the training model (.onnx, from `build`); omitted: the digits demo")
    t.add_argument("--data", default=None, metavar="FILE", help="training data: .npz, .safetensors or .csv")
    t.add_argument("--eval-data", default=None, metavar="FILE", help="held-out data, evaluated after each epoch")
    t.add_argument("--schedule", default=None, metavar="NAME[:k=v,...]",
                   help="learning-rate schedule: cosine, linear, step:step_size=N, exponential:gamma=G, "
                        "warmup_cosine:warmup_steps=N, warmup_linear:warmup_steps=N, onecycle:max_lr=X "
                        "(torch's argument names; the run's total steps by default)")
    t.add_argument("--no-plot", action="store_true", help="no loss-curve PNG (no matplotlib needed)")
    t.add_argument("--out", default="out/", help="output folder (default: out/)")
    t.add_argument("--epochs", type=_positive_int, default=30, help="epochs (default: 30)")
    t.add_argument("--optimizer", choices=("adam", "momentum", "adagrad"), default=None,
                   help="the demo's optimizer (default adam); a training model holds its own")
    t.add_argument("--lr", type=float, default=None,
                   help="learning rate (default: per optimizer for the demo, the model's for a model)")
    t.add_argument("--seed", type=int, default=0)
    t.add_argument("--batch-size", type=_positive_int, default=64)
    t.add_argument("--no-progress", action="store_true", help="no progress bar")
    t.add_argument("--device", default=None, metavar="DEVICE",
                   help="where the state lives: cpu (the update in the graph, on host arrays), cuda or cuda:N "
                        "(onnxruntime-gpu; with --nproc, each rank on cuda:LOCAL_RANK); default: host arrays with "
                        "the fused kernels")
    t.add_argument("--threads", type=_threads, default=None,
                   help="onnxruntime intra-op threads (0: one per core; default: 1 for a small model, else 0)")
    t.add_argument("--min-accuracy", type=float, default=0.0,
                   help="exit with status 1 when the held-out accuracy is below this")
    t.add_argument("--nproc", type=_positive_int, default=1,
                   help="data-parallel over this many local processes (torchrun, gloo; needs the distributed "
                        "extra): a checkpoint per epoch in --out, resumed from when present")
    t.add_argument("--max-restarts", type=int, default=0,
                   help="with --nproc: restart the ranks this many times after a failure (resume from the checkpoint)")
    t.add_argument("--shard-optimizer-state", action="store_true",
                   help="with --nproc: ZeRO-1, each rank holds the optimizer state of its share of the trainables")
    t.set_defaults(func=_train)


def _closed_stdout() -> int:
    """The reader of stdout went away (``summary | head``): stop quietly, as Unix tools do on
    SIGPIPE. stdout is pointed at /dev/null so that the interpreter's last flush does not report
    the broken pipe again."""
    import os

    try:
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
    except (OSError, ValueError):  # no file descriptor (a replaced sys.stdout): nothing left to flush
        pass
    return EXIT_BROKEN_PIPE


def main(argv: Sequence[str] | None = None) -> int:
    from ..errors import TrainingOpError

    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        status = args.func(args)
        sys.stdout.flush()  # here, not at exit: a reader that went away is told apart below
        return status
    except BrokenPipeError:
        return _closed_stdout()
    except MissingExtra as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except (TrainingOpError, OSError) as error:
        print(f"error: {error}", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt as error:  # a command may say how to go on (train: the same command resumes)
        print("interrupted" + (f": {error}" if error.args else ""), file=sys.stderr)
        return EXIT_INTERRUPTED
    except Exception:  # noqa: BLE001 - not a reported failure: a bug, told apart by its status
        import traceback

        from .._version import __version__
        traceback.print_exc()
        print(f"internal error of onnx-training-ops {__version__}: please report it with the "
              "traceback above", file=sys.stderr)
        return EXIT_INTERNAL


if __name__ == "__main__":
    sys.exit(main())
