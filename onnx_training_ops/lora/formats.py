"""Trained adapters out where they are used, and back: a peft folder, onnxruntime's ``.onnx_adapter``.

* **peft** (:func:`write_peft`): ``adapter_model.safetensors`` + ``adapter_config.json``, the
  tensors under peft's names (``base_model.model.<module>.lora_A.weight``, ``[r, in]``;
  ``lora_B.weight``, ``[out, r]``) for ``peft.PeftModel.from_pretrained`` on the Hugging Face
  model. Where Hugging Face fuses modules that the ONNX model adapts per slice (Phi-3's
  ``qkv_proj`` and ``gate_up_proj``), the slices' adapters become one adapter of the fused
  module with rank ``m * r`` and ``lora_alpha`` ``m * alpha`` (``rank_pattern``/``alpha_pattern``):
  A stacked, B block-diagonal, the same function exactly.
* **onnxruntime** (:func:`write_onnxruntime`): ``onnxruntime.AdapterFormat``, the tensors under
  the model's own names, in MatMul's layout and the activations' dtype, B scaled by
  ``alpha / r``: what onnxruntime's ``RunOptions.add_active_adapter`` and onnxruntime-genai's
  multi-LoRA (``og.Adapters``, ``generator.set_active_adapter``) feed to the base model that
  :func:`write_serving_model` writes, whose adapter weights are inputs (rank ``lora_r``
  dynamic, empty by default: the base model).

:func:`read_adapter` reads either back for a model with the same adapters, refusing an
adapter made for another base (names, ranks or shapes that differ).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping

import numpy as np
import onnx

from ..errors import TrainingOpError
from ..storage import as_model, safetensors
from ..storage.checkpoint import atomic_write
from ..storage.model_files import model_file
from ..storage.save import save_model
from ..storage.tensors import all_tensors, location
from .inject import insert_adapters, read_genai_config
from .spec import Adapter, LoraSpec, lora_spec
from .targets import ALL_LINEAR, FUSED, linear_nodes

FORMATS = ("peft", "onnxruntime")
PEFT_WEIGHTS = "adapter_model.safetensors"
PEFT_CONFIG = "adapter_config.json"
PEFT_PREFIX = "base_model.model."
ADAPTER_SUFFIX = ".onnx_adapter"
# model types (genai_config.json) whose Hugging Face modules fuse what the ONNX model adapts per slice
FUSED_HF = {"phi3": {"q_proj": "qkv_proj", "k_proj": "qkv_proj", "v_proj": "qkv_proj",
                     "gate_proj": "gate_up_proj", "up_proj": "gate_up_proj"}}
PEFT_ALPHA = 8  # LoraConfig's default lora_alpha


def save_adapter(spec: LoraSpec | None, values: Mapping[str, np.ndarray], path: str | os.PathLike,
                 format: str = "peft", base_model: str | os.PathLike | None = None) -> str:  # noqa: A002
    """Write the adapters ``values`` (A and B by the model's names) of a model described by ``spec``.

    Args:
        spec: the model's LoRA record (None: the model has none: an error).
        values: the adapters' current tensors.
        path: a folder (``format="peft"``) or an ``.onnx_adapter`` file (``"onnxruntime"``).
        format: ``"peft"`` or ``"onnxruntime"``.
        base_model: with ``"onnxruntime"``: also write the base model that serves it there
            (:func:`write_serving_model`), once for every adapter of these targets.

    Returns:
        The path written.
    """
    if spec is None:
        raise TrainingOpError("the model has no LoRA adapters: make it with onnx_training_ops.add_lora")
    if format not in FORMATS:
        raise TrainingOpError(f"format must be one of {', '.join(map(repr, FORMATS))}, found {format!r}")
    missing = [n for n in spec.trainable if n not in values]
    if missing:
        raise TrainingOpError(f"the adapters' tensors {', '.join(missing[:4])} are not in the session's state")
    if format == "peft":
        if base_model is not None:
            raise TrainingOpError("base_model is for format='onnxruntime' (peft loads onto the Hugging Face model)")
        return write_peft(spec, values, path)
    written = write_onnxruntime(spec, values, path)
    if base_model is not None:
        write_serving_model(spec, base_model)
    return written


# ---------------------------------------------------------------- peft


def _fused_groups(spec: LoraSpec) -> dict[str, list[Adapter]]:
    """Hugging Face module -> the adapters that make its LoRA (several on a fused module)."""
    fused = FUSED_HF.get(spec.model_type or "", {})
    groups: dict[str, list[Adapter]] = {}
    for a in spec.adapters:
        prefix, _, last = a.module.rpartition(".")
        name = f"{prefix}.{fused[last]}" if last in fused and prefix else a.module
        groups.setdefault(name, []).append(a)
    return groups


def _fused_layout(group: list[Adapter]) -> tuple[int, list[int]]:
    """(width of the Hugging Face module, where each adapter's rows start in it) for a group of
    :func:`_fused_groups`: slices of one fused node keep their place in it; separate nodes (the
    builder's unfused ``gate_proj``/``up_proj`` of Phi-3's ``gate_up_proj``) are parts of equal
    width in :data:`~.targets.FUSED`'s order."""
    if len({a.output for a in group}) == 1:
        return group[0].node_out_features, [a.start for a in group]
    last = group[0].module.rpartition(".")[2]
    parts = next(p for p in FUSED.values() if last in p)
    width = group[0].node_out_features
    return width * len(parts), [parts.index(a.module.rpartition(".")[2]) * width for a in group]


def peft_tensors(spec: LoraSpec, values: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], dict, dict]:
    """(peft's tensors, rank_pattern, alpha_pattern) of the adapters ``values``."""
    tensors, ranks, alphas = {}, {}, {}
    for module, group in _fused_groups(spec).items():
        key = f"{PEFT_PREFIX}{module}"
        if len(group) == 1 and group[0].module == module:  # a module Hugging Face has too
            a = group[0]
            tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(values[a.a].T, np.float32)
            tensors[f"{key}.lora_B.weight"] = np.ascontiguousarray(values[a.b].T, np.float32)
            continue
        r = spec.rank
        big_a = np.concatenate([values[a.a].T for a in group], axis=0)
        width, offsets = _fused_layout(group)
        big_b = np.zeros((width, r * len(group)), np.float32)
        for i, (a, at) in enumerate(zip(group, offsets)):
            big_b[at:at + a.out_features, i * r:(i + 1) * r] = values[a.b].T
        tensors[f"{key}.lora_A.weight"] = np.ascontiguousarray(big_a, np.float32)
        tensors[f"{key}.lora_B.weight"] = big_b
        ranks[module] = r * len(group)
        alphas[module] = spec.alpha * len(group)
    return tensors, ranks, alphas


def write_peft(spec: LoraSpec, values: Mapping[str, np.ndarray], folder: str | os.PathLike) -> str:
    """A peft adapter folder for ``PeftModel.from_pretrained(hf_model, folder)``."""
    folder = os.fspath(folder)
    if os.path.isfile(folder):
        raise TrainingOpError(f"{folder!r} is a file: format='peft' writes a folder")
    tensors, ranks, alphas = peft_tensors(spec, values)
    modules = sorted({key[len(PEFT_PREFIX):].rsplit(".", 2)[0] for key in tensors})
    short = sorted({m.rpartition(".")[2] for m in modules})
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": None,
        "r": spec.rank,
        "lora_alpha": spec.alpha,
        "lora_dropout": spec.dropout,
        # a list of names picks every module ending in one: exact when the targets were names (or
        # all-linear); a pattern may have picked some layers only: their full paths then
        "target_modules": short if not isinstance(spec.targets, str) or spec.targets == ALL_LINEAR else modules,
        "rank_pattern": ranks,
        "alpha_pattern": alphas,
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    os.makedirs(folder, exist_ok=True)
    atomic_write(os.path.join(folder, PEFT_WEIGHTS), safetensors.encode(tensors, {"format": "pt"}))
    atomic_write(os.path.join(folder, PEFT_CONFIG), (json.dumps(config, indent=2) + "\n").encode())
    return folder


def _peft_folder(folder: str) -> tuple[dict, dict[str, dict[str, np.ndarray]]]:
    """A peft folder's config (checked: plain LoRA) and its tensors: module -> {lora_A, lora_B}."""
    try:
        with open(os.path.join(folder, PEFT_CONFIG), encoding="utf-8") as f:
            config = json.load(f)
    except (OSError, ValueError) as error:
        raise TrainingOpError(f"{folder!r}: cannot read {PEFT_CONFIG} ({error})") from None
    for key, ok in (("peft_type", "LORA"), ("use_dora", False), ("use_rslora", False), ("fan_in_fan_out", False)):
        if config.get(key, ok) != ok:
            raise TrainingOpError(f"{folder!r}: {key}={config[key]!r} is not plain LoRA ({key} must be {ok!r})")
    weights = os.path.join(folder, PEFT_WEIGHTS)
    if not os.path.isfile(weights):
        raise TrainingOpError(f"{folder!r} has no {PEFT_WEIGHTS}")
    stored, _ = safetensors.read(weights)
    found: dict[str, dict[str, np.ndarray]] = {}
    for key, value in stored.items():
        body = key[len(PEFT_PREFIX):] if key.startswith(PEFT_PREFIX) else key
        for part in ("lora_A", "lora_B"):
            for suffix in (f".{part}.weight", f".{part}.default.weight"):
                if body.endswith(suffix):
                    found.setdefault(body[: -len(suffix)], {})[part] = value
    return config, found


def read_peft(spec: LoraSpec, folder: str) -> dict[str, np.ndarray]:
    """The model's adapter tensors from a peft folder (B rescaled when its ``lora_alpha / r``
    differs from the model's)."""
    config, found = _peft_folder(folder)
    groups = _fused_groups(spec)
    extra = sorted(set(found) - set(groups))
    if extra:
        raise TrainingOpError(f"the adapter in {folder!r} adapts modules this model does not: "
                              f"{', '.join(extra[:4])}{' ...' if len(extra) > 4 else ''}: it was made for another "
                              "base model or other targets")
    out = {}
    for module, group in groups.items():
        pair = found.get(module, {})
        if set(pair) != {"lora_A", "lora_B"}:
            raise TrainingOpError(f"the adapter in {folder!r} has no lora_A/lora_B for module {module!r}: it was "
                                  "made for another base model or other targets")
        alpha = _pattern(config.get("alpha_pattern") or {}, module, config.get("lora_alpha", PEFT_ALPHA))
        big_a, big_b = (np.asarray(pair[p], np.float32) for p in ("lora_A", "lora_B"))
        if big_a.ndim != 2 or big_b.ndim != 2 or big_a.shape[0] != big_b.shape[1]:
            raise TrainingOpError(f"the adapter in {folder!r}: module {module!r} has lora_A {list(big_a.shape)} and "
                                  f"lora_B {list(big_b.shape)}, which do not multiply")
        rescale = np.float32((float(alpha) / big_a.shape[0]) / spec.scaling)  # its scaling -> the model's
        _, offsets = _fused_layout(group)
        for i, (a, at) in enumerate(zip(group, offsets)):
            rows_b = slice(at, at + a.out_features)
            if len(group) == 1 and a.module == module:
                a_part, b_part = big_a, big_b
            elif big_a.shape[0] == spec.rank * len(group):  # the stacked form write_peft makes
                rows = slice(i * spec.rank, (i + 1) * spec.rank)
                a_part, b_part = big_a[rows], big_b[rows_b, rows]
            else:  # one A shared by the fused module (peft's LoRA of it): each slice its rows of B
                a_part, b_part = big_a, big_b[rows_b]
            _check_shape(folder, module, "lora_A", a_part.shape, (spec.rank, a.in_features))
            _check_shape(folder, module, "lora_B", b_part.shape, (a.out_features, spec.rank))
            out[a.a] = np.ascontiguousarray(a_part.T)
            out[a.b] = np.ascontiguousarray(b_part.T * rescale)
    return out


def _pattern(patterns: Mapping[str, object], module: str, default):
    """peft's per-module ``rank_pattern``/``alpha_pattern`` lookup."""
    for key, value in patterns.items():
        if re.match(rf"(.*\.)?({key})$", module):
            return value
    return default


def _check_shape(where: str, module: str, part: str, found, want) -> None:
    if tuple(found) != tuple(want):
        rank = want[0] if part == "lora_A" else want[1]
        raise TrainingOpError(f"the adapter in {where!r}: module {module!r} {part} is {list(found)} where this "
                              f"model's adapter is {list(want)} (peft's layout, rank {rank}): it was made for "
                              "another base model or another rank")


# ---------------------------------------------------------------- onnxruntime


def onnxruntime_tensors(spec: LoraSpec, values: Mapping[str, np.ndarray]) -> dict[str, np.ndarray]:
    """The served adapter's tensors: A and B (scaled) in the activations' dtype."""
    dtype = np.dtype(spec.activation_dtype)
    out = {}
    for a in spec.adapters:
        out[a.a] = np.ascontiguousarray(values[a.a], dtype)
        out[a.b] = np.ascontiguousarray(np.asarray(values[a.b], np.float32) * np.float32(spec.scaling), dtype)
    return out


def write_onnxruntime(spec: LoraSpec, values: Mapping[str, np.ndarray], path: str | os.PathLike) -> str:
    """An ``.onnx_adapter`` file (``onnxruntime.AdapterFormat``), written atomically."""
    import onnxruntime as ort

    path = os.fspath(path)
    if os.path.isdir(path):
        raise TrainingOpError(f"{path!r} is a folder: format='onnxruntime' writes an {ADAPTER_SUFFIX} file")
    adapter = ort.AdapterFormat()
    adapter.set_adapter_version(1)
    adapter.set_model_version(1)
    tensors = onnxruntime_tensors(spec, values)
    adapter.set_parameters({name: ort.OrtValue.ortvalue_from_numpy(v) for name, v in tensors.items()})
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".{os.path.basename(path)}.{os.getpid()}.tmp")
    try:
        adapter.export_adapter(tmp)
        with open(tmp, "rb") as f:
            data = f.read()
    finally:
        if os.path.exists(tmp):
            os.remove(tmp)
    return atomic_write(path, data)


