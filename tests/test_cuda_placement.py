"""Every node of the step graphs a CUDA device session runs has a CUDA kernel at its types, checked
on the CPU against onnxruntime's own kernel table (``runtime/kernel_table.py``, from its
``docs/OperatorKernels.md``).

A node without one runs on the CPU with Memcpy nodes around it, every step, and onnxruntime
refuses CUDA graphs for the whole step; nothing fails, the step is just slow. Before (issue 39
item 4, seen on an H200): the causal-LM label shift was an int64 ``Pad`` (the CUDA Pad has no
int64 kernel), in every GPT-2 and Llama step. The graphs checked are those of
``TrainingSession(device=..., input_shapes=...)`` (:func:`device_step_graphs`) for GPT-2, BERT,
a ResNet and the LoRA Llama of ``bench/lora.py``, at tiny sizes, in fp32 and 16-bit; and no
Concat of the flat optimizer takes more than 32 pieces (onnxruntime's CUDA Concat uploads a host
table per run past that, issue 39 item 6)."""

from __future__ import annotations

import dataclasses
import io
import warnings

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper

import onnx_training_ops as ot
from onnx_training_ops.runtime.kernel_table import CUDA, INLINED, cpu_nodes, host_tables, kernel_for, table
from onnx_training_ops.training.engine.device_graphs import device_step_graphs

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")


def _specs():
    from benchmarks import lora, zoo

    return {
        "gpt2": zoo.spec("gpt2", layers=2, vocab=128, hidden=32, heads=2, batch=2, seq=8),
        "bert": zoo.spec("bert", layers=2, vocab=128, hidden=32, heads=2, batch=2, seq=8),
        "resnet": zoo.spec("resnet18", image=16, batch=2, sizes=(8, 16), depths=(1, 1)),
        "lora-llama": dataclasses.replace(
            lora.SPEC, name="lora-tiny", layers=2, hidden=32, heads=4, vocab=128, batch=2, seq=8,
            extra={**lora.SPEC.extra, "intermediate_size": 64, "num_key_value_heads": 2}),
    }


@pytest.fixture(scope="module")
def zoo_cache(tmp_path_factory, request):
    path = tmp_path_factory.mktemp("zoo")
    patch = pytest.MonkeyPatch()
    patch.setenv("ONNX_TRAINING_OPS_ZOO", str(path))
    request.addfinalizer(patch.undo)
    return path


CASES = [("gpt2", "fp32"), ("gpt2", "bf16"), ("gpt2", "fp16"), ("bert", "fp32"), ("bert", "bf16"),
         ("resnet", "fp32"), ("resnet", "fp16"), ("lora-llama", "fp32"), ("lora-llama", "bf16")]


@pytest.mark.parametrize("name,precision", CASES, ids=[f"{n}-{p}" for n, p in CASES])
def test_every_node_of_the_static_step_has_a_cuda_kernel(name, precision, zoo_cache):
    if name == "lora-llama":
        pytest.importorskip("peft")
    from benchmarks import lora, zoo
    from benchmarks.gpu import _training_model

    spec = _specs()[name]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the exporter's merged initializers, restored
        training = _training_model(spec, precision)
    batch = (lora.batches(spec, 1) if spec.family == "llama" else zoo.batches(spec, 1))[0]
    [step] = device_step_graphs(training, {k: list(v.shape) for k, v in batch.items()})
    graph = step.model_proto
    assert not cpu_nodes(graph), "\n".join(map(str, cpu_nodes(graph)))
    assert not {"Shape", "Size"} & {n.op_type for n in graph.graph.node}  # no shape arithmetic left to run
    assert not host_tables(graph, above=32)  # the flat optimizer's Concats take at most 32 pieces


def test_the_check_names_what_the_cuda_ep_runs_on_the_cpu():
    """The int64 Pad of the old label shift, bfloat16 nodes without a bf16 CUDA kernel, a bool
    Where, a custom op; CastLike (inlined by onnxruntime into a Cast) and Constant are fine."""
    def vi(name, t, shape):
        return helper.make_tensor_value_info(name, t, shape)

    nodes = [
        helper.make_node("Pad", ["ids", "pads", "fill"], ["padded"], name="shift"),
        helper.make_node("Cast", ["x"], ["xb"], to=TensorProto.BFLOAT16),
        helper.make_node("ReduceMean", ["xb"], ["mean"], name="mean16", keepdims=0),
        helper.make_node("Where", ["mask", "mask", "mask"], ["chosen"], name="pick"),
        helper.make_node("CastLike", ["x", "ids"], ["like"]),
        helper.make_node("Custom", ["x"], ["custom"], name="mine", domain="my.domain"),
        helper.make_node("Constant", [], ["c"], value=onnx.numpy_helper.from_array(np.ones(2, np.float32))),
    ]
    graph = helper.make_graph(
        nodes, "g", [vi("ids", TensorProto.INT64, [2, 3]), vi("x", TensorProto.FLOAT, [2, 3]),
                     vi("mask", TensorProto.BOOL, [2, 3])],
        [vi(n, TensorProto.UNDEFINED, None) for n in ("padded", "mean", "chosen", "like", "custom", "c")],
        [onnx.numpy_helper.from_array(np.array([0, 0, 0, 1], np.int64), "pads"),
         onnx.numpy_helper.from_array(np.array(-100, np.int64), "fill")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("my.domain", 1)])
    found = {p.node or p.op_type: p.reason for p in cpu_nodes(model)}
    assert found == {
        "shift": f"no {CUDA} kernel for Pad with data of type int64 (T takes bool, double, float, float16)",
        "mean16": f"no {CUDA} kernel for ReduceMean with data of type bfloat16 (T takes double, float, float16, "
                  "int32)",
        "pick": f"no {CUDA} kernel for Where with X of type bool (T takes bfloat16, double, float, float16, int32, "
                "int64, uint8)",
        "mine": f"domain 'my.domain': no {CUDA} kernel known",
    }


