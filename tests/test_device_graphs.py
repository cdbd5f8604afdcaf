"""The step graphs of a device session, built once: ``device_step_graphs`` (what the kernel-table
test checks, ``tests/test_cuda_placement.py``) is the engine's own building, so it returns exactly
the graph ``TrainingSession(model, device=..., input_shapes=...)`` hands onnxruntime (the
provider's pass pipeline, the guard and its capture gate, frozen tensors as inputs); and a session
built for CUDA names, at open, the nodes that CUDA kernels do not cover (onnxruntime would run
them on the CPU with Memcpy nodes around them, and refuse CUDA graphs). All on the CPU: a session
on ``device="cpu"`` built for the CUDA provider runs the GPU's very graphs here."""

from __future__ import annotations

import dataclasses
import warnings

import numpy as np
import pytest
from onnx import TensorProto, helper, numpy_helper
from test_device_session import _conv_model, _frozen_model

import onnx_training_ops as ot
from onnx_training_ops.runtime.kernel_table import CUDA
from onnx_training_ops.training.engine import graph as graph_module
from onnx_training_ops.training.engine.config import checked_config
from onnx_training_ops.training.engine.device_graphs import device_step_graphs, device_step_plans
from onnx_training_ops.training.engine.graph import APPLY

CPU = "CPUExecutionProvider"


def built_for(provider, model, input_shapes=None, **kwargs):
    """``TrainingSession(model, device="cpu", input_shapes=...)`` whose graphs are built for ``provider``."""
    config = checked_config([CPU], None, "raise", None, None, None, "cpu", 0, input_shapes, None)
    return ot.TrainingSession._opened(model, dataclasses.replace(config, graphs_for=provider, **kwargs))


def opened_graphs(monkeypatch, provider, model, input_shapes):
    """The session and the models its programs handed onnxruntime, in order."""
    seen = []
    real = graph_module.InferenceSession

    def recording(model, sess_options, providers):
        seen.append(model.model_proto.SerializeToString())
        return real(model, sess_options=sess_options, providers=providers)

    monkeypatch.setattr(graph_module, "InferenceSession", recording)
    return built_for(provider, model, input_shapes), seen


CASES = {"frozen": (_frozen_model, {"x": [5, 16], "target": [5, 4]}),
         "conv": (_conv_model, {"x": [6, 3, 8, 8], "labels": [6]})}


@pytest.mark.parametrize("provider", [CUDA, CPU], ids=["cuda", "cpu"])
@pytest.mark.parametrize("case", sorted(CASES))
def test_device_step_graphs_are_the_graphs_the_engine_opens(case, provider, monkeypatch):
    make, shapes = CASES[case]
    model = make()
    session, seen = opened_graphs(monkeypatch, provider, model, shapes)
    [step] = device_step_graphs(model, shapes, provider=provider)
    assert seen[0] == step.model_proto.SerializeToString()  # the step program: the first one opened
    graph = step.model_proto.graph
    inputs = {vi.name for vi in graph.input}
    ops = [n.op_type for n in graph.node]
    if case == "frozen":
        assert APPLY in inputs  # static, in place: the capture's warm-up gate
        assert "W0" in inputs and "W0" not in {t.name for t in graph.initializer}  # frozen: an input
    else:  # Conv gradients as cuDNN's Conv/ConvTranspose only for CUDA
        assert ("ConvTranspose" in ops) == (provider == CUDA)
    # the graphs run the same step here
    rng = np.random.default_rng(0)
    feeds = {name: (rng.integers(0, 5, dims) if name == "labels" else rng.standard_normal(dims).astype(np.float32))
             for name, dims in shapes.items()}
    reference = ot.TrainingSession(model, device="cpu", input_shapes=shapes)
    np.testing.assert_allclose(session.step(feeds)["loss"], reference.step(feeds)["loss"], rtol=1e-5)


def test_the_old_copy_of_the_building_missed_what_the_engine_runs():
    """What device_step_graphs missed before it was the engine's building: the GPU's passes (the
    Conv gradients were im2col Gemms in the checked graph, ConvTranspose in the run one), the
    capture gate, and frozen tensors as inputs."""
    [plan] = device_step_plans(_conv_model(), {"x": [6, 3, 8, 8], "labels": [6]})
    assert plan.provider == CUDA and not plan.off_device
    assert "ConvTranspose" in [n.op_type for n in plan.model.model_proto.graph.node]
    [plan] = device_step_plans(_frozen_model(), {"x": [5, 16], "target": [5, 4]})
    assert plan.gated and plan.graph_capture and "W0" in plan.constants


