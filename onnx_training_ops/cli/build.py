"""``onnx-training-ops build MODEL.onnx OUT.onnx --loss ... --optimizer ...``: :func:`build_training_model`
from the shell."""

from __future__ import annotations

import argparse
import fnmatch
import os
import sys

from ..errors import TrainingOpError
from ._command import add_command

LOSSES = ("cross_entropy", "mse", "l1", "huber", "smooth_l1", "bce_with_logits")
OPTIMIZERS = ("adam", "adamw", "momentum", "sgd", "adagrad", "rmsprop")


def add_parser(commands) -> None:
    """Add the ``build`` subcommand to ``commands``, the subparsers of the main parser."""
    b = add_command(
        commands, "build", build,
        help="inference model + loss + optimizer -> a training model (build_training_model)",
        description="Turn an inference model (e.g. from torch.onnx.export) into an ONNX training model: the "
                    "loss on an output, one Gradient, the optimizer and its state (see docs/cli.md).",
        input="the inference model (.onnx)", output="the training model to write (atomically)")
    b.add_argument("--loss", required=True,
                   help=f"one of {', '.join(LOSSES)} (torch's defaults), or the name of a scalar float output "
                        "already in the model")
    b.add_argument("--output-name", dest="loss_output", default=None, metavar="NAME",
                   help="the model output the loss reads (default: the first)")
    b.add_argument("--labels", default=None, help="name of the new label input (default: labels or target)")
    b.add_argument("--class-axis", type=int, default=None,
                   help="cross_entropy: the class axis (-1 for a language model's [N, T, C] logits)")
    b.add_argument("--shift-labels", action="store_true",
                   help="cross_entropy: the causal-LM loss, logits[:, :-1] against labels[:, 1:]")
    b.add_argument("--ignore-index", type=int, default=-100, help="cross_entropy: label ignored (default -100)")
    b.add_argument("--label-smoothing", type=float, default=0.0, help="cross_entropy: label smoothing (default 0)")
    b.add_argument("--optimizer", choices=OPTIMIZERS, default="adamw",
                   help="torch's optimizer of that name (sgd: momentum 0); default adamw")
    b.add_argument("--lr", type=float, default=None, help="learning rate (default: torch's for the optimizer)")
    b.add_argument("--weight-decay", type=float, default=None, help="weight decay (default: torch's)")
    b.add_argument("--momentum", type=float, default=None, help="momentum/rmsprop: momentum (default 0.9 / 0)")
    b.add_argument("--betas", type=float, nargs=2, default=None, metavar=("B1", "B2"), help="adam/adamw betas")
    b.add_argument("--eps", type=float, default=None, help="adam/adamw/adagrad/rmsprop epsilon")
    b.add_argument("--trainable", nargs="+", action="extend", default=None, metavar="PATTERN",
                   help="initializers to train: names or glob patterns (fnmatch, e.g. '*.lora_*'); default "
                        "what torch calls the parameters")
    b.add_argument("--freeze", nargs="+", action="extend", default=None, metavar="PATTERN",
                   help="initializers not to train, names or glob patterns (from the default set or --trainable)")
    b.add_argument("--mode", choices=("eval", "train"), default="eval",
                   help="train: BatchNorm on batch statistics and Dropout active in the step, as torch's "
                        "model.train() (default eval)")
    b.add_argument("--seed", type=int, default=0, help="--mode train: the dropout masks' seed")
    b.add_argument("--clip-grad-norm", type=float, default=None, help="clip the gradients' global norm")
    b.add_argument("--precision", choices=("fp32", "fp16", "bf16"), default="fp32",
                   help="mixed precision: MatMul/Gemm/Conv/ConvTranspose/Einsum in 16-bit, weights and optimizer "
                        "state float32; fp16 with dynamic loss scaling (default fp32)")
    b.add_argument("--padding-row", action="append", default=None, metavar="TABLE=ROW",
                   help="nn.Embedding(padding_idx=ROW) of embedding table TABLE: its lookups give that row no "
                        "gradient, as in torch (read from a dynamo export; a TorchScript export keeps nothing "
                        "of it); ROW 'none' trains the row; repeatable")


