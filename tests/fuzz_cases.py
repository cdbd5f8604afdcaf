"""Seeded fuzz cases, run in a subprocess by tests/test_fuzz.py (a crash or hang there is a
failure of its own): ``python tests/fuzz_cases.py CATEGORY SEED N`` prints one JSON line of
outcome counts. An outcome is ``ran`` (a result equal to the reference), ``clean`` (our
error: TrainingOpError, ValueError or TypeError with a message) or ``wrong`` (anything else:
a raw exception, a result off the reference, a state changed by a failed step, a damaged
checkpoint that loaded different values); ``examples`` lists the first wrong ones."""

from __future__ import annotations

import json
import os
import sys
import tempfile

import numpy as np
import onnx
from onnx import TensorProto

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import onnx_training_ops as ot  # noqa: E402
from model_factory import optimizer_model  # noqa: E402
from onnx_training_ops import kernels  # noqa: E402
from onnx_training_ops.demo import make_mlp  # noqa: E402

CLEAN = (ot.TrainingOpError, ValueError, TypeError)
# InferenceSession is a drop-in onnxruntime.InferenceSession: feeds that contradict the
# model's declared inputs get onnxruntime's own exceptions (with its clear message), as
# they would without this package
try:
    from onnxruntime.capi.onnxruntime_pybind11_state import Fail, InvalidArgument
    ORT_INPUT_ERRORS = (InvalidArgument, Fail)
except ImportError:  # pragma: no cover
    ORT_INPUT_ERRORS = ()
OPS = ("Adam", "Momentum", "Adagrad")


class Tally:
    def __init__(self):
        self.counts = {"ran": 0, "clean": 0, "wrong": 0}
        self.examples: list[str] = []

    def wrong(self, what: str) -> None:
        self.counts["wrong"] += 1
        if len(self.examples) < 5:
            self.examples.append(what[:300])


# ------------------------------------------------------------------ graphs
def _mutate_graph(model: onnx.ModelProto, rng: np.random.Generator) -> str:
    node = model.graph.node[0]
    kind = rng.choice(["attr_value", "attr_type", "drop_input", "extra_input", "dtype", "shape",
                       "op_type", "duplicate_output", "unknown_attr", "empty_input"])
    if kind == "attr_value" and node.attribute:
        a = node.attribute[rng.integers(len(node.attribute))]
        if a.type == onnx.AttributeProto.FLOAT:
            a.f = float(rng.choice([np.nan, np.inf, -1.0, 0.0, 1.0, 2.5, 1e30]))
        else:
            a.s = b"bogus"
    elif kind == "attr_type" and node.attribute:
        a = node.attribute[rng.integers(len(node.attribute))]
        name = a.name
        node.attribute.remove(a)
        node.attribute.append(onnx.helper.make_attribute(name, [1, 2]))
    elif kind == "drop_input":
        del node.input[int(rng.integers(len(node.input)))]
    elif kind == "extra_input":
        node.input.append(node.input[-1])
    elif kind == "dtype":
        vi = model.graph.input[int(rng.integers(len(model.graph.input)))]
        vi.type.tensor_type.elem_type = int(rng.choice([TensorProto.INT32, TensorProto.DOUBLE,
                                                        TensorProto.FLOAT16, TensorProto.BOOL]))
    elif kind == "shape":
        vi = model.graph.input[int(rng.integers(len(model.graph.input)))]
        dims = vi.type.tensor_type.shape.dim
        dims.add().dim_value = int(rng.integers(1, 4))
    elif kind == "op_type":
        node.op_type = str(rng.choice(["Adam", "Momentum", "Adagrad", "Gradient", "Nope"]))
    elif kind == "duplicate_output" and len(node.output) > 1:
        node.output[1] = node.output[0]
    elif kind == "unknown_attr":
        node.attribute.append(onnx.helper.make_attribute("surprise", 1.0))
    elif kind == "empty_input":
        node.input[int(rng.integers(len(node.input)))] = ""
    return kind


def _feeds_for(model: onnx.ModelProto, rng: np.random.Generator) -> dict:
    feeds = {}
    for vi in model.graph.input:
        tt = vi.type.tensor_type
        dtype = onnx.helper.tensor_dtype_to_np_dtype(tt.elem_type) if tt.elem_type else np.float32
        shape = [d.dim_value if d.dim_value else 3 for d in tt.shape.dim]
        if vi.name == "T":
            feeds[vi.name] = np.array(int(rng.integers(0, 5)), dtype)
        elif vi.name == "R":
            feeds[vi.name] = np.array(0.1, dtype)
        else:
            feeds[vi.name] = rng.uniform(0.1, 1.0, shape).astype(dtype)
    return feeds


def _reference(op: str, node: onnx.NodeProto, feeds: dict) -> list:
    attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
    attrs = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in attrs.items()}
    tensors = [feeds[name] for name in node.input[2:]]
    return kernels.__dict__[op.lower()](feeds[node.input[0]], feeds[node.input[1]], *tensors, **attrs)