def test_the_table_reads_as_onnxruntime_documents_it():
    """Spot checks against docs/OperatorKernels.md, and every op of the table an op onnx knows
    (or one of onnxruntime's own in the default domain)."""
    assert TensorProto.INT64 not in kernel_for("Pad", 13).types["T"]
    assert TensorProto.BFLOAT16 in kernel_for("MatMul", 13).types["T"]
    assert TensorProto.BFLOAT16 not in kernel_for("MatMul", 9).types["T"]
    assert TensorProto.BFLOAT16 in kernel_for("Conv", 22).types["T"]
    assert TensorProto.BFLOAT16 not in kernel_for("Conv", 11).types["T"]
    assert kernel_for("Mean", 13) is None and kernel_for("Gemm", 6) is None
    assert kernel_for("Identity", 16).types["V"] is None  # sequences too: not looked into
    onnx_ops = {s.name for s in onnx.defs.get_all_schemas_with_history()}
    ours = {"SimplifiedLayerNormalization"}  # onnxruntime's own op in the default domain
    assert set(table()) - onnx_ops <= ours, set(table()) - onnx_ops


@pytest.mark.parametrize("op", sorted(INLINED))
def test_onnxruntime_inlines_the_function_ops_the_check_reads_through(op, tmp_path):
    """An ONNX function op with no CPU kernel either is inlined by onnxruntime: its body's op
    is what gets placed (the check reads CastLike as the Cast it becomes)."""
    graph = helper.make_graph([helper.make_node(op, ["x", "y"], ["z"])], "g",
                              [helper.make_tensor_value_info("x", TensorProto.FLOAT, [2]),
                               helper.make_tensor_value_info("y", TensorProto.DOUBLE, [2])],
                              [helper.make_tensor_value_info("z", TensorProto.DOUBLE, [2])])
    options = ort.SessionOptions()
    options.graph_optimization_level = ort.GraphOptimizationLevel.ORT_DISABLE_ALL
    options.optimized_model_filepath = str(tmp_path / "inlined.onnx")
    ort.InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)], ir_version=9)
                         .SerializeToString(), options, providers=["CPUExecutionProvider"])
    assert [n.op_type for n in onnx.load(options.optimized_model_filepath).graph.node] == [INLINED[op]]


def test_flat_optimizer_applies_to_a_torchscript_gpt2_with_dynamic_axes(tmp_path):
    """Issue 39 item 9: export_step(flat_optimizer=True) of a 4-layer GPT-2 (TorchScript, dynamic
    axes, the causal-LM loss, AdamW) wrote one update chain per parameter: shape inference does
    not know some gradients' shapes, and the pass gave up on the whole node without a word."""
    import transformers

    from onnx_training_ops.export import DeviceTrainer, export_step

    config = transformers.GPT2Config(vocab_size=64, n_embd=16, n_layer=4, n_head=2, n_positions=16, resid_pdrop=0,
                                     embd_pdrop=0, attn_pdrop=0, use_cache=False, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    gpt2 = transformers.GPT2LMHeadModel(config).eval()
    with torch.no_grad():
        for p in gpt2.parameters():
            p.add_(torch.randn_like(p) * 0.02)

    class Logits(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.gpt2 = gpt2

        def forward(self, input_ids, attention_mask):
            return self.gpt2(input_ids=input_ids, attention_mask=attention_mask).logits

    ids = torch.randint(0, 64, (2, 8))
    f = io.BytesIO()
    axes = {"input_ids": {0: "batch", 1: "seq"}, "attention_mask": {0: "batch", 1: "seq"},
            "logits": {0: "batch", 1: "seq"}}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        torch.onnx.export(Logits(), (ids, torch.ones_like(ids)), f, dynamo=False, opset_version=17,
                          input_names=["input_ids", "attention_mask"], output_names=["logits"], dynamic_axes=axes)
        training = ot.build_training_model(onnx.load_from_string(f.getvalue()),
                                           ot.CrossEntropyLoss(class_axis=-1, shift_labels=True),
                                           ot.AdamW(lr=1e-3), labels="labels")
    export_step(training, tmp_path / "default")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing left per tensor
        export_step(training, tmp_path / "flat", flat_optimizer=True)
    flat = onnx.load(tmp_path / "flat" / "step.onnx").graph.node
    default = onnx.load(tmp_path / "default" / "step.onnx").graph.node
    sqrt = [sum(n.op_type == "Sqrt" for n in g) for g in (flat, default)]
    # per tensor: 52 parameters' chains and one bias correction; flat: 2 groups, each with its own
    assert sqrt == [2 * 2, 52 + 1], sqrt
    assert max(len(n.input) for n in flat if n.op_type == "Concat") <= 32
    a, b = DeviceTrainer(tmp_path / "default"), DeviceTrainer(tmp_path / "flat")
    rng = np.random.default_rng(0)
    for _ in range(2):
        x = rng.integers(0, 64, (2, 8))
        batch = {"input_ids": x, "attention_mask": np.ones_like(x), "labels": x}
        assert a.step(batch)["loss"] == b.step(batch)["loss"]
