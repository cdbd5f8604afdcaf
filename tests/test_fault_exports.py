"""Fault suite, exports (issue 29 items 1-7, 17): a damaged or hostile export directory gives one
TrainingOpError naming the file and field, and changes nothing. Before the fixes: KeyError /
AttributeError / TypeError for bad manifest fields, a torn session after a bad schedule, a
state read from another directory through ``..``, labels -1/C/99 trained by the exported step,
flipped bytes accepted, ``cannot reshape array of size 0`` for a nominal checkpoint and
``'LargeModel' object has no attribute 'metadata_props'`` past the large-model threshold."""

from __future__ import annotations

import hashlib
import json
import os
import shutil

import numpy as np
import pytest

import onnx_training_ops as ot
from onnx_training_ops import schedules
from onnx_training_ops.cli import main
from onnx_training_ops.demo import make_mlp
from onnx_training_ops.errors import TrainingOpError
from onnx_training_ops.export import export_step, load_state, read_state, session_from_export
from onnx_training_ops.storage import safetensors

CLASSES = 4


def _model(**kwargs):
    return ot.build_training_model(make_mlp((8, 16, CLASSES)), "cross_entropy", ot.Adam(lr=1e-2), **kwargs)


def _batch(seed=0, n=6):
    rng = np.random.default_rng(seed)
    return {"input": rng.standard_normal((n, 8)).astype(np.float32), "labels": rng.integers(0, CLASSES, n)}


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    """A mid-run export with a schedule (exported once, copied per test)."""
    session = ot.TrainingSession(_model())
    session.set_lr_schedule(schedules.StepLR(step_size=2, gamma=0.5))
    for i in range(3):
        session.step(_batch(i))
    out = tmp_path_factory.mktemp("export") / "export"
    export_step(session, out)
    return out


@pytest.fixture
def export(exported, tmp_path):
    out = tmp_path / "export"
    shutil.copytree(exported, out)
    return out


def _edit(directory, change):
    path = directory / "manifest.json"
    manifest = json.loads(path.read_text())
    change(manifest)
    path.write_text(json.dumps(manifest))


def _snapshot(session):
    return {k: v.copy() for k, v in session.state_dict().items()}, session.lr_schedule, session.lr_schedule_step


def _assert_unchanged(session, before):
    state, schedule, position = before
    after = session.state_dict()
    for name, value in state.items():
        np.testing.assert_array_equal(after[name], value, err_msg=name)
    assert session.lr_schedule == schedule and session.lr_schedule_step == position


def _delete(key):
    return lambda m: m.pop(key)


def _set(path, value):
    def change(m):
        *parents, last = path
        for p in parents:
            m = m[p]
        m[last] = value
    return change


MANIFEST_FAULTS = {
    "no files": (_delete("files"), r"lacks the required field 'files'"),
    "no state": (_delete("state"), r"lacks the required field 'state'"),
    "no feedback": (_delete("feedback"), r"lacks the required field 'feedback'"),
    "files a list": (_set(["files"], ["step.onnx"]), r"field 'files' must be"),
    "no step file": (lambda m: m["files"].pop("step"), r"field 'files' lacks the entry 'step'"),
    "path a number": (_set(["files", "state", "path"], 5), r"field \"files\['state'\]\.path\" must be"),
    "feedback a list": (_set(["feedback"], [["W0", "W0_new"]]), r"field 'feedback' must be an object"),
    "feedback unknown input": (lambda m: m["feedback"].update({"nope": "x"}),
                               r"field 'feedback' names 'nope', which is not a state variable"),
    "feedback output a number": (lambda m: m["feedback"].update({"W0": 3}), r"field \"feedback\['W0'\]\" must be"),
    "schedule without counter": (lambda m: m["schedule"].pop("counter"), r"field 'schedule' lacks 'counter'"),
    "step_offset a string": (_set(["schedule", "step_offset"], "0"),
                             r"field 'schedule.step_offset' must be an integer"),
    "step_offset a float": (_set(["schedule", "step_offset"], 1.5), r"field 'schedule.step_offset' must be an integer"),
    "schedule unknown type": (_set(["schedule", "type"], "Fast"), r"field 'schedule.type' must be one of"),
    "schedule args a list": (_set(["schedule", "args"], [2]), r"field 'schedule.args' must be an object"),
    "state shape text": (_set(["state", 0, "shape"], "abc"), r"field 'state\[0\]\.shape' must be a list"),
    "state dtype unknown": (_set(["state", 0, "dtype"], "float99"), r"field 'state\[0\]\.dtype' must be"),
    "state entry a string": (_set(["state", 0], "W0"), r"field 'state\[0\]' must be an object"),
    "rate base text": (_set(["learning_rates", 0, "base"], "fast"), r"field 'learning_rates\[0\]\.base' must be"),
    "classes text": (_set(["classes"], "4"), r"field 'classes' must be an integer >= 1"),
    "counter unknown": (_set(["counter"], "T9"), r"field 'counter' must be a state variable"),
    "schedule type a list": (_set(["schedule", "type"], []), r"field 'schedule.type' must be one of"),
    "rate base huge": (_set(["learning_rates", 0, "base"], 10 ** 400), None),
    "manifest a list": (None, r"not an onnx-training-ops export manifest"),
}


