"""One model type whatever the size (issue 31 item 6).

Inside the package a model is a :class:`~onnx_training_ops.storage.LargeModel` (a message
and its big tensors as arrays) whatever its size; each public entry normalizes what it is
given once (``storage.as_model``) and hands back ``public()``. Here a small real model goes
through every public path twice: as it is, and with the large-model threshold forced below
its size (the path a model past 256 MiB takes). Each result must equal the unforced one; the
forced run must really take the large path (LargeModels returned, data files written).
Last, no module outside ``storage/`` branches on the type.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

import numpy as np
import onnx
import onnxruntime as ort
import pytest

from onnx_training_ops import Adam, InferenceSession, TrainingSession, build_training_model, prepare
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.export import export_step, session_from_export
from onnx_training_ops.storage import LargeModel, as_model, data_files, tensors
from onnx_training_ops.storage.checkpoint import CHECKSUM_KEY
from onnx_training_ops.training.summary import summary

SIZES = (16, 32, 4)  # W0: 2 KB, detached (>= 1 KB); the training model ~7 KB
FORCED = 1024  # bytes: the model is "large"


@pytest.fixture(params=["unforced", "forced"])
def forced(request, monkeypatch):
    """Run the test with the threshold as it is, then forced below the model's size."""
    monkeypatch.delenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", raising=False)
    if request.param == "forced":
        monkeypatch.setattr(tensors, "LARGE_MODEL_BYTES", FORCED)
    return request.param == "forced"


def _batch(seed: int, n: int = 8) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((n, SIZES[0])).astype(np.float32),
            "labels": rng.integers(0, SIZES[-1], n).astype(np.int64)}


def _training() -> onnx.ModelProto | LargeModel:
    return build_training_model(make_mlp(SIZES), "cross_entropy", Adam(lr=1e-2))


def _proto(model) -> onnx.ModelProto:
    """Every tensor in the message, without the checksum record (a large model gets its
    checksums when written)."""
    proto = as_model(model).to_proto()
    kept = [m for m in proto.metadata_props if m.key != CHECKSUM_KEY]
    del proto.metadata_props[:]
    proto.metadata_props.extend(kept)
    return proto


def _run(tmp_path: Path, forced: bool) -> dict:
    """Every public path on the model; what each gave, comparable across the two runs."""
    out: dict = {}
    training = _training()
    assert isinstance(training, LargeModel) == forced
    assert prepare(training).__class__ is training.__class__
    out["training"] = _proto(training).SerializeToString()
    out["prepared"] = _proto(prepare(training, portable=True)).SerializeToString()
    out["summary"] = repr(summary(training))

    session = TrainingSession(training)
    out["losses"] = [float(session.step(_batch(i))["loss"]) for i in range(3)]
    out["state"] = session.state_dict()
    out["session_summary"] = repr(session.summary())
    out["torch_state"] = session.to_torch_state_dict(tensors=False)
    snapshot = session.training_model()
    assert isinstance(snapshot, LargeModel) == forced
    assert (CHECKSUM_KEY in {m.key for m in _meta(snapshot)}) != forced  # small: checksummed in memory
    out["snapshot"] = _proto(snapshot).SerializeToString()
    out["snapshot_summary"] = repr(summary(snapshot))

    ckpt = str(tmp_path / "ckpt.onnx")
    session.save(ckpt)
    assert bool(data_files(ckpt)) == forced
    resumed = TrainingSession(ckpt)
    out["resumed"] = [float(resumed.step(_batch(i))["loss"]) for i in range(3, 5)]
    assert out["resumed"] == [float(session.step(_batch(i))["loss"]) for i in range(3, 5)]
    out["nominal"] = _nominal(session, tmp_path)

    x = _batch(9)["input"]
    exported = session.export_inference_model()
    assert isinstance(exported, LargeModel) == forced
    out["inference"] = _proto(exported).SerializeToString()
    out["inference_run"] = InferenceSession(exported).run(None, {"input": x})[0]
    path = str(tmp_path / "inference.onnx")
    written = session.export_inference_model(path)
    assert isinstance(written, LargeModel) == forced and bool(data_files(path)) == forced
    assert _proto(written).SerializeToString() == out["inference"]
    plain = ort.InferenceSession(path, providers=["CPUExecutionProvider"]).run(None, {"input": x})[0]
    assert np.array_equal(plain, out["inference_run"])
    assert np.array_equal(session.run(None, {"input": x})[0], plain)
    hidden = make_mlp(SIZES).graph.node[0].output[0]
    partial = session.export_inference_model(outputs=[hidden])
    out["partial"] = _proto(partial).SerializeToString()

    directory = tmp_path / "export"
    export_step(session, directory)
    files = sorted(p.name for p in directory.iterdir())
    out["export_files"] = files
    out["export_bytes"] = {name: (directory / name).read_bytes() for name in files if name != "manifest.json"}
    from_export = session_from_export(directory)
    rate = {"learning_rate": np.array(1e-2, np.float32)}
    out["from_export"] = [float(from_export.step({**_batch(i), **rate})["loss"]) for i in range(5, 7)]
    assert out["from_export"] == pytest.approx([float(session.step(_batch(i))["loss"]) for i in range(5, 7)],
                                               rel=1e-5)
    ckpt_export = tmp_path / "export_ckpt"
    export_step(ckpt, ckpt_export)  # from the checkpoint file (external data when forced)
    out["export_ckpt_state"] = (ckpt_export / "state.safetensors").read_bytes()
    return out


