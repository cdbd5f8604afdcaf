"""``import_onnxruntime_training``: an onnxruntime-training artifact folder -> one training model.

The folder is what ``onnxruntime.training.artifacts.generate_artifacts`` writes, plus the
checkpoints the on-device API saved there. What is read:

* the checkpoint (:mod:`.checkpoint`): trainable and frozen parameters, the optimizer state
  (AdamW's moments and step) and the property bag;
* ``eval_model.onnx``: the forward graph and the loss (:func:`.artifacts.split_eval_model`);
  ``training_model.onnx`` (onnxruntime's own gradient graph) is not needed;
* ``optimizer_model.onnx``: the AdamW attributes (:func:`.artifacts.read_optimizer`).

The result is a builder training model (:func:`onnx_training_ops.build_training_model`) with
:class:`~.adamw.OrtAdamW`, onnxruntime-training's AdamW formula (or ``Momentum(momentum=0)``
for its SGD), whose state holds the checkpoint: parameters, V = ``momentum0``,
H = ``momentum1``, T = the group's step, properties.
``TrainingSession(model)`` continues the run onnxruntime-training would have made. A checkpoint
without optimizer state gives a fresh optimizer (zero moments, T = 0), as onnxruntime-training's
``Optimizer`` starts one. A nominal checkpoint holds names and types only (no values, no
shapes): it imports, with a warning saying so, as our nominal model (shapes from the eval
model), which a session opens and :meth:`~onnx_training_ops.TrainingSession.load_flat_parameters`
fills, as their ``copy_buffer_to_parameters`` does.

The learning rate is not in the checkpoint (onnxruntime-training saves the *initial* learning
rate, 1e-3 unless a scheduler set it, not the one ``set_learning_rate`` gave): pass ``lr=``, or
``step(lr=...)``/a schedule later. Writing back to onnxruntime-training's checkpoint format is
not provided: the imported model is our checkpoint from then on.
"""

from __future__ import annotations

import json
import os
import warnings
from pathlib import Path

import numpy as np
import onnx

from ..builder import META_PREFIX, build_training_model
from ..errors import TrainingOpError
from ..optim.momentum import Momentum
from ..optim.ort_adamw import OrtAdamW
from ..storage.model_files import as_model
from ..storage.snapshot import write_state
from ..training.state.nominal import nominal_model
from ..training.state.state import collect_state_protos
from .artifacts import fill_parameters, read_optimizer, split_eval_model
from .checkpoint import OrtCheckpoint, read_checkpoint

DEFAULT_LR = 1e-3  # onnxruntime-training's GroupOptimizerState learning rate


def _load(path: Path, what: str) -> onnx.ModelProto:
    if not path.is_file():
        hint = " (ORT-format .ort artifacts are not supported: generate them with ort_format=False)" \
            if path.with_suffix(".ort").is_file() else ""
        raise TrainingOpError(f"{path}: missing; an onnxruntime-training artifact folder has the {what}{hint}")
    try:
        return onnx.load(str(path))
    except Exception as e:  # noqa: BLE001 - protobuf raises several types for a damaged file
        raise TrainingOpError(f"{path}: not an ONNX model ({type(e).__name__}: {e})") from None


# our state name -> their moment name, per optimizer (SGD keeps a zero momentum0 it never reads)
MOMENTS = {OrtAdamW: {"V": "momentum0", "H": "momentum1"}, Momentum: {}}


def _optimizer_state(ckpt: OrtCheckpoint, trainable: list[str], moments: dict[str, str]
                     ) -> tuple[dict, int, float | None]:
    """({state name: array}, step, the group's initial learning rate) from group 0."""
    if not ckpt.optimizer_groups:
        return {}, 0, None
    if len(ckpt.optimizer_groups) != 1:
        names = [g.name for g in ckpt.optimizer_groups]
        raise TrainingOpError(f"{ckpt.path}: {len(names)} optimizer groups {names}; onnxruntime-training "
                              "trains one group ('group0')")
    group = ckpt.optimizer_groups[0]
    state = {}
    for p in trainable:
        found = group.moments.get(p, {})
        for ours, theirs in moments.items():
            value = found.get(theirs)
            if value is None:
                raise TrainingOpError(f"{ckpt.path}: optimizer group {group.name!r} has no moment {theirs!r} "
                                      f"for parameter {p!r} (found {sorted(found)})")
            if value.shape != ckpt.trainable[p].shape or value.dtype != ckpt.trainable[p].dtype:
                raise TrainingOpError(f"{ckpt.path}: moment {theirs!r} of {p!r} is {value.dtype} "
                                      f"{list(value.shape)}, the parameter {ckpt.trainable[p].dtype} "
                                      f"{list(ckpt.trainable[p].shape)}")
            state[f"{p}.{ours}"] = value
    return state, group.step, group.initial_learning_rate