@pytest.mark.parametrize("case", list(MANIFEST_FAULTS))
def test_bad_manifest_fields_are_named_and_change_nothing(export, case):
    change, message = MANIFEST_FAULTS[case]
    if message is None:  # a valid manifest (a big int is a number): loads
        _edit(export, change)
        read_state(export)
        return
    if change is None:
        (export / "manifest.json").write_text("[1, 2]")
    else:
        _edit(export, change)
    session = ot.TrainingSession(_model())
    before = _snapshot(session)
    for call in (lambda: read_state(export), lambda: load_state(session, export), lambda: session_from_export(export)):
        with pytest.raises(TrainingOpError, match=message) as error:
            call()
        assert "manifest.json" in str(error.value)
    _assert_unchanged(session, before)


@pytest.mark.parametrize("args, step_offset, message", [
    ({"bogus": 2}, 0, r"field 'schedule.args' .* does not fit StepLR"),
    ({"step_size": 2, "gamma": "half"}, 0, r"field 'schedule.args': StepLR: gamma must be a finite number"),
    ({"step_size": 2, "gamma": 0.5}, -1000,
     r"field 'schedule.step_offset' is -1000, so the schedule's position .* is -997"),
])
def test_load_state_with_a_bad_schedule_keeps_the_session(export, args, step_offset, message):
    _edit(export, lambda m: m["schedule"].update(args=args, step_offset=step_offset))
    session = ot.TrainingSession(_model())
    session.set_lr_schedule(schedules.ExponentialLR(gamma=0.9), 1)
    session.step(_batch(7))
    before = _snapshot(session)
    with pytest.raises(TrainingOpError, match=message):
        load_state(session, export)
    _assert_unchanged(session, before)


def test_load_state_with_a_state_that_does_not_fit_keeps_the_schedule(export):
    session = ot.TrainingSession(ot.build_training_model(make_mlp((8, 16, 5)), "cross_entropy", ot.Adam()))
    before = _snapshot(session)
    with pytest.raises(TrainingOpError, match=r"'W1' has shape \[16, 5\], found \[16, 4\]"):
        load_state(session, export)
    _assert_unchanged(session, before)


def test_a_valid_export_still_loads_with_its_schedule(export):
    session = ot.TrainingSession(_model())
    load_state(session, export)
    assert isinstance(session.lr_schedule, schedules.StepLR) and session.lr_schedule_step == 3


@pytest.mark.parametrize("path", ["../other/state.safetensors", "/tmp/state.safetensors", "sub/../../x",
                                  "..\\other\\state.safetensors"])
def test_paths_leaving_the_directory_are_refused(export, tmp_path, path):
    other = tmp_path / "other"
    other.mkdir()
    shutil.copy(export / "state.safetensors", other / "state.safetensors")
    _edit(export, _set(["files", "state", "path"], path))
    with pytest.raises(TrainingOpError, match=r"manifest.json.*files\['state'\]\.path.*inside the export directory"):
        read_state(export)


@pytest.mark.parametrize("kind", ["state", "step"])
def test_a_symlink_out_of_the_directory_is_refused(export, tmp_path, kind):
    name = {"state": "state.safetensors", "step": "step.onnx"}[kind]
    outside = tmp_path / f"outside-{name}"
    shutil.move(export / name, outside)
    os.symlink(outside, export / name)
    for call in (lambda: read_state(export), lambda: session_from_export(export)):
        with pytest.raises(TrainingOpError, match=rf"files\['{kind}'\]\.path.*outside the export directory"):
            call()
    os.unlink(export / name)  # a symlink inside the directory is fine
    os.makedirs(export / "inner")
    shutil.move(outside, export / "inner" / name)
    os.symlink(os.path.join("inner", name), export / name)
    read_state(export)