def _meta(model) -> list:
    return list((model.model_proto if isinstance(model, LargeModel) else model).metadata_props)


def _nominal(session: TrainingSession, tmp_path: Path) -> list[float]:
    """A nominal checkpoint opened, its parameters loaded, trained: its losses."""
    path = str(tmp_path / "nominal.onnx")
    session.save(path, nominal=True)
    opened = TrainingSession(path)
    assert opened.nominal
    opened.load_flat_parameters(session.get_flat_parameters(trainable_only=False), trainable_only=False)
    return [float(opened.step(_batch(i))["loss"]) for i in range(2)]


@pytest.fixture(scope="module")
def unforced_results(tmp_path_factory):
    with pytest.MonkeyPatch.context() as mp:
        mp.delenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", raising=False)
        return _run(tmp_path_factory.mktemp("unforced"), forced=False)


def test_every_path_of_a_model_forced_large_gives_the_small_paths_results(tmp_path, monkeypatch,
                                                                          unforced_results):
    monkeypatch.delenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", raising=False)
    monkeypatch.setattr(tensors, "LARGE_MODEL_BYTES", FORCED)
    assert tensors.large_model_bytes() == FORCED
    got = _run(tmp_path, forced=True)
    assert sorted(got) == sorted(unforced_results)
    for key, want in unforced_results.items():
        if key in ("state", "torch_state", "export_bytes"):
            assert sorted(got[key]) == sorted(want), key
            for name, value in want.items():
                assert np.array_equal(got[key][name], value) if isinstance(value, np.ndarray) \
                    else got[key][name] == value, (key, name)
        elif isinstance(want, np.ndarray):
            assert np.array_equal(got[key], want), key
        else:
            assert got[key] == want, key


def test_the_small_path_keeps_its_public_types(forced, tmp_path):
    """Unforced, the public functions return ModelProtos as before; forced, LargeModels."""
    training = _training()
    session = TrainingSession(training)
    results = [training, prepare(training), session.training_model(), session.export_inference_model()]
    assert all(isinstance(r, LargeModel) == forced for r in results)
    assert all(isinstance(r, onnx.ModelProto) != forced for r in results)


def test_as_model_is_the_one_type_whatever_the_size(forced, tmp_path):
    model = make_mlp(SIZES)
    opened = as_model(model)
    assert isinstance(opened, LargeModel) and opened.large == forced
    assert bool(opened.large_initializers) == forced  # big tensors detached only when large
    assert opened.model_proto is not model  # a copy: what the caller gave is left as it was
    assert as_model(opened, copy=False) is opened
    path = str(tmp_path / "m.onnx")
    onnx.save(model, path)
    assert as_model(path).large == forced
    assert as_model(LargeModel(model)).large  # a LargeModel given is large
    small = as_model(model, copy=False)
    assert small.model_proto is model or forced
    assert _proto(opened).SerializeToString() == model.SerializeToString()


SOURCE = Path(__file__).resolve().parents[1] / "onnx_training_ops"
BRANCH = re.compile(r"isinstance\([^)]*\bLargeModel\b|\bis_large\b|isinstance\([^)]*\bModelContainer\b")


def test_no_module_outside_storage_branches_on_the_model_type():
    """What differs by size lives in storage/ (the model type, the readers and writers)."""
    found = []
    for path in sorted(SOURCE.rglob("*.py")):
        if path.relative_to(SOURCE).parts[0] == "storage":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if BRANCH.search(line):
                found.append(f"{path.relative_to(SOURCE.parent)}:{number}: {line.strip()}")
    assert not found, "\n".join(found)
    assert os.path.isdir(SOURCE / "storage")  # the scan looked at the package
