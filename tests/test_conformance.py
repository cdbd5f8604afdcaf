"""The domain's ONNX conformance cases, through onnx.backend.test.BackendTest and our backend."""

import onnx_training_ops.backend as backend
from onnx_training_ops.conformance import NODE_CASES, backend_test_cases, run_conformance

globals().update(backend_test_cases(__name__))


def test_backend_api_surface():
    assert backend.supports_device("CPU")
    assert not backend.supports_device("CUDA")
    for name in ("prepare", "run_model", "run_node", "supports_device"):
        assert callable(getattr(backend, name))


def test_every_node_case_is_collected():
    names = {
        test
        for case in backend_test_cases(__name__).values()
        for test in dir(case)
        if test.startswith("test_")
    }
    for case in NODE_CASES:
        assert f"{case}_cpu" in names


def test_run_conformance_reports_every_case():
    results = {r.name: r for r in run_conformance()}
    failed = {name: r.detail for name, r in results.items() if not r.passed}
    assert not failed


def test_run_node_runs_one_optimizer_node():
    import numpy as np
    from onnx import helper

    import onnx_training_ops as ot

    node = helper.make_node(
        "Adagrad", ["R", "T", "X", "G", "H"], ["X_new", "H_new"], domain="ai.onnx.preview.training", decay_factor=0.1
    )
    inputs = [np.array(0.1, np.float32), np.array(2, np.int64)] + [np.full(3, v, np.float32) for v in (1.0, 0.5, 2.0)]
    got = backend.run_node(node, inputs)
    want = ot.kernels.adagrad(*inputs, decay_factor=float(np.float32(0.1)))
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