def read_onnxruntime(spec: LoraSpec, path: str) -> dict[str, np.ndarray]:
    """The model's adapter tensors from an ``.onnx_adapter`` file (B unscaled)."""
    import onnxruntime as ort

    try:
        params = ort.AdapterFormat.read_adapter(path).get_parameters()
    except Exception as error:  # noqa: BLE001 - onnxruntime's RuntimeError / Fail
        raise TrainingOpError(f"{path!r} is not an onnxruntime adapter file ({error})") from None
    stored = {name: np.asarray(v.numpy(), np.float32) for name, v in params.items()}
    wanted = {n for a in spec.adapters for n in (a.a, a.b)}
    if set(stored) != wanted:
        extra, missing = sorted(set(stored) - wanted), sorted(wanted - set(stored))
        said = ([f"tensors this model has no adapter for: {', '.join(extra[:4])}"] if extra else []) + \
            ([f"this model's adapters it lacks: {', '.join(missing[:4])}"] if missing else [])
        raise TrainingOpError(f"the adapter {path!r} was made for another base model or other targets: "
                              + "; ".join(said))
    out = {}
    for a in spec.adapters:
        _check_shape(path, a.module, "lora_A", stored[a.a].T.shape, (spec.rank, a.in_features))
        _check_shape(path, a.module, "lora_B", stored[a.b].T.shape, (a.out_features, spec.rank))
        out[a.a] = stored[a.a]
        out[a.b] = stored[a.b] / np.float32(spec.scaling)
    return out