def _model_with_an_int64_pad():
    """y = x W + float(Pad(k)): the int64 Pad (as the old causal-LM label shift) has no CUDA kernel."""
    rng = np.random.default_rng(0)
    nodes = [helper.make_node("Pad", ["k", "pads", "fill"], ["kp"], name="shift"),
             helper.make_node("Cast", ["kp"], ["kf"], to=TensorProto.FLOAT),
             helper.make_node("MatMul", ["x", "W"], ["h"]), helper.make_node("Add", ["h", "kf"], ["y"])]
    graph = helper.make_graph(
        nodes, "pad", [helper.make_tensor_value_info("x", TensorProto.FLOAT, [4, 3]),
                       helper.make_tensor_value_info("k", TensorProto.INT64, [4, 1])],
        [helper.make_tensor_value_info("y", TensorProto.FLOAT, [4, 2])],
        [numpy_helper.from_array(rng.standard_normal((3, 2)).astype(np.float32), "W"),
         numpy_helper.from_array(np.array([0, 1, 0, 0], np.int64), "pads"),
         numpy_helper.from_array(np.array(7, np.int64), "fill")])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])
    model.ir_version = 8
    return ot.build_training_model(model, "mse", ot.Adam(lr=0.1))


def test_a_session_built_for_cuda_names_the_nodes_cuda_kernels_do_not_cover():
    model = _model_with_an_int64_pad()
    shapes = {"x": [4, 3], "k": [4, 1], "target": [4, 2]}
    with pytest.warns(UserWarning) as caught:
        session = built_for(CUDA, model, shapes)
    texts = [str(w.message) for w in caught if "kernel" in str(w.message)]
    assert len(texts) == 1, texts  # one warning for the step
    assert "1 node(s) have no CUDAExecutionProvider kernel at their types" in texts[0]
    assert "Pad 'shift': no CUDAExecutionProvider kernel for Pad with data of type int64" in texts[0]
    assert "refuses CUDA graphs" in texts[0]
    [step] = session._programs.steps
    assert [p.node for p in step.off_device] == ["shift"]
    assert not session.cuda_graph
    assert "no CUDA graph (1 node(s) without a CUDAExecutionProvider kernel run on the CPU)" in repr(session)
    feeds = {"x": np.ones((4, 3), np.float32), "k": np.arange(4).reshape(4, 1), "target": np.zeros((4, 2), np.float32)}
    assert np.isfinite(session.step(feeds)["loss"])  # the CPU runs it all the same
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        ot.TrainingSession(model, device="cpu", input_shapes=shapes)  # built for the CPU: nothing to say


def test_a_node_without_a_cuda_kernel_plans_no_cuda_graph_unless_forced(monkeypatch):
    """onnxruntime refuses CUDA graphs once a node sits on the CPU: with the default
    cuda_graph=None no capture is tried (each try opens the whole session once more); with
    cuda_graph=True it is, and its refusal is the error, the kernel table's finding in it."""
    monkeypatch.setattr(graph_module, "captures", lambda device: True)
    model = _model_with_an_int64_pad()
    shapes = {"x": [4, 3], "k": [4, 1], "target": [4, 2]}
    [plan] = device_step_plans(model, shapes)
    assert not plan.graph_capture and "Memcpy" in plan.not_captured and "Pad 'shift'" in plan.not_captured
    [forced] = device_step_plans(model, shapes, cuda_graph=True)
    assert forced.graph_capture

    real = graph_module.InferenceSession

    def refusing(model, sess_options, providers):
        if any(isinstance(p, tuple) and p[1].get("enable_cuda_graph") for p in providers):
            raise RuntimeError("This session cannot use the CUDA Graph feature as requested by the user as the "
                               "model has control flow nodes or nodes assigned to other EPs (emulated)")
        return real(model, sess_options=sess_options, providers=providers)

    monkeypatch.setattr(graph_module, "InferenceSession", refusing)
    monkeypatch.setattr(graph_module, "with_graph_capture",
                        lambda providers: [(p, {"enable_cuda_graph": "1"}) for p in providers])
    with pytest.warns(UserWarning, match="Pad 'shift'"), \
            pytest.raises(ot.TrainingOpError, match="cuda_graph=True but this step cannot be captured: onnxruntime "
                          "refused CUDA graphs.*1 node.*Pad 'shift'"):
        built_for(CUDA, model, shapes, cuda_graph=True)


