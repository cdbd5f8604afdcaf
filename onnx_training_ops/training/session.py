"""TrainingSession: run an ONNX training model (``ModelProto.training_info``) in stock onnxruntime.

A training model is a stateful object (onnx ``docs/IR.md``): its *state variables* are the
initializers named as keys of an ``update_binding`` or ``initialization_binding``. The
session keeps each in one numpy array for its whole life; onnxruntime reads these arrays
zero-copy (:mod:`.binding`), so state never round-trips through fresh arrays between steps.

``step(feeds)`` runs every TrainingInfoProto's algorithm in order, on the main graph and the
algorithm graph concatenated (:mod:`.program`), :func:`~onnx_training_ops.prepare`-d
(Gradient expansion, plugin kernels). ``fast=True`` (the default) applies the optimizer
nodes in place with the fused kernels (:mod:`.fast_path`); ``fast=False`` runs them in
onnxruntime; both agree bit for bit. ``on_nonfinite`` says what a NaN or infinite loss does
(:mod:`.step`): ``"raise"`` :class:`NonFiniteLossError`, ``"skip"`` the step (counted in
``skipped_steps``) or ``"ignore"`` it; the first two leave the state unchanged. With
``fast=False`` the native optimizer kernels write the new state straight into the state
arrays during the run, no copies (:mod:`.in_place`; a guard keeps a non-finite loss from
reaching them).
"""

from __future__ import annotations

import functools
import os
import threading
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort

from ..builder.model_metadata import metadata
from ..errors import TrainingOpError, node_label
from ..kernels.compile_notice import announce_compiles
from ..runtime.options import default_intra_op_threads
from ..storage import checkpoint
from ..storage.large_model import LargeModel, detach, is_large
from ..storage.tensors import attach, proto_of
from ..storage.model_files import ModelLike, load_model
from .accumulation import GradientAccumulation
from .session_feeds import FeedsAndRun
from .session_files import Checkpointing
from .session_loop import TrainingLoop
from .session_parameters import FlatParameters
from .session_state import StateAccess
from .session_summary import Introspection
from .binding import open_program
from .checks import batch_checker, stored_properties
from .fast_path import flatten_cut_state
from .flat_parameters import lay_out_flat
from .feeds import FeedSpec
from .from_graph import graph_to_training_model
from .locked import locked
from .nominal import materialize, nominal_names
from .input_checks import input_checker
from .options import fresh_options
from .providers import checked_providers
from .program import Program, build_program
from .rates import LearningRates
from .stages import step_model
from .state import collect_state_protos, state_tensors, zero_fill
from .step import NONFINITE_POLICIES, NonFiniteLossError, run_program

__all__ = ["NONFINITE_POLICIES", "NonFiniteLossError", "TrainingSession"]


def _check_threads(threads, sess_options) -> None:
    """``threads``: None or an int >= 0 that ``sess_options`` does not contradict."""
    if threads is None:
        return
    if isinstance(threads, bool) or not isinstance(threads, (int, np.integer)) or threads < 0:
        raise TrainingOpError(f"threads must be a whole number >= 0 (0: onnxruntime's choice), found {threads!r}")
    given = sess_options.intra_op_num_threads if sess_options is not None else 0
    if given not in (0, threads):
        raise TrainingOpError(f"threads={threads} but sess_options.intra_op_num_threads is {given}: "
                              "pass one of them")