def test_feedback_naming_an_output_the_step_lacks_is_named(export):
    _edit(export, lambda m: m["feedback"].update({"W0": "not_an_output"}))
    with pytest.raises(TrainingOpError, match=r"manifest.json': field 'feedback' does not fit 'step.onnx': .*"
                                              r"'not_an_output' is not an output of the graph"):
        session_from_export(export)


@pytest.mark.parametrize("change, message", [
    (lambda p: p.update(members=[]), r"field 'packs\[0\]\.members' must be a non-empty list"),
    (lambda p: p["members"][1].update(offset=p["members"][1]["offset"] + 1),
     r"field 'packs\[0\]\.members\[1\]\.offset' must be"),
    (lambda p: p.update(size=p["size"] - 1), r"field 'packs\[0\]\.size' must be"),
    (lambda p: p["members"][0].update(shape=[1]),
     r"field 'packs\[0\]\.members\[0\]': float32 \[1\], the state variable"),
    (lambda p: p["members"].append(dict(p["members"][0])), r"is not a fed-back state variable, or is packed twice"),
])
def test_packs_that_do_not_lay_out_the_state_are_refused(tmp_path, change, message):
    export_step(_model(), tmp_path, packed=True)
    _edit(tmp_path, lambda m: change(m["packs"][0]))
    with pytest.raises(TrainingOpError, match=message):
        session_from_export(tmp_path, packed=True)


def test_every_file_digest_is_recorded(export):
    manifest = json.loads((export / "manifest.json").read_text())
    assert set(manifest["files"]) == {"step", "eval", "inference", "state"}
    for entry in manifest["files"].values():
        assert entry["sha256"] == hashlib.sha256((export / entry["path"]).read_bytes()).hexdigest()
    _, metadata = safetensors.read(export / "state.safetensors")
    data = (export / "state.safetensors").read_bytes()
    start = 8 + int.from_bytes(data[:8], "little")
    assert metadata["sha256"] == hashlib.sha256(data[start:]).hexdigest()


def _flip(path, offset):
    data = bytearray(path.read_bytes())
    data[offset] ^= 0x01
    path.write_bytes(bytes(data))