def test_the_kernel_table_reads_contrib_ops_at_their_types():
    """com.microsoft ops (onnxruntime-genai's graphs) are checked at their types from
    onnxruntime's own schemas: float32 GroupQueryAttention has no CUDA kernel (float16/bfloat16
    only), float32 MatMulNBits, GatherBlockQuantized and SkipSimplifiedLayerNormalization do; the
    types flow through contrib ops onnx's shape inference does not know."""
    from onnx_training_ops.runtime.kernel_table import cpu_nodes

    ms = "com.microsoft"
    vi = helper.make_tensor_value_info
    nodes = [
        helper.make_node("GatherBlockQuantized", ["table", "ids", "table_scales"], ["emb"], domain=ms,
                         name="embed", block_size=32, quantize_axis=1, bits=4),
        helper.make_node("SkipSimplifiedLayerNormalization", ["emb", "emb", "gamma"], ["h"], domain=ms, name="norm"),
        helper.make_node("MatMulNBits", ["h", "w", "w_scales"], ["qkv"], domain=ms, name="qkv", K=32, N=96, bits=4,
                         block_size=32),
        helper.make_node("GroupQueryAttention", ["qkv", "", "", "", "", "seqlens", "total"], ["att"], domain=ms,
                         name="attention", num_heads=2, kv_num_heads=1),
        helper.make_node("Cast", ["att"], ["att16"], to=TensorProto.FLOAT16),
        helper.make_node("GroupQueryAttention", ["qkv16", "", "", "", "", "seqlens", "total"], ["att_half"],
                         domain=ms, name="attention16", num_heads=2, kv_num_heads=1),
    ]
    inits = [numpy_helper.from_array(np.zeros((64, 16), np.uint8), "table"),
             numpy_helper.from_array(np.ones((64, 1), np.float32), "table_scales"),
             numpy_helper.from_array(np.ones(32, np.float32), "gamma"),
             numpy_helper.from_array(np.zeros((96, 1, 16), np.uint8), "w"),
             numpy_helper.from_array(np.ones((96, 1), np.float32), "w_scales"),
             numpy_helper.from_array(np.array([3, 3], np.int32), "seqlens"),
             numpy_helper.from_array(np.array(4, np.int32), "total")]
    inputs = [vi("ids", TensorProto.INT64, [2, 4]), vi("qkv16", TensorProto.FLOAT16, [2, 4, 96])]
    outputs = [vi("att_half", TensorProto.FLOAT16, None), vi("att16", TensorProto.FLOAT16, None)]
    graph = helper.make_graph(nodes, "g", inputs, outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)])
    found = {p.node: p.reason for p in cpu_nodes(model)}
    assert found == {"attention": f"no {CUDA} kernel for GroupQueryAttention with query of type float (T takes "
                                  "bfloat16, float16)"}, found
    model.graph.node.append(helper.make_node("Unknown", ["att"], ["u"], domain=ms, name="unknown"))
    assert cpu_nodes(model)[-1].reason == f"no {CUDA} kernel for Unknown at opset 1"


def test_the_flat_optimizers_groups_write_in_place_after_every_read(monkeypatch):
    """The flat optimizer updates at most 32 tensors per chain (issue 39 item 6): a chain of the
    last layers needs only their gradients, so onnxruntime may write them before the backward of
    the first layers reads them, and the step fell back to two sets: no fixed addresses, no CUDA
    graph (GPT-2's 148 tensors, every LoRA model past 32 adapter matrices). The guard's condition
    now waits for those reads (passes/order_writes.py): in place, captured, the same training."""
    from onnx_training_ops.demo import make_mlp

    # 20 layers: two chains of 20 tensors, the second from W10 on (its read for layer 9's gradient feeds the first)
    model = ot.build_training_model(make_mlp((8,) + (12,) * 19 + (4,)), "cross_entropy", ot.AdamW(lr=1e-2))
    shapes = {"input": [6, 8], "labels": [6]}
    [plan] = device_step_plans(model, shapes)
    assert plan.in_place and plan.graph_capture, plan.not_fixed
    barrier = [n for n in plan.model.model_proto.graph.node if "order_writes" in n.output[0]]
    assert 0 < len(barrier) <= 6 * 2  # a read of a value per chain at most
    with monkeypatch.context() as patch:
        patch.setattr(graph_module, "writes_after_reads", lambda *args: [])
        [before] = device_step_plans(model, shapes)
        assert not before.in_place and not before.graph_capture  # what the flat step was
    device = ot.TrainingSession(model, device="cpu", input_shapes=shapes)
    host = ot.TrainingSession(model)
    rng = np.random.default_rng(0)
    for _ in range(3):
        batch = {"input": rng.standard_normal((6, 8)).astype(np.float32), "labels": rng.integers(0, 4, 6)}
        np.testing.assert_allclose(device.step(batch)["loss"], host.step(batch)["loss"], rtol=1e-6)
    want = host.state_dict()
    for name, value in device.state_dict().items():
        np.testing.assert_allclose(value, want[name], rtol=1e-5, atol=1e-7, err_msg=name)
