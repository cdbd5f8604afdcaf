""":func:`export_step`: a training model or checkpoint -> a directory any onnxruntime trains from.

The directory holds ``step.onnx``, ``eval.onnx``, ``inference.onnx`` (:mod:`.graphs`),
``state.safetensors`` (:mod:`.safetensors`: every state variable once, named as the step
model's inputs) and ``manifest.json`` (:mod:`.manifest`, written last: a directory with a
manifest is complete). Each file is written atomically. ``ort=True`` adds ORT-format models
and the reduced-build operator config (:mod:`.ort_format`).

A model whose tensors pass :data:`EXTERNAL_BYTES` (protobuf serializes no message past 2 GB)
is exported without ever holding its tensors in a message: its big constants (frozen weights)
stay arrays through the passes and are written once, page-aligned, to ``constants.data``,
which every exported model reads as ONNX external data (as a checkpoint's data file).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx

from ..builder.metadata import TrainingMetadata
from ..errors import TrainingOpError
from ..schema import DOMAIN, OPTIMIZERS
from ..storage import checkpoint, safetensors
from ..storage.external_data import write_tensors
from ..storage.large_model import LargeModel
from ..storage.model_files import ModelLike, as_model
from ..storage.tensors import location, set_location, tensor_value
from ..training.graphs.static_shapes import checked_input_shapes
from ..training.state.nominal import nominal_names
from ..training.state.state import collect_state_protos
from . import graphs, packing, webgpu
from . import manifest as manifest_

FILES = {"step": "step.onnx", "step_packed": "step.packed.onnx", "eval": "eval.onnx", "inference": "inference.onnx",
         "state": "state.safetensors", "step_webgpu": webgpu.FILE,
         "eval_webgpu": webgpu.EVAL_FILE, "constants": "constants.data"}
TARGETS = ("portable", "webgpu")
# Tensor bytes of a training model past which its exported models keep their big constants in
# constants.data: protobuf serializes no message past 2 GB (2**31 - 1 bytes), and the graphs
# need room beside the tensors
EXTERNAL_BYTES = 2**31 - 2**27


def _training_model(model_or_checkpoint: Any) -> LargeModel:
    """The training model to export (a large file's tensors memory-mapped arrays)."""
    if hasattr(model_or_checkpoint, "training_model") and hasattr(model_or_checkpoint, "state_names"):
        if getattr(model_or_checkpoint, "nominal", False):
            raise TrainingOpError("export: this session was opened from a nominal checkpoint and its parameters "
                                  "have no values yet: load them (load_flat_parameters / load_state_dict), "
                                  "then export the session")
        # a TrainingSession: its current state
        return as_model(model_or_checkpoint.training_model(), copy=False)
    path = model_or_checkpoint if isinstance(model_or_checkpoint, (str, os.PathLike)) else None
    where = f"checkpoint {os.fspath(path)!r}" if path is not None else "the model"
    opened = as_model(model_or_checkpoint)
    checkpoint.verify(opened, path)
    model = opened.model_proto
    empty = nominal_names(TrainingMetadata.from_model(model))
    if empty:
        raise TrainingOpError(f"export: {where} is a nominal checkpoint (save(path, nominal=True)): "
                              f"{len(empty)} state tensor(s) such as {empty[0]!r} have no values. Open it in a "
                              "TrainingSession, load the parameters (load_flat_parameters / load_state_dict) "
                              "and export the session")
    if len(model.training_info) != 1:
        raise TrainingOpError(f"export: expected a training model with one training_info (what "
                              f"build_training_model writes), found {len(model.training_info)}")
    return opened


def _rate_names(model: onnx.ModelProto, meta: TrainingMetadata) -> list[str]:
    """The learning-rate inputs: R of each optimizer node, the builder's named rates."""
    names = [n.input[0] for n in model.training_info[0].algorithm.node
             if n.domain == DOMAIN and n.op_type in OPTIMIZERS and n.input]
    names += [",".join(meta.learning_rate)]
    names += meta.group_rates
    return list(dict.fromkeys(filter(None, names)))


def _counter(model: onnx.ModelProto, state: dict[str, np.ndarray]) -> str | None:
    """The update count T (the one int64 scalar state variable an update binding advances), if any."""
    names = [e.key for e in model.training_info[0].update_binding
             if state[e.key].dtype == np.int64 and state[e.key].size == 1]
    return names[0] if len(names) == 1 else None


def _schedule(meta: TrainingMetadata, counter: str | None, state: dict[str, np.ndarray]) -> dict | None:
    text = meta.lr_schedule
    if not text:
        return None
    data = json.loads(text)
    if counter is None:
        raise TrainingOpError("export: the model has a learning-rate schedule but no update count T "
                              "(an int64 scalar state the optimizers read): a client could not tell its "
                              "position")
    offset = int(data["step"]) - int(state[counter].reshape(-1)[0])
    return {"type": data["type"], "args": data["args"], "counter": counter, "step_offset": offset}


def _write(out_dir: str, kind: str, model: onnx.ModelProto) -> dict[str, Any]:
    """Write one exported model; its manifest entry. A model reading constants.data says so
    in its entry (``constants``) and is checked whole once written."""
    data = model.SerializeToString()
    path = os.path.join(out_dir, FILES[kind])
    checkpoint.atomic_write(path, data)
    entry = {"path": FILES[kind], "operators": graphs.operators(model), "sha256": manifest_.sha256(data)}
    if any(location(t) == FILES["constants"] for t in model.graph.initializer):
        graphs.check_file(path, f"{kind} model")
        entry["constants"] = FILES["constants"]
    return entry


def _write_constants(out_dir: str, models: Sequence[graphs.Graph]) -> dict[str, Any] | None:
    """Write the detached tensors of ``models`` to constants.data, each once (page-aligned,
    streamed from its array), and point their tensors at it; its manifest entry, or None when
    no model has any."""
    arrays = {key: value for g in models for key, value in g.arrays.items()}
    if not arrays:
        return None
    keys = list(arrays)
    written: dict = {}
    path = os.path.join(out_dir, FILES["constants"])
    checkpoint.atomic_write(path, lambda f: written.update(write_tensors(f, ((k, arrays[k]) for k in keys))))
    for g in models:
        for tensor in g.model.graph.initializer:
            key = location(tensor)
            if key in written:
                offset, length, _ = written[key]
                set_location(tensor, FILES["constants"], offset, length)
        g.arrays = {}
    return {"path": FILES["constants"], "sha256": manifest_.file_sha256(path)}


def _label_range(meta: TrainingMetadata) -> tuple[int | None, int | None]:
    """(classes, ignore_index) of a loss taking class labels (the builder's ``label_range``)."""
    if meta.label_range is None:
        return None, None
    return meta.label_range.classes, meta.label_range.ignore_index


def _add_digests(out_dir: str, files: dict[str, Any]) -> None:
    """``sha256`` of each file entry that lacks one (the files written by other modules)."""
    for entry in files.values():
        if "sha256" not in entry:
            entry["sha256"] = manifest_.file_sha256(os.path.join(out_dir, entry["path"]))


def _webgpu_step(model: onnx.ModelProto, meta: TrainingMetadata, step: onnx.ModelProto, state: dict[str, np.ndarray],
                 input_shapes: Mapping[str, Sequence[int]] | None) -> tuple[onnx.ModelProto, dict[str, Any]]:
    """The WebGPU step model and the manifest's ``webgpu`` section: its data inputs (labels
    and ids int32 where they only index), the learning rates it reads itself, its state
    feedback (the update count is host state, advanced by the host program)."""
    binding = {e.key: e.value for e in model.training_info[0].update_binding}
    rates = set(_rate_names(model, meta))
    counter = _counter(model, state)
    gpu_model, info = webgpu.webgpu_step(step, list(state), counter, [vi.name for vi in step.graph.input
                                                                       if vi.name in rates], input_shapes)
    gpu_model = graphs._standard(gpu_model, "webgpu step", allowed=graphs.domains(step))
    inputs = list(gpu_model.graph.input)
    outputs = {o.name for o in gpu_model.graph.output}
    host_fed = {f["name"] for f in info["host"]["feeds"]}
    section = {
        "inputs": [manifest_.value_entry(vi) for vi in inputs
                   if vi.name not in state and vi.name not in rates and vi.name not in host_fed],
        "rates": [vi.name for vi in inputs if vi.name in rates],
        "feedback": {vi.name: binding[vi.name] for vi in inputs if vi.name in binding},
        "host": info["host"],
        "host_state": [n for n in info["host"]["inputs"] if n in state],
        "returned": [o.name for o in step.graph.output if o.name not in set(binding.values()) and o.name in outputs],
    }
    manifest_.record_feedback(gpu_model, section["feedback"])
    return gpu_model, section


def _webgpu_eval(evaluation: onnx.ModelProto, state: dict[str, np.ndarray],
                 input_shapes: Mapping[str, Sequence[int]] | None) -> tuple[onnx.ModelProto, list[dict[str, Any]]]:
    """The eval model for WebGPU (the same rewrites; no update count): the model and its data inputs."""
    names = {vi.name for vi in evaluation.graph.input}
    shapes = {k: v for k, v in (input_shapes or {}).items() if k in names}
    gpu_model, _ = webgpu.webgpu_step(evaluation, list(state), None, [], shapes)
    gpu_model = graphs._standard(gpu_model, "webgpu eval", allowed=graphs.domains(evaluation))
    return gpu_model, [manifest_.value_entry(vi) for vi in gpu_model.graph.input if vi.name not in state]


def export_step(model_or_checkpoint: ModelLike | Any, out_dir: str | os.PathLike,
                eval_outputs: Sequence[str] | None = None, ort: bool = False,
                packed: bool = False, flat_optimizer: bool = False, target: str = "portable",
                input_shapes: Mapping[str, Sequence[int]] | None = None,
                eval_input_shapes: Mapping[str, Sequence[int]] | None = None) -> dict[str, Any]:
    """Write the step, eval and inference models, the state and the manifest to ``out_dir``.

    A model without a loss (as ``TrainingSession.from_graph`` makes) has no eval model; one
    whose main graph has no outputs has no inference model. Every file entry of the manifest
    carries its ``sha256``; ``classes`` and ``ignore_index`` give the range class labels must
    lie in.

    Args:
        model_or_checkpoint: a training model (ModelProto, path or bytes; a checkpoint written
            by :meth:`TrainingSession.save` exports its state mid-run) or a
            :class:`TrainingSession` (its current state).
        out_dir: the directory to write (created if missing).
        eval_outputs: what the eval model returns beside the loss (default: the main graph's
            outputs).
        ort: also write ORT-format models and ``required_operators.config`` for onnxruntime
            mobile builds.
        packed: also write ``step.packed.onnx``, the same step with the state packed into one
            input and one output per dtype (:mod:`.packing`: far fewer tensors for a binding to
            convert each step).
        flat_optimizer: for a GPU (:class:`~onnx_training_ops.export.DeviceTrainer` on CUDA,
            WebGPU): each optimizer runs over all its tensors laid end to end, a few kernels
            instead of ~16 per tensor; the same values bit for bit, slower on a CPU (the copies).
        target: ``"portable"``, or ``"webgpu"`` to also write ``step.webgpu.onnx`` and
            ``eval.webgpu.onnx``, rewritten so that every node runs on onnxruntime-web's WebGPU
            provider (:mod:`.webgpu`; the manifest's ``webgpu`` section). The portable step
            stays: it is the wasm fallback.
        input_shapes: with ``target="webgpu"``, static shapes for the step's data inputs with
            symbolic dims.
        eval_input_shapes: the eval model's (default: ``input_shapes``).

    Returns:
        The manifest, as written to ``manifest.json``.

    Raises:
        TrainingOpError: not a training model, a nominal checkpoint (no values), a model the
            exported graphs cannot express, an unknown target, a WebGPU step without static
            shapes or with an op its passes refuse.
    """
    input_shapes, eval_input_shapes = _checked_shapes(target, input_shapes, eval_input_shapes)
    model, arrays = _exported_model(model_or_checkpoint, target, ort)
    meta = TrainingMetadata.from_model(model)
    if target == "webgpu" and meta.precision == "bf16":
        raise TrainingOpError("export: precision='bf16' with target='webgpu': WebGPU has no bfloat16 kernels; build "
                              "the model with precision='fp16' (or 'fp32') for WebGPU, or export target='portable' "
                              "for a CUDA DeviceTrainer")
    state_protos = collect_state_protos(model)
    state = {name: tensor_value(proto, arrays) for name, proto in state_protos.items()}
    step = graphs.step_graph(model, state_protos, meta, flat=flat_optimizer, arrays=arrays)
    outputs = list(eval_outputs) if eval_outputs is not None else [o.name for o in model.graph.output]
    # a model without a loss (from_graph) has no eval model; one without outputs no inference model
    evaluation = graphs.eval_graph(model, state_protos, meta, outputs, arrays) if meta.loss else None
    state_bytes = safetensors.encode(state, {"format": manifest_.FORMAT})
    inference = graphs.inference_graph(model, state_protos, FILES["state"], safetensors.offsets(state_bytes),
                                       arrays) if model.graph.output else None

    # the WebGPU step before any file is written: a graph it refuses changes nothing on disk
    gpu_step = _webgpu_step(model, meta, step.model, state, input_shapes) if target == "webgpu" else None
    gpu_eval = _webgpu_eval(evaluation.model, state, eval_input_shapes or input_shapes) \
        if target == "webgpu" and evaluation is not None else None
    binding = {e.key: e.value for e in model.training_info[0].update_binding}
    feedback = {vi.name: binding[vi.name] for vi in step.model.graph.input if vi.name in state and vi.name in binding}
    manifest_.record_feedback(step.model, feedback)
    packs = packed_step = None
    if packed:
        packed_model, packs = packing.packed_step(step.model, state, binding)
        manifest_.record_feedback(packed_model, manifest_.step_feedback({"feedback": feedback, "packs": packs}, True))
        packed_step = graphs.Graph(packed_model, {}, step.arrays)

    out_dir = os.fspath(out_dir)
    files = _write_files(out_dir, state_bytes, step, evaluation, inference, packed_step, ort)
    gpu = None
    if gpu_step is not None:
        files["step_webgpu"] = _write(out_dir, "step_webgpu", gpu_step[0])
        gpu = gpu_step[1]
        if gpu_eval is not None:
            files["eval_webgpu"] = _write(out_dir, "eval_webgpu", gpu_eval[0])
            gpu["eval_inputs"] = gpu_eval[1]
    manifest = _manifest(model, meta, state, step, evaluation, files, feedback, packs, binding)
    manifest["webgpu"] = gpu
    if meta.precision:  # mixed precision (build_training_model(precision=...)): the loss scale's state
        manifest["precision"] = meta.precision
        manifest["loss_scaling"] = dict(meta.loss_scaling) if meta.loss_scaling else None
    checkpoint.atomic_write(os.path.join(out_dir, manifest_.MANIFEST), manifest_.write(manifest))
    return manifest


def _checked_shapes(target: str, input_shapes: Mapping[str, Sequence[int]] | None,
                    eval_input_shapes: Mapping[str, Sequence[int]] | None
                    ) -> tuple[dict[str, list[int]] | None, dict[str, list[int]] | None]:
    """The target checked, and the WebGPU static shapes (which apply to it alone)."""
    if target not in TARGETS:
        raise TrainingOpError(f"export: target {target!r}; expected one of {', '.join(TARGETS)}")
    if (input_shapes or eval_input_shapes) and target != "webgpu":
        raise TrainingOpError("export: input_shapes and eval_input_shapes apply to target='webgpu' only")
    return (checked_input_shapes(input_shapes, "export (webgpu)") if input_shapes is not None else None,
            checked_input_shapes(eval_input_shapes, "export (webgpu eval)") if eval_input_shapes is not None else None)


def _exported_model(model_or_checkpoint: ModelLike | Any, target: str,
                    ort: bool) -> tuple[onnx.ModelProto, dict[str, np.ndarray]]:
    """The training model's message and, past protobuf's 2 GB, its big tensors as arrays (else ``{}``)."""
    opened = _training_model(model_or_checkpoint)
    external = opened.nbytes > EXTERNAL_BYTES  # past protobuf's 2 GB: big constants in constants.data
    if external and (target == "webgpu" or ort):
        raise TrainingOpError(f"export: the model's tensors hold {opened.nbytes / 2**30:.1f} GiB, past protobuf's "
                              "2 GB: its exported models read their weights from constants.data, which "
                              f"{'onnxruntime-web' if target == 'webgpu' else 'the ORT format'} does not; "
                              "export without " + ("target='webgpu'" if target == "webgpu" else "ort=True"))
    if external:
        return opened.model_proto, dict(opened.large_initializers)
    return opened.to_proto(), {}


def _write_files(out_dir: str, state_bytes: bytes, step: graphs.Graph, evaluation: graphs.Graph | None,
                 inference: graphs.Graph | None, packed_step: graphs.Graph | None, ort: bool) -> dict[str, Any]:
    """Write the state and the models into ``out_dir`` (an old manifest removed first: until the
    new one, the directory is incomplete); their file entries, each with its ``sha256``."""
    os.makedirs(out_dir, exist_ok=True)
    if os.path.exists(os.path.join(out_dir, manifest_.MANIFEST)):  # until the new one: incomplete
        os.remove(os.path.join(out_dir, manifest_.MANIFEST))
    checkpoint.atomic_write(os.path.join(out_dir, FILES["state"]), state_bytes)
    constants = _write_constants(out_dir, [g for g in (step, evaluation, inference, packed_step) if g is not None])
    files: dict[str, Any] = {"step": _write(out_dir, "step", step.model),
                             "state": {"path": FILES["state"], "sha256": manifest_.sha256(state_bytes)}}
    if constants is not None:
        files["constants"] = constants
    if evaluation is not None:
        files["eval"] = _write(out_dir, "eval", evaluation.model)
    if inference is not None:
        files["inference"] = {**_write(out_dir, "inference", inference.model), "external_data": FILES["state"]}
        if "constants" not in files["inference"]:  # checked by _write
            graphs.check_file(os.path.join(out_dir, FILES["inference"]), "inference model")
    if packed_step is not None:
        files["step_packed"] = _write(out_dir, "step_packed", packed_step.model)
    if ort:
        from .ort_format import convert

        files.update(convert(out_dir, [files[k]["path"] for k in ("step", "step_packed", "eval") if k in files]))
    _add_digests(out_dir, files)
    return files


def _manifest(model: onnx.ModelProto, meta: TrainingMetadata, state: dict[str, np.ndarray], step: graphs.Graph,
              evaluation: graphs.Graph | None, files: dict[str, Any], feedback: dict[str, str],
              packs: list[dict[str, Any]] | None, binding: dict[str, str]) -> dict[str, Any]:
    """The manifest's fields (:mod:`.manifest`) of an export."""
    rates = {n: v for n, v in step.defaults.items() if n in set(_rate_names(model, meta))}
    step_inputs = list(step.model.graph.input)
    state_order = [vi.name for vi in step_inputs if vi.name in state]
    counter = _counter(model, state)
    roles = manifest_.state_roles(list(state), meta, counter)
    eval_graph = evaluation.model.graph if evaluation is not None else onnx.GraphProto()
    classes, ignore_index = _label_range(meta)
    return {
        "format": manifest_.FORMAT,
        "version": manifest_.VERSION,
        "files": files,
        "opset": {(o.domain or "ai.onnx"): o.version for o in step.model.opset_import},
        "ir_version": step.model.ir_version,
        "inputs": [manifest_.value_entry(vi) for vi in step_inputs if vi.name not in state and vi.name not in rates],
        "eval_inputs": [manifest_.value_entry(vi) for vi in eval_graph.input if vi.name not in state],
        "defaults": manifest_.default_entries({**{n: v for n, v in step.defaults.items() if n not in rates},
                                               **(evaluation.defaults if evaluation is not None else {})}),
        "learning_rates": manifest_.learning_rate_entries(rates, meta),
        "feedback": feedback,
        "packs": packs,
        "returned": [o.name for o in step.model.graph.output if o.name not in set(binding.values())],
        "eval_outputs": [o.name for o in eval_graph.output],
        "state": [manifest_.tensor_entry(n, state[n], role=roles[n])
                  for n in [*state_order, *(n for n in state if n not in state_order)]],
        "loss": ",".join(meta.loss) or None,
        "labels": meta.labels or None,
        "classes": classes,
        "ignore_index": ignore_index,
        "optimizer": dict(meta.optimizer) if meta.optimizer else None,
        "param_groups": [dict(g) for g in meta.param_groups] if meta.param_groups else None,
        "schedule": _schedule(meta, counter, state),
        "counter": counter,
    }