def test_every_flipped_state_byte_is_caught(export):
    """Each byte of the tensor data, flipped alone: the manifest's digest names the file; without
    the manifest (a bare file) the state file's own digest does; verify=False reads it."""
    path = export / "state.safetensors"
    original = path.read_bytes()
    start = 8 + int.from_bytes(original[:8], "little")
    session = ot.TrainingSession(_model())
    before = _snapshot(session)
    for offset in range(start, len(original), max(1, (len(original) - start) // 97)):
        _flip(path, offset)
        with pytest.raises(TrainingOpError, match=r"state.safetensors.*SHA-256 differs from the manifest's"):
            load_state(session, export)
        with pytest.raises(TrainingOpError, match=r"state.safetensors.*SHA-256 differs from the header's"):
            read_state(path)
        path.write_bytes(original)
    _assert_unchanged(session, before)
    state, _ = read_state(export)
    flipped = bytearray(original)
    flipped[start] ^= 0x01
    path.write_bytes(bytes(flipped))
    damaged, _ = read_state(export, verify=False)
    assert any(not np.array_equal(damaged[k], state[k]) for k in state)


@pytest.mark.parametrize("kind", ["step", "step_packed"])
def test_a_flipped_byte_in_the_step_model_is_caught(tmp_path, kind):
    export_step(_model(), tmp_path, packed=True)
    name = {"step": "step.onnx", "step_packed": "step.packed.onnx"}[kind]
    path = tmp_path / name
    data = path.read_bytes()
    _flip(path, len(data) // 2)
    with pytest.raises(TrainingOpError, match=rf"{name}'.*SHA-256 differs from the manifest's .*files\['{kind}'\]"):
        session_from_export(tmp_path, packed=kind == "step_packed")
    path.write_bytes(data)
    session_from_export(tmp_path, packed=kind == "step_packed")


@pytest.mark.parametrize("metadata", ["[1, 2]", '"text"', '{"format": 5}', '{"a": {"b": "c"}}'])
def test_safetensors_metadata_must_be_an_object_of_strings(metadata):
    header = ('{"__metadata__":' + metadata + ',"w":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}').encode()
    data = len(header).to_bytes(8, "little") + header + b"\0\0\0\0"
    with pytest.raises(TrainingOpError, match=r"'__metadata__' must be an object of strings"):
        safetensors.decode(data, "'x.safetensors'")


def test_exported_step_checks_labels_against_the_class_count(tmp_path):
    manifest = export_step(_model(), tmp_path)
    assert (manifest["classes"], manifest["ignore_index"]) == (CLASSES, -100)
    session = session_from_export(tmp_path)
    rate = {"learning_rate": np.array(1e-2, np.float32)}
    before = {k: v.copy() for k, v in session.state_dict().items()}
    for bad in (-1, CLASSES, 99):
        batch = _batch()
        batch["labels"][2] = bad
        with pytest.raises(TrainingOpError, match=rf"feed 'labels' holds class {bad}, outside \[0, {CLASSES}\) "
                                                  r"and not ignore_index -100"):
            session.step({**batch, **rate})
    for name, value in session.state_dict().items():
        np.testing.assert_array_equal(value, before[name], err_msg=name)
    batch = _batch()
    batch["labels"][2] = -100  # the ignore_index: allowed
    reference = ot.TrainingSession(_model())
    assert session.step({**batch, **rate})["loss"] == reference.step(batch)["loss"]


def test_without_ignore_index_the_manifest_says_null(tmp_path):
    model = ot.build_training_model(make_mlp((8, 16, CLASSES)), ot.CrossEntropyLoss(ignore_index=None), ot.Adam())
    manifest = export_step(model, tmp_path)
    assert (manifest["classes"], manifest["ignore_index"]) == (CLASSES, None)
    session = session_from_export(tmp_path)
    batch = _batch()
    batch["labels"][0] = -100
    with pytest.raises(TrainingOpError, match=r"holds class -100, outside \[0, 4\)$"):
        session.step({**batch, "learning_rate": np.array(1e-2, np.float32)})


def test_an_old_manifest_without_the_new_fields_still_loads(export):
    """Exports written before sha256/classes/ignore_index: those checks are skipped."""
    def strip(m):
        for entry in m["files"].values():
            entry.pop("sha256")
        m.pop("classes"), m.pop("ignore_index")
    _edit(export, strip)
    session = session_from_export(export)
    batch = _batch()
    batch["labels"][0] = 99  # no class count to check against: onnxruntime's OneHot drops it
    session.step({**batch, "learning_rate": np.array(1e-2, np.float32)})
    load_state(ot.TrainingSession(_model()), export)


def test_a_nominal_checkpoint_is_refused_with_one_line(tmp_path, capsys):
    session = ot.TrainingSession(_model())
    session.save(tmp_path / "nominal.onnx", nominal=True)
    with pytest.raises(TrainingOpError, match=r"nominal checkpoint .*load the parameters"):
        export_step(tmp_path / "nominal.onnx", tmp_path / "out")
    assert not (tmp_path / "out" / "manifest.json").exists()
    assert main(["export-step", str(tmp_path / "nominal.onnx"), str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert "nominal checkpoint" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    opened = ot.TrainingSession(tmp_path / "nominal.onnx")
    with pytest.raises(TrainingOpError, match=r"nominal checkpoint .*load them"):
        export_step(opened, tmp_path / "out")
    opened.load_state_dict(session.state_dict())
    assert not opened.nominal  # filled: exports the filled values
    export_step(opened, tmp_path / "out")
    np.testing.assert_array_equal(read_state(tmp_path / "out")[0]["W0"], session.state_dict()["W0"])


def test_a_large_model_session_exports(tmp_path, monkeypatch):
    monkeypatch.setenv("ONNX_TRAINING_OPS_LARGE_MODEL_BYTES", str(2 * 1024))
    session = ot.TrainingSession(ot.build_training_model(make_mlp((8, 64, CLASSES)), "cross_entropy",
                                                         ot.Adam(lr=1e-2)))
    assert session._programs.large
    session.step(_batch(0))
    export_step(session, tmp_path / "out")
    session.save(tmp_path / "ck.onnx")
    export_step(str(tmp_path / "ck.onnx"), tmp_path / "out2")
    inference = session.export_inference_model()
    assert inference.model_proto.graph.output[0].name == "logits"
    exported = session_from_export(tmp_path / "out")
    again = session_from_export(tmp_path / "out2")
    rate = {"learning_rate": np.array(1e-2, np.float32)}
    for i in range(1, 3):
        expected = session.step(_batch(i))["loss"]
        assert exported.step({**_batch(i), **rate})["loss"] == expected
        assert again.step({**_batch(i), **rate})["loss"] == expected


def _paths(value, prefix=()):
    """Every field path of a manifest (dict keys and list indices, lists cut to 2 entries)."""
    yield prefix
    if isinstance(value, dict):
        for key, inner in value.items():
            yield from _paths(inner, (*prefix, key))
    elif isinstance(value, list):
        for i, inner in enumerate(value[:2]):
            yield from _paths(inner, (*prefix, i))


def test_any_field_of_any_type_is_an_error_or_a_valid_load(export):
    """Every field path replaced by values of each JSON type: a TrainingOpError or a load, never
    another exception, and the session unchanged on an error."""
    manifest = json.loads((export / "manifest.json").read_text())
    session = ot.TrainingSession(_model())
    before = _snapshot(session)
    replacements = [None, -1, 2.5, "x", [], {}, True]
    paths = [p for p in _paths(manifest) if p and p[0] not in ("format", "version")]
    crashes = []
    for k, path in enumerate(paths):
        value = replacements[k % len(replacements)]
        _edit(export, _set(list(path), value))
        for call in (lambda: load_state(session, export), lambda: session_from_export(export)):
            try:
                call()
            except TrainingOpError:
                pass
            except Exception as error:  # noqa: BLE001 - what this test looks for
                crashes.append(f"{path} = {value!r}: {error!r}")
        (export / "manifest.json").write_text(json.dumps(manifest))
        if crashes:
            break
        session.load_state_dict(before[0])
        session.set_lr_schedule(*before[1:])
    assert crashes == []
    assert len(paths) > 60


def test_device_trainer_reads_through_the_same_checks(export, tmp_path):
    """DeviceTrainer (CPU here): a flipped step.onnx byte and a bad schedule are the same
    one-line errors as for session_from_export; verify=False skips the digest."""
    from onnx_training_ops.export import DeviceTrainer

    DeviceTrainer(export)
    data = (export / "step.onnx").read_bytes()
    _flip(export / "step.onnx", len(data) // 2)
    with pytest.raises(TrainingOpError, match=r"step.onnx'.*SHA-256 differs from the manifest's"):
        DeviceTrainer(export)
    try:  # unchecked: the damaged bytes reach onnxruntime, which may load them or fail on its own terms
        DeviceTrainer(export, verify=False)
    except Exception as error:  # noqa: BLE001 - any error but ours
        assert "SHA-256" not in str(error)
    (export / "step.onnx").write_bytes(data)
    _edit(export, lambda m: m["schedule"].update(args={"bogus": 2}))
    with pytest.raises(TrainingOpError, match=r"field 'schedule.args' .* does not fit StepLR"):
        DeviceTrainer(export)


@pytest.mark.parametrize("packed", [False, True])
def test_swapped_feedback_entries_of_equal_shape_are_caught_by_the_step_models_record(tmp_path, packed):
    """W0 <-> W0.V have one shape and each output is computed from both inputs: neither shapes nor
    the data flow tell the swap; the feedback map the step model records does."""
    from onnx_training_ops.export import DeviceTrainer, export_step, session_from_export

    model = ot.build_training_model(make_mlp((8, 16, 4)), "cross_entropy", ot.Adam())
    export_step(model, tmp_path, packed=packed)
    path = tmp_path / "manifest.json"
    manifest = json.loads(path.read_text())
    feedback = manifest["feedback"]
    feedback["W0"], feedback["W0.V"] = feedback["W0.V"], feedback["W0"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(TrainingOpError, match=r"field 'feedback' feeds 'W0' from 'W0.V.new', but the step model"):
        session_from_export(tmp_path)
    if packed:  # the packed step feeds back whole packs: the swap does not reach it
        session_from_export(tmp_path, packed=True)
    with pytest.raises(TrainingOpError, match="field 'feedback' feeds"):
        DeviceTrainer(tmp_path)