def read_adapter(spec: LoraSpec | None, path: str | os.PathLike) -> dict[str, np.ndarray]:
    """The model's adapter tensors (by its names) from a peft folder or an ``.onnx_adapter`` file.

    Raises:
        TrainingOpError: the model has no adapters, the path is neither, or the adapter was
            made for another base (modules, ranks or shapes differ).
    """
    if spec is None:
        raise TrainingOpError("the model has no LoRA adapters: make it with onnx_training_ops.add_lora")
    path = os.fspath(path)
    if os.path.isdir(path):
        return read_peft(spec, path)
    if not os.path.isfile(path):
        raise TrainingOpError(f"no adapter at {path!r} (a peft folder or an {ADAPTER_SUFFIX} file)")
    return read_onnxruntime(spec, path)


# ---------------------------------------------------------------- the served base model


def _source(spec: LoraSpec, source: str | os.PathLike | None) -> str:
    source = os.fspath(source) if source is not None else spec.source
    if source is None:
        raise TrainingOpError("add_lora was given a model in memory, so its file is unknown: write the served "
                              "base model with onnx_training_ops.lora.write_serving_model(spec, folder, "
                              "source=<the model's file or folder>)")
    return os.path.abspath(source)


def serving_model(spec: LoraSpec, source: str | os.PathLike | None = None):
    """The base model with the adapters' weights as inputs (a LargeModel): ``source`` (default:
    the file or folder add_lora read) with the adapters' serving form beside the same nodes."""
    source = _source(spec, source)
    opened = as_model(source)
    proto = opened.model_proto
    if lora_spec(proto) is not None:
        raise TrainingOpError(f"{source!r} already has LoRA adapters: pass the base model add_lora was given")
    decoder = (read_genai_config(source) or {}).get("model", {}).get("decoder")
    linears = {lin.output: lin for lin in linear_nodes(proto, decoder)}
    chosen, order = {}, []
    for a in spec.adapters:
        lin = linears.get(a.output)
        slices = {(s.start, s.stop): s for s in lin.slices} if lin is not None else {}
        if (a.start, a.stop) not in slices or lin.in_features != a.in_features:
            raise TrainingOpError(f"{source!r} is not the base model the adapters were added to: no linear node "
                                  f"computes {a.output!r} [{a.start}:{a.stop}] from {a.in_features} features")
        if a.output not in chosen:
            chosen[a.output] = (lin, [])
        chosen[a.output][1].append(slices[(a.start, a.stop)])
        order.append(a)
    by_output = {a.output: [] for a in order}
    for a in order:
        by_output[a.output].append(a)
    names = [a for output in chosen for a in by_output[output]]
    insert_adapters(proto, list(chosen.values()), 1.0, 0.0, serve=True, names=names)
    return opened