class TrainingSession(FeedsAndRun, StateAccess, TrainingLoop, Checkpointing, FlatParameters, Introspection):
    """Run an ONNX training model: ``initialize()``, ``step(feeds)``, ``run(...)``, checkpoints.

    The state starts at the model's initializers, so a checkpoint written by
    :meth:`save` resumes where it stopped; call :meth:`initialize` to reset the state and run
    the initialization graphs (a model fresh from the builder is already in that state). A
    nominal checkpoint (``save(path, nominal=True)``) opens with zeros in its parameters and
    the optimizer state initialized; it trains once :meth:`load_flat_parameters` filled them.

    Threads: a session may be shared. ``step``, ``run``, ``save``, ``state_dict``,
    ``load_state_dict``, ``initialize`` and the exports hold one lock, so concurrent calls
    run one after the other (no step is lost, no checkpoint is torn); for parallel training,
    use one session per thread.

    Args:
        model_or_path: a ModelProto, LargeModel, path or bytes of a model with
            ``training_info`` (from :func:`~onnx_training_ops.build_training_model` or written
            by hand following the IR spec), or a checkpoint.
        providers: onnxruntime execution providers; only the CPU provider trains (a device
            provider or one missing from the installed build is refused).
        fast: apply the optimizer nodes in place with the fused kernels (default); False runs
            them in onnxruntime. Both agree bit for bit.
        on_nonfinite: what a NaN or infinite loss does: ``"raise"``
            (:class:`NonFiniteLossError`), ``"skip"`` the step (counted in ``skipped_steps``)
            or ``"ignore"`` it; the first two leave the state unchanged.
        sess_options: onnxruntime options, copied for each onnxruntime session this one opens;
            what they leave at onnxruntime's defaults gets the package's (no memory pattern,
            the shared arena, a large model's memory options, the thread count:
            docs/training.md).
        session_config: extra onnxruntime session config entries.
        threads: intra-op threads of every onnxruntime session (0: onnxruntime's choice, one
            per core; default: 1 for a small model, else 0).

    Raises:
        TrainingOpError: a model without ``training_info``, a damaged or mismatched
            checkpoint (checksums), a refused provider or a bad argument.
    """

    def __init__(
        self,
        model_or_path: ModelLike,
        providers: Sequence[str | tuple[str, dict]] | None = None,
        *,
        fast: bool = True,
        on_nonfinite: str = "raise",
        sess_options: ort.SessionOptions | None = None,
        session_config: Mapping[str, str] | None = None,
        threads: int | None = None,
    ) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise TrainingOpError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, found {on_nonfinite!r}")
        _check_threads(threads, sess_options)
        providers = checked_providers(providers)  # before anything is loaded: a clear error, never a CPU run
        path = model_or_path if isinstance(model_or_path, (str, os.PathLike)) else None
        opened = load_model(model_or_path, large=True)
        # values outside the message are checked as they are read (each once): state_tensors
        expected = checkpoint.verify(opened, path, data=False)
        if not proto_of(opened).training_info:
            raise TrainingOpError(
                "the model has no training_info: build one with onnx_training_ops.build_training_model, or use "
                "TrainingSession.from_graph for a plain graph with explicit state inputs and outputs"
            )
        empty = nominal_names(metadata(proto_of(opened)))
        if empty:  # a nominal checkpoint: zeros until the parameters are loaded
            opened = materialize(attach(opened) if isinstance(opened, LargeModel) else opened)
        self._large = is_large(opened)
        # the session's own message stays small: every big tensor is an array beside it
        model = opened if isinstance(opened, LargeModel) else detach(opened)
        del opened
        self.fast = bool(fast)
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self._providers = providers
        self._sess_options = sess_options
        self._session_config = {str(k): str(v) for k, v in (session_config or {}).items()}
        self._model = model
        proto = model.model_proto
        self._meta = metadata(proto)
        self._inference = None
        self._state_protos: dict[str, onnx.TensorProto] = collect_state_protos(proto)
        self._state: dict[str, np.ndarray] = state_tensors(model, self._state_protos, expected,
                                                           f"checkpoint {os.fspath(path)!r}" if path else "the model")
        self._zero_state = frozenset(n for n, p in self._state_protos.items() if zero_fill(model, p))
        trainable = [n for n in self._meta.get("trainable", "").split(",") if n in self._state] or \
            [n for n, a in self._state.items() if a.dtype.kind == "f"]
        self._threads_given = threads
        self._threads = threads if threads is not None else \
            default_intra_op_threads(sum(self._state[n].size for n in trainable))
        with announce_compiles():  # the first session after an install compiles the kernels
            self._programs = self._open_programs(model)
        self._required_feeds = {}
        for program in self._programs:
            for spec in program.feeds:
                self._required_feeds.setdefault(spec.name, spec)
        self._rates = LearningRates(self._programs, self._meta)
        self._optional_feeds = set(self._rates.names) | {
            spec.name for p in self._programs for spec, _ in p.optional_feeds
        }
        self._required_set = set(self._required_feeds)
        self._init_sessions: list = []
        initializers = {t.name for t in proto.graph.initializer}
        data_inputs = [vi for vi in proto.graph.input if vi.name not in initializers]
        self._batch_checks = {where: batch_checker(self._meta, data_inputs, where)
                              for where in ("step", "backward", "evaluate")}
        self._input_checks = {where: input_checker(proto.graph, initializers, where)
                              for where in ("step", "backward", "evaluate", "run")}
        self._run_specs: dict[str, FeedSpec] | None = None
        self._properties: dict[str, Any] = stored_properties(self._meta.get("properties") or "{}")
        self._eval_programs: dict[tuple[str, ...], Program] = {}
        self._step_programs: dict[tuple[str, ...], list[Program]] = {}
        self._accumulation = GradientAccumulation(model, self._state, self._state_protos, self._meta,
                                                  self.fast, self._session_options, self._providers)
        # one step, save, run or state change at a time: concurrent callers wait their turn
        self._lock = threading.RLock()
        self._unfilled: set[str] = set()
        if empty:
            self.initialize()  # the optimizer state at its initial values
            self._unfilled = set(self._parameters(trainable_only=False)) & set(empty)

    def _open_programs(self, model: LargeModel, rehome: bool = True) -> list[Program]:
        """One program per TrainingInfoProto, bound to the state. fast=False: the native
        optimizers write the state in place (guarded against a non-finite loss unless it is
        ignored; a guarded step is redone by a copying twin). ``rehome``: the first programs
        lay the state out (each cut node's flat, then the trainables as one buffer if still
        apart: :meth:`get_flat_parameters` without a copy); later ones find it laid out."""
        analyses = [build_program(model, i, self._state, self._state_protos, self._meta, self.fast)
                    for i in range(len(model.model_proto.training_info))]
        for program in analyses:  # before anything binds a state array: lay the cut state out flat
            program.flat_nodes = flatten_cut_state(program.cut_nodes, program.cut_sources, self._state,
                                                   rehome=rehome, prescale=program.prescale,
                                                   zeros=self._zero_state)
        if rehome:
            lay_out_flat(self._state, [n for n in self._trainable_names() if n in self._state])
        programs = [open_program(p, self._state, self._session_options(), self._providers,
                                 in_place=not self.fast, guard=self.on_nonfinite != "ignore",
                                 constants_as_inputs=self._large) for p in analyses]
        for program in programs:
            if program.guarded:
                program.fallback = functools.partial(self._copying_program, program.index, model)
        if any(p.cut_nodes for p in analyses):
            _warm_up_fused_kernels()  # compile/load now, so no step pays for it
        return programs

    def _copying_program(self, index: int, model: LargeModel) -> Program:
        """Program ``index`` of ``model`` without in-place writes: it redoes a step the guard stopped."""
        program = build_program(model, index, self._state, self._state_protos, self._meta, False)
        return open_program(program, self._state, self._session_options(), self._providers)

    @classmethod
    def from_graph(
        cls,
        model: ModelLike,
        feedback: Mapping[str, str],
        *,
        initial_state: Mapping[str, np.ndarray] | None = None,
        **kwargs: Any,
    ) -> "TrainingSession":
        """A session for a plain graph that holds the optimizer itself, with explicit state.

        The graph becomes the algorithm of a training model whose main graph only holds the state,
        so :meth:`save` writes a regular training model.

        Args:
            model: the graph's model (ModelProto, path or bytes): state in as inputs, new state out.
            feedback: graph outputs -> the graph inputs they replace after each step
                (``{"X_new": "X", "V_new": "V", "T_new": "T"}``).
            initial_state: the initial value of a state input that has no initializer (an input
                with a default starts at that value).
            **kwargs: passed on to :class:`TrainingSession` (``fast``, ``sess_options``...).

        Returns:
            The TrainingSession.

        Raises:
            TrainingOpError: a feedback name that is not an output or input of the graph, or a
                state input without a value.
        """
        return cls(graph_to_training_model(model, feedback, initial_state), **kwargs)

    def _session_options(self) -> ort.SessionOptions:
        """A fresh SessionOptions per onnxruntime session (:mod:`.options`): ``threads`` intra-op
        threads, else (where the caller's options leave it at 0) one for a small model
        (:func:`default_intra_op_threads`)."""
        return fresh_options(self._sess_options, self._session_config, self._large, self._threads,
                             force_threads=self._threads_given is not None)

    def with_model(self, model: ModelLike) -> "TrainingSession":
        """A new session for ``model`` with this session's providers and options.

        Args:
            model: the training model or checkpoint to open.

        Returns:
            The new TrainingSession.
        """
        return type(self)(model, self._providers, fast=self.fast, on_nonfinite=self.on_nonfinite,
                          sess_options=self._sess_options, session_config=self._session_config,
                          threads=self._threads_given)

    # ------------------------------------------------------------------ steps

    @locked
    def step(self, feeds: Mapping[str, Any], lr: float | Mapping[str, float] | None = None,
             outputs: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """One training step: run each algorithm, assign its outputs by ``update_binding``.

        With gradients accumulated by :meth:`backward`, it is ``backward(feeds)`` then
        :meth:`optimizer_step` (the batch adds to them, as in torch).

        Args:
            feeds: the algorithm's inputs (the model's inputs and e.g. ``labels``).
            lr: the learning rate for this step, one for all groups or ``{input name: lr}``
                (default: the schedule's, else the model's value, or a feed of the learning-rate
                input).
            outputs: values of the same run to return too (``["logits"]``, any value of the main
                graph or the algorithm; onnxruntime-training's ``additional_output_names``),
                computed before the update.

        Returns:
            The outputs not consumed by ``update_binding`` (the loss, ``grad_norm``...), and
            ``outputs``.

        Raises:
            TrainingOpError: a missing, unknown or mis-shaped feed, labels out of range, or a bad ``lr``.
            NonFiniteLossError: a NaN or infinite loss with ``on_nonfinite="raise"`` (the state is
                left as it was).
        """
        self._check_filled("step")
        if self._accumulation.count:
            if outputs:
                raise TrainingOpError("step(outputs=...) with gradients accumulated by backward(): call "
                                      "optimizer_step() first, or evaluate(feeds, outputs=...)")
            result = self.backward(feeds)
            result.update(self.optimizer_step(lr))
            return result
        self._check_feeds(feeds, self._required_set, self._optional_feeds)
        rates = self._rates.for_step(lr)
        programs = self._programs_with(tuple(outputs))
        self._step_applied = True
        try:
            result = {}
            for program in programs:
                returned, _ = run_program(program, feeds, rates, self._state, self.on_nonfinite,
                                          self._count_last if program is programs[-1] else self._count)
                result.update(returned)
            return result
        except TrainingOpError as error:
            self._explain_failure(feeds, "step", error)

    def _count(self, skipped: bool) -> None:
        """A program's step was applied or skipped (runs with its state write)."""
        if skipped:
            self.skipped_steps += 1
            self._step_applied = False

    def _count_last(self, skipped: bool) -> None:
        """The last program's: the optimizer step counts if no program of it was skipped."""
        self._count(skipped)
        if self._step_applied:
            self._rates.step += 1

    def _programs_with(self, outputs: tuple[str, ...]) -> list[Program]:
        """The step programs, returning ``outputs`` too (opened on first use, bound to the state)."""
        if not outputs:
            return self._programs
        if outputs not in self._step_programs:
            derived = self._model.with_proto(step_model(self._model.model_proto, outputs))
            self._step_programs[outputs] = self._open_programs(derived, rehome=False)
        return self._step_programs[outputs]

    # ------------------------------------------------------------------ introspection

    @property
    def fast_path_nodes(self) -> list[str]:
        """Labels of the optimizer nodes the fast path applies in place."""
        return [node_label(n) for p in self._programs for n in p.cut_nodes]

    @property
    def providers(self) -> list[str]:
        """The execution providers this session trains on (names, in onnxruntime's order)."""
        return [p[0] if isinstance(p, tuple) else p for p in self._providers]

    @property
    def metadata(self) -> dict[str, str]:
        """The builder's metadata (optimizer, loss, labels, learning_rate, trainable), if any."""
        return dict(self._meta)


def _warm_up_fused_kernels() -> None:
    """Load the fused kernels once per process (from numba's disk cache after the first run)."""
    try:
        from ..kernels import fused
    except ImportError:  # pragma: no cover - the reference kernels serve without numba
        return
    fused.warm_up()