def graphs(seed: int, n: int, tally: Tally) -> None:
    rng = np.random.default_rng(seed)
    for i in range(n):
        op = OPS[i % 3]
        model = optimizer_model(op, n=int(rng.integers(1, 3)), shapes=[[3], [2, 2]])
        kind = _mutate_graph(model, rng) if i % 4 else "none"
        node = onnx.NodeProto()
        node.CopyFrom(model.graph.node[0])
        feeds = _feeds_for(model, rng)
        try:
            session = ot.InferenceSession(model)
            got = session.run(None, feeds)
        except CLEAN + ORT_INPUT_ERRORS as error:
            # onnxruntime's input errors only from run(): loading is ours to check
            if not str(error) or ("session" not in locals() and isinstance(error, ORT_INPUT_ERRORS)):
                tally.wrong(f"graph {kind}: {type(error).__name__}: {error}")
            else:
                tally.counts["clean"] += 1
            continue
        except Exception as error:  # noqa: BLE001
            tally.wrong(f"graph {kind}: raw {type(error).__name__}: {error}")
            continue
        try:
            want = _reference(node.op_type, node, feeds)
        except CLEAN:
            tally.wrong(f"graph {kind}: ran although the reference refuses it")
            continue
        if all(np.allclose(a, b, rtol=1e-5, atol=1e-7, equal_nan=True) for a, b in zip(got, want)):
            tally.counts["ran"] += 1
        else:
            tally.wrong(f"graph {kind}: result differs from the reference kernel")


# ------------------------------------------------------------------ feeds
def _bad_feed(batch: dict, rng: np.random.Generator) -> tuple[str, object]:
    kind = str(rng.choice(["dtype", "shape", "nan", "big_endian", "missing", "extra", "list",
                           "empty", "labels_float", "scalar"]))
    x, y = batch["input"], batch["labels"]
    if kind == "dtype":
        return kind, dict(batch, input=x.astype(np.float64))
    if kind == "shape":
        return kind, dict(batch, input=x[:, :5])
    if kind == "nan":
        bad = x.copy()
        bad[0, 0] = np.nan
        return kind, dict(batch, input=bad)
    if kind == "big_endian":
        return kind, dict(batch, input=x.astype(">f4"))
    if kind == "missing":
        return kind, {"input": x}
    if kind == "extra":
        return kind, dict(batch, surprise=x)
    if kind == "list":
        return kind, [x, y]
    if kind == "empty":
        return kind, dict(batch, input=x[:0], labels=y[:0])
    if kind == "labels_float":
        return kind, dict(batch, labels=y.astype(np.float32))
    return kind, dict(batch, input=np.float32(1.0))


def feeds(seed: int, n: int, tally: Tally) -> None:
    rng = np.random.default_rng(seed)
    session = ot.TrainingSession(ot.build_training_model(make_mlp((16, 8, 4), seed=1),
                                                         "cross_entropy", ot.Adam()))
    good = {"input": rng.standard_normal((6, 16)).astype(np.float32),
            "labels": rng.integers(0, 4, 6).astype(np.int64)}
    for _ in range(n):
        kind, bad = _bad_feed(good, rng)
        before = session.state_dict()
        try:
            session.step(bad)
        except CLEAN as error:
            changed = [k for k, v in session.state_dict().items()
                       if not np.array_equal(v, before[k], equal_nan=True)]
            if changed or not str(error):
                tally.wrong(f"feed {kind}: failed step changed {changed[:3]}")
            else:
                tally.counts["clean"] += 1
            continue
        except Exception as error:  # noqa: BLE001
            tally.wrong(f"feed {kind}: raw {type(error).__name__}: {error}")
            continue
        if kind in ("big_endian", "empty"):  # valid: big-endian is converted, an empty batch...
            tally.counts["ran"] += 1
        else:
            tally.wrong(f"feed {kind}: accepted")


# ------------------------------------------------------------------ checkpoint bytes
def checkpoints(seed: int, n: int, tally: Tally) -> None:
    rng = np.random.default_rng(seed)
    session = ot.TrainingSession(ot.build_training_model(make_mlp((16, 8, 4), seed=1),
                                                         "cross_entropy", ot.Adam()))
    directory = tempfile.mkdtemp()
    path = os.path.join(directory, "ckpt.onnx")
    session.save(path)
    data = open(path, "rb").read()
    want = session.state_dict()
    for i in range(n):
        kind = ("truncate", "flip", "garbage", "zero", "splice")[i % 5]
        damaged = bytearray(data)
        if kind == "truncate":
            damaged = damaged[:int(rng.integers(0, len(data)))]
        elif kind == "flip":
            for _ in range(int(rng.integers(1, 4))):
                damaged[int(rng.integers(len(data)))] ^= 1 << int(rng.integers(8))
        elif kind == "garbage":
            damaged = bytearray(rng.integers(0, 256, int(rng.integers(1, 4096)), dtype=np.uint8))
        elif kind == "zero":
            start = int(rng.integers(len(data)))
            damaged[start:start + 64] = bytes(min(64, len(data) - start))
        else:
            start = int(rng.integers(len(data) // 2))
            damaged = damaged[:start] + damaged[start + 16:]
        target = os.path.join(directory, f"bad{i}.onnx")
        with open(target, "wb") as f:
            f.write(bytes(damaged))
        try:
            loaded = ot.TrainingSession(target).state_dict()
        except CLEAN as error:
            tally.counts["clean" if str(error) else "wrong"] += 1
            continue
        except Exception as error:  # noqa: BLE001
            tally.wrong(f"checkpoint {kind}: raw {type(error).__name__}: {error}")
            continue
        if set(loaded) == set(want) and all(np.array_equal(loaded[k], want[k]) for k in want):
            tally.counts["ran"] += 1  # the damage hit nothing that matters (same values)
        else:
            tally.wrong(f"checkpoint {kind}: loaded with different values")


if __name__ == "__main__":
    category, seed, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    tally = Tally()
    {"graphs": graphs, "feeds": feeds, "checkpoints": checkpoints}[category](seed, n, tally)
    print(json.dumps({"category": category, **tally.counts, "examples": tally.examples}))