def write_serving_model(spec: LoraSpec, folder: str | os.PathLike, source: str | os.PathLike | None = None) -> str:
    """Write the base model that serves adapters of ``spec``'s targets into ``folder``.

    The model ``source`` with each adapter's serving form beside its linear node: A and B are
    graph inputs of rank ``lora_r`` (in the activations' dtype), empty by default (the base
    model), fed by an ``.onnx_adapter`` file (onnxruntime's ``RunOptions.add_active_adapter``,
    onnxruntime-genai's ``Adapters``). For onnxruntime-genai's folder the other files
    (``genai_config.json``, the tokenizer's) are copied beside it.

    Args:
        spec: the LoRA record of a model from :func:`~onnx_training_ops.add_lora`
            (:func:`~onnx_training_ops.lora.lora_spec`).
        folder: where to write; not the source's own folder.
        source: the model add_lora was given (a file or builder folder); default the path
            it was given as.

    Returns:
        The model file written.

    Raises:
        TrainingOpError: no source known, a source that is not the base model the adapters
            were added to, or the source's own folder as ``folder``.
    """
    source = _source(spec, source)
    folder = os.path.abspath(os.fspath(folder))
    model = serving_model(spec, source)
    src_dir = source if os.path.isdir(source) else os.path.dirname(source)
    if os.path.abspath(src_dir) == folder:
        raise TrainingOpError(f"{folder!r} holds the base model itself: write the served model to another folder")
    src_model = model_file(source)
    skipped = {os.path.abspath(src_model)}  # the model and its external data: written anew
    for tensor in all_tensors(onnx.load(src_model, load_external_data=False)):
        where = location(tensor)
        if where is not None:
            skipped.add(os.path.abspath(os.path.join(src_dir, where)))
    os.makedirs(folder, exist_ok=True)
    if os.path.isdir(source):
        for name in sorted(os.listdir(src_dir)):
            path = os.path.join(src_dir, name)
            if os.path.isfile(path) and os.path.abspath(path) not in skipped:
                shutil.copy2(path, os.path.join(folder, name))
    return save_model(model, os.path.join(folder, os.path.basename(src_model)), external=True)
