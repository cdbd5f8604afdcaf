"""The contenders: ``factory(op, n) -> step``, where ``step()`` performs one optimizer step
on ``n`` float32 parameters (state carried from step to step, as in training).

Register one with ``@contender("name")``; raise :class:`NotAvailable` from the factory when
it cannot run that op here. ``onnxruntime_training`` is the exception: it runs in another
Python (see :mod:`._ortt_worker`) and :func:`.measure.run` dispatches it there.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from . import threads
from .problem import ATTRS, ONNX_OP, STATE_NAMES, NotAvailable, R, T, make_state, step_model

Step = Callable[[], None]
CONTENDERS: dict[str, Callable[[str, int], Step]] = {}


def contender(name: str) -> Callable:
    """Register ``factory(op, n) -> step`` under ``name`` (a decorator)."""

    def register(factory):
        CONTENDERS[name] = factory
        return factory

    return register


@contender("numpy_reference")
def numpy_reference(op: str, n: int) -> Step:
    from onnx_training_ops.kernels import REFERENCE_KERNELS

    kernel, attrs, names = REFERENCE_KERNELS[ONNX_OP[op]], ATTRS[op], STATE_NAMES[op]
    s = make_state(op, n)
    r, t = np.array(R, np.float32), np.array(T, np.int64)
    updated = [k for k in names if k != "G"]

    def step():
        outs = kernel(r, t, *(s[k] for k in names), **attrs)
        s.update(zip(updated, outs))

    return step


@contender("fused")
def fused_kernel(op: str, n: int) -> Step:
    from onnx_training_ops.kernels import fused
    from onnx_training_ops.optim.adagrad import adagrad_rate
    from onnx_training_ops.optim.adam import adam_rate
    from onnx_training_ops.optim.momentum import momentum_beta

    fused.warm_up()
    a, s = ATTRS[op], make_state(op, n)
    if op == "adam":

        def step():  # scalar preparation included: it is part of every step
            rate = adam_rate(R, T, a["alpha"], a["beta"])
            fused.adam_(s["X"], s["G"], s["V"], s["H"], rate, a["alpha"], a["beta"], a["epsilon"],
                        a["norm_coefficient"], a["norm_coefficient_post"])  # fmt: skip

    elif op in ("momentum", "nesterov"):

        def step():
            fused.momentum_(s["X"], s["G"], s["V"], R, a["alpha"], momentum_beta(T, a["beta"]),
                            a["norm_coefficient"], a["mode"] == "nesterov")  # fmt: skip

    else:

        def step():
            rate = adagrad_rate(R, T, a["decay_factor"])
            fused.adagrad_(s["X"], s["G"], s["H"], rate, a["epsilon"], a["norm_coefficient"])

    return step


@contender("onnx_reference_evaluator")
def onnx_reference_evaluator(op: str, n: int) -> Step:
    from onnx.reference import ReferenceEvaluator

    updated = [k for k in STATE_NAMES[op] if k != "G"]
    sess = ReferenceEvaluator(step_model(op, None))
    feeds = {"R": np.array(R, np.float32), "T": np.array(T, np.int64), **make_state(op, n)}

    def step():
        feeds.update(zip(updated, sess.run(None, feeds)))

    return step


# Session options of the ``graph`` contender, chosen by measurement on this machine (2 cores,
# Adam, median of 5 runs of the four GRAPH_VARIANTS, ms per step at 1e4/1e5/1e6/1e7):
#   default threads, spinning   0.069  0.197  4.01  38.1
#   1 thread, spinning          0.062  0.206  3.46  35.2
#   default threads, no spin    0.061  0.216  3.46  33.9
#   1 thread, no spin           0.040  0.157  2.79  33.5   <- chosen
# The node is one PyOp that runs numba's own threads; onnxruntime's intra-op pool has no
# work to share and, spinning, only competes with them. Run-to-run spread is 10-25%.
GRAPH_OPTIONS = {"intra_op_num_threads": 1, "allow_spinning": False}
GRAPH_VARIANTS = {
    "graph_default": {"intra_op_num_threads": 0, "allow_spinning": True},
    "graph_t1": {"intra_op_num_threads": 1, "allow_spinning": True},
    "graph_nospin": {"intra_op_num_threads": 0, "allow_spinning": False},
    "graph_t1_nospin": {"intra_op_num_threads": 1, "allow_spinning": False},
}


# The native kernels split the tensor over onnxruntime's intra-op pool: 2 threads, no spinning.
NATIVE_OPTIONS = {"intra_op_num_threads": 2, "allow_spinning": False}
# onnxruntime's own defaults (TrainingSession's sessions): all cores, spinning.
DEFAULT_OPTIONS = {"intra_op_num_threads": 0, "allow_spinning": True}
# The portable form is many standard elementwise nodes: onnxruntime's default pool, no spinning.
PORTABLE_OPTIONS = {"intra_op_num_threads": 0, "allow_spinning": False}


def session_options(options: dict):
    """``onnxruntime.SessionOptions`` from ``{"intra_op_num_threads": ..., "allow_spinning": ...}``."""
    import onnxruntime as ort

    so = ort.SessionOptions()
    so.intra_op_num_threads = threads.onnxruntime_threads(options["intra_op_num_threads"])
    if not options["allow_spinning"]:
        so.add_session_config_entry("session.intra_op.allow_spinning", "0")
    return so


def bound_step(sess, op: str, n: int, in_place: bool) -> Step:
    """``step()`` running ``sess`` (the one-node model's inputs and outputs) with IOBinding.

    Inputs are bound zero-copy (``OrtValue.ortvalue_from_numpy``). ``in_place``: each of
    X/V/H is bound as input and output (one OrtValue), the documented way to update state
    in place. Otherwise two bindings swap the roles of two sets of X/V/H buffers, so each
    step's new state is the next step's input without a copy. ``step.buffers[step.current[0]]``
    holds the current state (for tests)."""
    import onnxruntime as ort

    s = make_state(op, n)
    updated = [k for k in STATE_NAMES[op] if k != "G"]
    sets = [{k: s[k] for k in updated}] + ([] if in_place else [{k: np.empty_like(s[k]) for k in updated}])
    fixed = {"R": np.array(R, np.float32), "T": np.array(T, np.int64), "G": s["G"]}
    bindings = []
    for i in range(len(sets)):
        b = sess.io_binding()
        for k, v in fixed.items():
            b.bind_ortvalue_input(k, ort.OrtValue.ortvalue_from_numpy(v))
        for k in updated:
            value = ort.OrtValue.ortvalue_from_numpy(sets[i][k])
            b.bind_ortvalue_input(k, value)
            b.bind_ortvalue_output(f"{k}_new", value if in_place else ort.OrtValue.ortvalue_from_numpy(sets[1 - i][k]))
        bindings.append(b)
    current = [0]
    run = sess.run_with_iobinding

    def step():
        run(bindings[current[0]])
        current[0] = (current[0] + 1) % len(bindings)

    step.buffers = sets
    step.current = current
    return step


def graph_session(op: str, n: int, options: dict | None = None, kernels: str = "pyop", in_place: bool = False):
    """``(session, step)``: the one-node model in :class:`onnx_training_ops.InferenceSession`
    (``kernels``: ``"pyop"``, the plugin, or ``"native"``) run with IOBinding
    (:func:`bound_step`). ``options``: :data:`GRAPH_OPTIONS` unless given."""
    from onnx_training_ops.runtime import plugin
    from onnx_training_ops.runtime.session import InferenceSession

    if kernels == "native":
        from onnx_training_ops.runtime import native

        ok, reason = native.availability()
        if not ok:
            raise NotAvailable(f"native kernels: {reason}")
    else:
        plugin.keep_freed_memory()  # the bridge's per-call input copies then reuse memory
    so = session_options(GRAPH_OPTIONS if options is None else options)
    sess = InferenceSession(step_model(op, n), sess_options=so, kernels=kernels)
    return sess, bound_step(sess, op, n, in_place)


def portable_session(op: str, n: int, options: dict | None = None, in_place: bool = True):
    """``(session, step)``: ``prepare(model, portable=True)`` (the optimizer lowered to
    standard ONNX ops) in a plain ``onnxruntime.InferenceSession``, nothing registered,
    run with IOBinding (:func:`bound_step`; in place unless told otherwise)."""
    import onnxruntime as ort

    from onnx_training_ops.runtime.pipeline import prepare

    model = prepare(step_model(op, n), portable=True)
    so = session_options(PORTABLE_OPTIONS if options is None else options)
    sess = ort.InferenceSession(model.SerializeToString(), so, providers=["CPUExecutionProvider"])
    return sess, bound_step(sess, op, n, in_place)


@contender("graph")
def graph(op: str, n: int) -> Step:
    """The PyOp plugin path, two swapped sets of state buffers."""
    return graph_session(op, n)[1]


@contender("graph_native")
def graph_native(op: str, n: int) -> Step:
    """The native kernels (``kernels="native"``), X/V/H updated in place (one OrtValue in and out)."""
    return graph_session(op, n, NATIVE_OPTIONS, kernels="native", in_place=True)[1]


@contender("portable")
def portable(op: str, n: int) -> Step:
    """The portable form in plain onnxruntime, X/V/H updated in place."""
    return portable_session(op, n)[1]


@contender("training_session")
def training_session(op: str, n: int) -> Step:
    """``TrainingSession.from_graph`` on the one-node model, X_new->X, V_new->V, H_new->H:
    the fast path updates the state in place with the fused kernel. R and T are
    initializers; G is a graph input, fed on every step (as a real gradient is) and read
    by the kernel in place.

    The model also carries ``T_out = Identity(T)``: with the optimizer node cut out, a graph
    of nothing else leaves onnxruntime a session with no nodes, which it refuses to
    create ("OrtValue indexes should have been populated"). The scalar Identity costs
    one tiny onnxruntime run per step, as a real model's forward/backward would dwarf."""
    from onnx_training_ops.training import TrainingSession

    s = make_state(op, n)
    updated = [k for k in STATE_NAMES[op] if k != "G"]
    init = {"R": np.array(R, np.float32), "T": np.array(T, np.int64), **{k: s[k] for k in updated}}
    sess = TrainingSession.from_graph(step_model(op, n, init, count_output=True), {f"{k}_new": k for k in updated},
                                      sess_options=session_options(DEFAULT_OPTIONS))
    if not sess.fast_path_nodes:
        raise NotAvailable("the fast path did not take the optimizer node")
    feeds = {"G": s["G"]}
    run = sess.step

    def step():
        run(feeds)

    step.session = sess
    return step


def _torch_optimizer(op: str, n: int, impl: str):
    try:
        import torch
    except ImportError as exc:
        raise NotAvailable(f"torch not importable: {exc}") from exc
    threads.torch_pinned(torch)
    s = make_state(op, n)
    p = torch.nn.Parameter(torch.from_numpy(s["X"]))
    p.grad = torch.from_numpy(s["G"])
    kw = {impl: True}
    a = ATTRS[op]
    try:
        if op == "adam":
            opt = torch.optim.Adam([p], lr=R, betas=(a["alpha"], a["beta"]), eps=a["epsilon"], **kw)
        elif op in ("momentum", "nesterov"):
            opt = torch.optim.SGD([p], lr=R, momentum=a["alpha"], dampening=0.0, nesterov=op == "nesterov", **kw)
        else:
            opt = torch.optim.Adagrad([p], lr=R, eps=a["epsilon"], **kw)
        opt.step()  # creates the state (moments, step counters); fails here if unsupported
    except (RuntimeError, ValueError, TypeError) as exc:
        raise NotAvailable(f"torch.optim {impl}=True: {exc}") from exc
    return opt.step


@contender("torch_foreach")
def torch_foreach(op: str, n: int) -> Step:
    return _torch_optimizer(op, n, "foreach")


@contender("torch_fused")
def torch_fused(op: str, n: int) -> Step:
    return _torch_optimizer(op, n, "fused")


ORTT = "onnxruntime_training"


@contender(ORTT)
def onnxruntime_training(op: str, n: int) -> Step:
    """onnxruntime-training's AdamW ``Optimizer.step()``: measured in the Python that
    ``--ortt-python`` names (:mod:`._ortt_worker`), never in this process."""
    raise NotAvailable("onnxruntime-training runs in its own Python: give --ortt-python PATH")


def _graph_variant(options: dict) -> Callable[[str, int], Step]:
    return lambda op, n: graph_session(op, n, options)[1]


for _name, _options in GRAPH_VARIANTS.items():  # not in the default set: for choosing GRAPH_OPTIONS
    CONTENDERS[_name] = _graph_variant(_options)

DEFAULT_CONTENDERS = ("graph", "graph_native", "portable", "training_session", "fused", "numpy_reference",
                      "onnx_reference_evaluator", "torch_foreach", "torch_fused")  # fmt: skip