def make_optimizer(args: argparse.Namespace):
    """The optimizer object of the command line's ``--optimizer`` and its values.

    Args:
        args: the parsed ``build`` arguments.

    Returns:
        An optimizer of :mod:`onnx_training_ops.optim` (Adam, AdamW, Momentum, Adagrad, RMSProp).

    Raises:
        TrainingOpError: an option the optimizer does not take, or a value it refuses.
    """
    from ..optim.adagrad import Adagrad
    from ..optim.adam import Adam, AdamW
    from ..optim.momentum import Momentum
    from ..optim.rmsprop import RMSProp

    kind = args.optimizer
    takes = {"adam": {"betas", "eps"}, "adamw": {"betas", "eps"}, "momentum": {"momentum"}, "sgd": {"momentum"},
             "adagrad": {"eps"}, "rmsprop": {"momentum", "eps"}}[kind]
    given = {"betas": tuple(args.betas) if args.betas else None, "momentum": args.momentum, "eps": args.eps}
    for option, value in given.items():
        if value is not None and option not in takes:
            raise TrainingOpError(f"--{option} is not an option of --optimizer {kind} (it takes "
                                  f"{', '.join('--' + t for t in sorted(takes))}, --lr, --weight-decay)")
    values = {"lr": args.lr, "weight_decay": args.weight_decay, **{k: v for k, v in given.items() if k in takes}}
    if kind == "sgd" and args.momentum is None:
        values["momentum"] = 0.0  # torch's SGD: no momentum unless asked
    cls = {"adam": Adam, "adamw": AdamW, "momentum": Momentum, "sgd": Momentum, "adagrad": Adagrad,
           "rmsprop": RMSProp}[kind]
    return cls(**{k: v for k, v in values.items() if v is not None})


def padding_rows(entries: list[str] | None) -> dict[str, int | None] | None:
    """``--padding-row TABLE=ROW`` entries as ``build_training_model``'s ``padding_rows``.

    Args:
        entries: the option's values (None when not given).

    Returns:
        ``{table: row}`` (None for ``none``), or None.

    Raises:
        TrainingOpError: an entry that is not ``TABLE=ROW`` with an integer or ``none`` ROW.
    """
    if not entries:
        return None
    out: dict[str, int | None] = {}
    for entry in entries:
        table, _, row = entry.rpartition("=")
        if not table or not (row.lower() == "none" or row.lstrip("-").isdigit()):
            raise TrainingOpError(f"--padding-row {entry!r}: expected TABLE=ROW with an integer ROW (or none), "
                                  "e.g. --padding-row embeddings.word_embeddings.weight=0")
        out[table] = None if row.lower() == "none" else int(row)
    return out


def _matching(patterns, names: list[str], option: str) -> list[str]:
    out = []
    for pattern in patterns:
        found = [n for n in names if fnmatch.fnmatchcase(n, pattern)]
        if not found:
            raise TrainingOpError(f"{option} {pattern!r} matches no initializer of the model; initializers: "
                                  + ", ".join(names[:20]) + (" ..." if len(names) > 20 else ""))
        out += [n for n in found if n not in out]
    return out


def build(args: argparse.Namespace) -> int:
    """The ``build`` command: writes the training model and prints its summary's head.

    Args:
        args: the parsed command line.

    Returns:
        The exit status (0).

    Raises:
        TrainingOpError: a bad model or option (exit status 2).
    """
    from ..builder import CrossEntropyLoss, build_training_model
    from ..builder.untie import describe, untie_merged_initializers
    from ..storage.model_files import as_model
    from ..storage.save import save_model
    from ..training.summary import summary

    if os.path.isdir(args.output):
        raise TrainingOpError(f"output {args.output!r} is a directory; give a file name")
    ce_only = {"--class-axis": args.class_axis is not None, "--shift-labels": args.shift_labels,
               "--ignore-index": args.ignore_index != -100, "--label-smoothing": args.label_smoothing != 0.0}
    loss = args.loss
    if loss == "cross_entropy":
        loss = CrossEntropyLoss(class_axis=args.class_axis, ignore_index=args.ignore_index,
                                label_smoothing=args.label_smoothing, shift_labels=args.shift_labels)
    elif any(ce_only.values()):
        raise TrainingOpError(f"{', '.join(k for k, v in ce_only.items() if v)}: options of --loss cross_entropy, "
                              f"not {loss}")
    optimizer = make_optimizer(args)
    model = as_model(args.input)
    untied = untie_merged_initializers(model.model_proto)  # as the builder would: patterns see every parameter
    if untied:
        print(f"note: {describe(untied)}", file=sys.stderr)
    names = [t.name for t in model.model_proto.graph.initializer]
    trainable = _matching(args.trainable, names, "--trainable") if args.trainable else None
    param_groups = None
    if args.freeze:  # a frozen parameter group: its patterns match the trainables, named in its errors
        param_groups = [{"params": list(args.freeze), "frozen": True, "name": "frozen"}]
    training = build_training_model(
        model, loss, optimizer, trainable, output=args.loss_output, labels=args.labels, mode=args.mode,
        seed=args.seed, clip_grad_norm=args.clip_grad_norm, param_groups=param_groups, precision=args.precision,
        padding_rows=padding_rows(args.padding_row))
    save_model(training, args.output)
    s = summary(training)
    print(f"built {args.input} -> {args.output}: {len(s.trainable)} trainable tensors ({s.trainable_count:,} "
          f"parameters), {len(s.frozen)} frozen; {type(optimizer).__name__}, loss {s.loss!r} on labels "
          f"{s.labels!r}; `onnx-training-ops summary {args.output}` lists them")
    return 0