def _shapes_from(eval_model: onnx.ModelProto, ckpt: OrtCheckpoint) -> None:
    """Zeros shaped as the eval model declares each parameter of the nominal ``ckpt`` (in place)."""
    declared = {i.name: i.type.tensor_type for i in eval_model.graph.input}
    for name, (dtype, _) in list(ckpt.shapes.items()):
        tensor_type = declared.get(name)
        dims = [d.dim_value if d.HasField("dim_value") else None for d in tensor_type.shape.dim] \
            if tensor_type is not None and tensor_type.HasField("shape") else None
        if dims is None or None in dims:
            raise TrainingOpError(f"{ckpt.path}: nominal checkpoint: the eval model does not declare a full "
                                  f"shape for parameter {name!r} ({dims}); import the complete checkpoint")
        zeros = np.zeros(dims, dtype)
        ckpt.shapes[name] = (dtype, zeros.shape)
        (ckpt.trainable if name in ckpt.trainable_names else ckpt.frozen)[name] = zeros


def import_onnxruntime_training(artifact_dir: str | os.PathLike, *, checkpoint: str = "checkpoint",
                                lr: float | None = None) -> onnx.ModelProto:
    """One training model that continues the onnxruntime-training run saved in ``artifact_dir``.

    ``TrainingSession(model)`` trains it; ``save`` writes our checkpoint. Needs the ``migrate``
    extra (flatbuffers).

    Args:
        artifact_dir: the folder ``generate_artifacts`` wrote (``eval_model.onnx``,
            ``optimizer_model.onnx``) holding the checkpoint.
        checkpoint: the checkpoint's file name in the folder, or a path.
        lr: the learning rate the model's steps use by default; without it the checkpoint's
            initial learning rate (see the module docstring).

    Returns:
        The training model: the eval model's forward and loss, the checkpoint's parameters,
        AdamW moments, step and properties, and :class:`OrtAdamW` as standard ops (``Momentum(momentum=0)``
    for their SGD).

    Raises:
        TrainingOpError: a missing or damaged folder, checkpoint or model, or an optimizer or
            parameter layout this import does not handle.
    """
    folder = Path(artifact_dir)
    if not folder.is_dir():
        raise TrainingOpError(f"{folder}: not a folder; expected onnxruntime-training's artifact folder "
                              "(eval_model.onnx, optimizer_model.onnx, checkpoint)")
    ckpt_path = Path(checkpoint) if os.path.isabs(checkpoint) else folder / checkpoint
    ckpt = read_checkpoint(ckpt_path)
    eval_path, optim_path = folder / "eval_model.onnx", folder / "optimizer_model.onnx"
    eval_model = _load(eval_path, "eval model (forward + loss)")
    declared = [i.name for i in eval_model.graph.input]
    if ckpt.nominal:
        _shapes_from(eval_model, ckpt)
    trainable = [n for n in declared if n in ckpt.trainable]  # the eval model's order
    if len(trainable) != len(ckpt.trainable):
        extra = sorted(set(ckpt.trainable) - set(trainable))
        raise TrainingOpError(f"{ckpt_path}: trainable parameter(s) {extra} are not inputs of {eval_path}")
    if not trainable:
        raise TrainingOpError(f"{ckpt_path}: no trainable parameters")
    optim_model = _load(optim_path, "optimizer model")
    kind = type(read_optimizer(optim_model, str(optim_path), DEFAULT_LR))
    state, step, initial_lr = _optimizer_state(ckpt, trainable, MOMENTS[kind])
    rate = lr if lr is not None else (initial_lr if initial_lr is not None else DEFAULT_LR)
    optimizer = read_optimizer(optim_model, str(optim_path), rate)

    split = split_eval_model(eval_model, set(ckpt.shapes), str(eval_path))
    fill_parameters(split.forward, {**ckpt.trainable, **ckpt.frozen}, str(eval_path))
    built = as_model(build_training_model(split.forward, loss=split.loss, optimizer=optimizer, trainable=trainable,
                                          output=split.output, labels=split.labels), copy=False)
    state["optimizer.T"] = np.array(step, np.int64)
    names = {i.name for i in built.model_proto.training_info[0].algorithm.initializer}
    missing = sorted(set(state) - names)
    if missing:  # the builder names states "<param>.V"/"<param>.H" unless a name was taken
        raise TrainingOpError(f"{ckpt_path}: the built model has no state variable(s) {missing[:3]}")
    meta = {META_PREFIX + "imported_from": json.dumps({"onnxruntime_training": str(folder),
                                                       "checkpoint": ckpt_path.name, "step": step})}
    if ckpt.properties:
        meta[META_PREFIX + "properties"] = json.dumps(ckpt.properties, sort_keys=True)
    if ckpt.nominal:
        warnings.warn(f"{ckpt_path}: a nominal checkpoint: onnxruntime-training stored only the names and "
                      f"types of {len(ckpt.shapes)} parameters, no values; the imported model is nominal "
                      "(shapes from the eval model): load the parameters with "
                      "TrainingSession.load_flat_parameters(buffer, trainable_only=False) before training",
                      stacklevel=2)
        return nominal_model(write_state(built, state, meta).to_proto(),
                             [*collect_state_protos(built.model_proto), *ckpt.shapes])
    return write_state(built, state, meta).public(checksums=True)
