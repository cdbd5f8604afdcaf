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
import json
import os
import threading
from typing import Any, Mapping, Sequence

import numpy as np
import onnx
import onnxruntime as ort
from onnx import helper, numpy_helper

from .. import checkpoint
from .. import schedules as lr_schedules
from ..builder import META_PREFIX, metadata
from ..errors import TrainingOpError, node_label
from ..passes import ModelLike, load_model
from ..session import InferenceSession
from .arrays import dtype_name, owned
from .binding import open_program
from .fast_path import flatten_cut_state
from .feeds import Feed, FeedSpec, check_feed_names, checked_learning_rate, feed_list
from .from_graph import graph_to_training_model
from .inference import inference_model, inference_session
from .program import Program, build_program
from .stages import GRAD_SCALE, evaluation_model, split_stages
from .state import assign, collect_state_protos
from .step import NONFINITE_POLICIES, NonFiniteLossError, run_program

__all__ = ["NONFINITE_POLICIES", "NonFiniteLossError", "TrainingSession"]


def _label_checker(meta: Mapping[str, str], batch_input: str | None):
    """For the builder's cross-entropy: a check that class labels lie in [0, C) (or equal
    ignore_index) and come in as many rows as the model's first input, so a bad label is our
    error naming the feed, not a kernel's."""
    spec = meta.get("label_range", "")
    name = meta.get("labels", "")
    if not spec or not name:
        return None
    classes_text, ignore_text = spec.split(",")
    classes, ignore = int(classes_text), (int(ignore_text) if ignore_text else None)
    unsigned = {size: np.dtype(f"u{size}") for size in (1, 2, 4, 8)}

    def check(feeds: Mapping[str, Any]) -> None:
        labels = feeds.get(name)
        if type(labels) is not np.ndarray:
            labels = np.asarray(labels)
        if labels.dtype.kind not in "iu":
            return  # the feed check names a wrong dtype
        if labels.size == 0:
            raise TrainingOpError(f"step: feed {name!r} is empty: a batch needs at least one "
                                  "example (the mean loss of none is undefined)")
        batch = feeds.get(batch_input)
        if batch is not None and labels.ndim:
            rows = np.shape(batch)
            if rows and labels.shape[0] != rows[0]:
                raise TrainingOpError(f"step: feed {name!r} has {labels.shape[0]} rows, input "
                                      f"{batch_input!r} has {rows[0]}: one label per example")
        if labels.view(unsigned[labels.itemsize]).max() < classes:
            return  # the common case, one reduction: a negative label is a huge unsigned one
        bad = (labels < 0) | (labels >= classes)
        if ignore is not None:
            bad &= labels != ignore
        if bad.any():
            value = labels[bad].reshape(-1)[0]
            raise TrainingOpError(
                f"step: feed {name!r} holds class {value}, outside [0, {classes})"
                + (f" and not ignore_index {ignore}" if ignore is not None else ""))

    return check


def _checked_properties(properties: Mapping[str, Any]) -> str:
    """``properties`` as JSON, or a TrainingOpError naming the first value that is not a
    str, int, float or bool (what a checkpoint keeps, as onnxruntime-training's)."""
    if not isinstance(properties, Mapping):
        raise TrainingOpError(f"properties must be a dict, found {type(properties).__name__}")
    for key, value in properties.items():
        if not isinstance(key, str):
            raise TrainingOpError(f"properties: keys must be str, found {key!r}")
        if not isinstance(value, (str, int, float, bool)) or \
                (isinstance(value, float) and not np.isfinite(value)):
            raise TrainingOpError(f"properties[{key!r}] must be a str, int, bool or finite float, "
                                  f"found {value!r} ({type(value).__name__})")
    return json.dumps(dict(properties), sort_keys=True)


def _program_feeds(program: Program) -> tuple[list[FeedSpec], list[FeedSpec]]:
    """(required, optional) inputs of a program: learning rates and inputs with a default are optional."""
    rates = [FeedSpec(name, buf.dtype, buf.shape) for name, buf in program.rate_inputs.items()]
    return list(program.feeds), [*rates, *(spec for spec, _ in program.optional_feeds)]


def _state_array(name: str, proto: onnx.TensorProto) -> np.ndarray:
    try:
        return numpy_helper.to_array(proto)
    except (ValueError, TypeError) as error:  # e.g. raw data of the wrong size for its dims
        raise TrainingOpError(f"state variable {name!r}: its stored data does not match its "
                              f"type and shape {list(proto.dims)}: {error}") from None


# every settable SessionOptions attribute (intra_op_num_threads, enable_profiling, ...)
_OPTION_ATTRIBUTES = [name for name, value in vars(ort.SessionOptions).items()
                      if isinstance(value, property) and value.fset is not None]
# config entries copied from a given SessionOptions (onnxruntime cannot list them; pass any
# other through ``session_config``)
CONFIG_KEYS = (
    "session.intra_op.allow_spinning", "session.inter_op.allow_spinning",
    "session.force_spinning_stop", "session.set_denormal_as_zero", "session.use_env_allocators",
    "session.disable_prepacking", "session.intra_op_thread_affinities", "session.dynamic_block_base",
    "session.disable_cpu_ep_fallback", "session.use_device_allocator_for_initializers",
    "session.disable_aot_function_inlining", "optimization.enable_gelu_approximation",
    "optimization.disable_specified_optimizers", "session.qdqisint8allowed",
)


def _locked(method):
    """Run ``method`` holding the session's lock (see the class docstring)."""

    @functools.wraps(method)
    def wrapper(self, *args, **kwargs):
        with self._lock:
            return method(self, *args, **kwargs)

    return wrapper


class TrainingSession:
    """Run an ONNX training model: ``initialize()``, ``step(feeds)``, ``run(...)``, checkpoints.

    ``model_or_path``: a ModelProto, path or bytes of a model with ``training_info`` (from
    :func:`~onnx_training_ops.build_training_model` or written by hand following the IR
    spec). The state starts at the model's initializers, so a checkpoint written by
    :meth:`save` resumes where it stopped; call :meth:`initialize` to reset the state and run
    the initialization graphs (a model fresh from the builder is already in that state).

    Threads: a session may be shared. ``step``, ``run``, ``save``, ``state_dict``,
    ``load_state_dict``, ``initialize`` and the exports hold one lock, so concurrent calls
    run one after the other (no step is lost, no checkpoint is torn); for parallel training,
    use one session per thread.
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
    ) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise TrainingOpError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, found {on_nonfinite!r}")
        model = load_model(model_or_path)
        checkpoint.verify(model, model_or_path if isinstance(model_or_path, (str, os.PathLike))
                          else None)
        if not model.training_info:
            raise TrainingOpError(
                "the model has no training_info: build one with onnx_training_ops.build_training_model, or use "
                "TrainingSession.from_graph for a plain graph with explicit state inputs and outputs"
            )
        self.fast = bool(fast)
        self.on_nonfinite = on_nonfinite
        self.skipped_steps = 0
        self._providers = list(providers) if providers is not None else ["CPUExecutionProvider"]
        self._sess_options = sess_options
        self._session_config = {str(k): str(v) for k, v in (session_config or {}).items()}
        self._model = model
        self._meta = metadata(model)
        self._inference = None
        self._state_protos: dict[str, onnx.TensorProto] = collect_state_protos(model)
        self._state: dict[str, np.ndarray] = {
            name: owned(_state_array(name, proto)) for name, proto in self._state_protos.items()
        }
        analyses = [
            build_program(model, i, self._state, self._state_protos, self._meta, self.fast)
            for i in range(len(model.training_info))
        ]
        for program in analyses:  # before anything binds a state array: lay the cut state out flat
            program.flat_nodes = flatten_cut_state(program.cut_nodes, program.cut_sources, self._state,
                                                   prescale=program.prescale)
        # fast=False: the native optimizers write the state in place (guarded against a
        # non-finite loss unless it is ignored; a guarded step redone by a copying twin)
        self._programs = [
            open_program(p, self._state, self._session_options(), self._providers,
                         in_place=not self.fast, guard=on_nonfinite != "ignore") for p in analyses
        ]
        for program in self._programs:
            if program.guarded:
                program.fallback = functools.partial(self._copying_program, program.index)
        if any(p.cut_nodes for p in analyses):
            _warm_up_fused_kernels()  # compile/load now, so no step pays for it
        self._required_feeds = {}
        for program in self._programs:
            for spec in program.feeds:
                self._required_feeds.setdefault(spec.name, spec)
        self._rate_names = list(dict.fromkeys(name for p in self._programs for name in p.rate_inputs))
        self._optional_feeds = set(self._rate_names) | {
            spec.name for p in self._programs for spec, _ in p.optional_feeds
        }
        self._required_set = set(self._required_feeds)
        self._init_sessions = None
        self._label_check = _label_checker(
            self._meta, model.graph.input[0].name if model.graph.input else None)
        self._base_rates = {name: float(p.rate_defaults[name].reshape(-1)[0])
                            for p in self._programs for name in p.rate_inputs
                            if p.rate_defaults[name] is not None}
        self._schedule, self._schedule_step = (
            lr_schedules.from_json(self._meta["lr_schedule"]) if self._meta.get("lr_schedule") else (None, 0))
        self._properties: dict[str, Any] = json.loads(self._meta.get("properties") or "{}")
        self._eval_programs: dict[tuple[str, ...], Program] = {}
        self._stages = None  # (backward program, apply program, Stages, state), made by backward()
        self._accumulated = 0
        # one step, save, run or state change at a time: concurrent callers wait their turn
        self._lock = threading.RLock()

    def _copying_program(self, index: int) -> Program:
        """Program ``index`` without in-place writes: it redoes a step the guard stopped."""
        program = build_program(self._model, index, self._state, self._state_protos, self._meta, False)
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

        ``feedback`` maps graph outputs to the graph inputs they replace after each step
        (``{"X_new": "X", "V_new": "V", "T_new": "T"}``). The initial value of each state
        input is its initializer (an input with a default) or ``initial_state[name]``.
        The graph becomes the algorithm of a training model whose main graph only holds
        the state, so :meth:`save` writes a regular training model.
        """
        return cls(graph_to_training_model(model, feedback, initial_state), **kwargs)

    def _session_options(self) -> ort.SessionOptions:
        """A fresh SessionOptions per onnxruntime session (InferenceSession registers the
        kernel library in the options it gets): every attribute of ``sess_options``, the
        config entries it holds among :data:`CONFIG_KEYS`, and ``session_config``."""
        so = ort.SessionOptions()
        if self._sess_options is None:
            # errors come back as our exception; onnxruntime's own log line would repeat them
            so.log_severity_level = 4
        else:
            for attr in _OPTION_ATTRIBUTES:
                setattr(so, attr, getattr(self._sess_options, attr))
            for key in CONFIG_KEYS:
                try:
                    value = self._sess_options.get_session_config_entry(key)
                except Exception:  # not set
                    continue
                so.add_session_config_entry(key, value)
        for key, value in self._session_config.items():
            so.add_session_config_entry(key, value)
        return so

    # ------------------------------------------------------------------ state

    @property
    def state_names(self) -> list[str]:
        """Names of the state variables (parameters, optimizer state, update count)."""
        return list(self._state)

    @_locked
    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every state variable."""
        return {name: value.copy() for name, value in self._state.items()}

    @_locked
    def load_state_dict(self, state: Mapping[str, np.ndarray], strict: bool = True) -> None:
        """Copy values into the state variables (same dtype and shape required).

        With ``strict`` the keys must be exactly the state variables; otherwise unknown keys
        raise and missing ones keep their value.
        """
        unknown = [k for k in state if k not in self._state]
        if unknown:
            raise TrainingOpError(f"load_state_dict: unknown state variable(s) {unknown}; known: {self.state_names}")
        if strict:
            missing = [k for k in self._state if k not in state]
            if missing:
                raise TrainingOpError(f"load_state_dict: missing state variable(s) {missing}")
        checked = {}
        for name, value in state.items():
            target = self._state[name]
            value = np.asarray(value)
            if value.dtype != target.dtype:
                raise TrainingOpError(
                    f"load_state_dict: state variable {name!r} is {dtype_name(target.dtype)}, found {dtype_name(value.dtype)}"
                )
            if value.shape != target.shape:
                raise TrainingOpError(
                    f"load_state_dict: state variable {name!r} has shape {list(target.shape)}, found {list(value.shape)}"
                )
            checked[name] = value
        for name, value in checked.items():
            np.copyto(self._state[name], value)

    @_locked
    def initialize(self) -> None:
        """Reset every state variable to its initializer, then run the initialization graphs
        (accumulated gradients are dropped)."""
        self.zero_grad()
        for name, proto in self._state_protos.items():
            np.copyto(self._state[name], numpy_helper.to_array(proto))
        if self._init_sessions is None:
            self._init_sessions = []
            for info in self._model.training_info:
                init = info.initialization
                if not info.initialization_binding:
                    self._init_sessions.append(None)
                    continue
                m = helper.make_model(init, opset_imports=list(self._model.opset_import))
                m.ir_version = self._model.ir_version
                m.functions.extend(self._model.functions)
                sess = InferenceSession(m, providers=self._providers)
                self._init_sessions.append(sess)
        for info, sess in zip(self._model.training_info, self._init_sessions):
            if sess is None:
                continue
            names = [e.value for e in info.initialization_binding]
            values = sess.run(names, {})
            for entry, value in zip(info.initialization_binding, values):
                assign(self._state, entry.key, value, f"initialization_binding {entry.key!r} <- {entry.value!r}")

    # ------------------------------------------------------------------ steps

    @property
    def feed_names(self) -> list[str]:
        """Inputs ``step`` needs (learning-rate inputs are optional: ``lr=`` or their default)."""
        return list(self._required_feeds)

    @property
    def optional_feed_names(self) -> list[str]:
        """Inputs ``step`` takes but does not need: learning rates and inputs with a default value."""
        return sorted(self._optional_feeds)

    @property
    def learning_rate_names(self) -> list[str]:
        return list(self._rate_names)

    @_locked
    def step(self, feeds: Mapping[str, Any], lr: float | Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
        """One training step: run each algorithm, assign its outputs by ``update_binding``.

        ``feeds``: the algorithm's inputs (the model's inputs and e.g. ``labels``).
        ``lr``: the learning rate for this step, one for all groups or ``{input name: lr}``
        (default: the schedule's, else the model's value, or a feed of the learning-rate
        input). Returns the outputs not consumed by ``update_binding`` (the loss, ...).
        With gradients accumulated by :meth:`backward`, it is ``backward(feeds)`` then
        :meth:`optimizer_step` (the batch adds to them, as in torch).
        """
        if self._accumulated:
            result = self.backward(feeds)
            result.update(self.optimizer_step(lr))
            return result
        self._check_feeds(feeds, self._required_set, self._optional_feeds)
        rates = self._rates(lr)
        result: dict[str, np.ndarray] = {}
        applied = True
        for program in self._programs:
            outputs, skipped = run_program(program, feeds, rates, self._state, self.on_nonfinite)
            if skipped:
                self.skipped_steps += 1
                applied = False
            result.update(outputs)
        if applied:
            self._schedule_step += 1
        return result

    def _check_feeds(self, feeds: Mapping[str, Any], required: set[str], optional: set[str]) -> None:
        if type(feeds) is not dict and not isinstance(feeds, Mapping):
            raise TrainingOpError(f"step: feeds must be a mapping of input name to array, found "
                                  f"{type(feeds).__name__}; inputs: {sorted(required)}")
        check_feed_names(feeds, required, optional)
        if self._label_check is not None:
            self._label_check(feeds)

    def _rates(self, lr) -> float | dict[str, float] | None:
        """This optimizer step's learning rates: ``lr`` if given, else the schedule's, else None (the defaults)."""
        if lr is not None:
            if not self._rate_names:
                raise TrainingOpError(
                    "step: lr was given but no optimizer of this model takes its learning rate from a graph "
                    "input (R is a constant or computed in the graph)")
            if isinstance(lr, Mapping):
                unknown = sorted(set(lr) - set(self._rate_names))
                if unknown:
                    raise TrainingOpError(f"step: lr names unknown learning-rate input(s) {unknown}; "
                                          f"the model's: {self._rate_names}")
                return {name: checked_learning_rate(v, f"step: lr[{name!r}]") for name, v in lr.items()}
            return checked_learning_rate(lr)
        if self._schedule is None:
            return None
        return {name: lr_schedules.rate(self._schedule, base, self._schedule_step, name)
                for name, base in self._base_rates.items()}

    # ------------------------------------------------------------------ the training loop

    @property
    def learning_rates(self) -> dict[str, float]:
        """The learning rate of each input for the next optimizer step (schedule or default)."""
        rates = self._rates(None)
        if isinstance(rates, dict):
            return rates
        return dict(self._base_rates)

    @property
    def lr_schedule(self):
        """The attached schedule (:mod:`onnx_training_ops.schedules`) or None."""
        return self._schedule

    @property
    def lr_schedule_step(self) -> int:
        """Optimizer steps taken under the schedule (torch's ``scheduler.last_epoch``)."""
        return self._schedule_step

    @_locked
    def set_lr_schedule(self, schedule, step: int = 0) -> None:
        """Drive every learning-rate input by ``schedule`` from optimizer step ``step`` on
        (each from its own default as base rate, as torch's ``base_lrs``); None detaches it.
        Saved in checkpoints with its position."""
        if schedule is not None and type(schedule) not in lr_schedules.SCHEDULES.values():
            raise TrainingOpError(f"set_lr_schedule: expected one of "
                                  f"{sorted(lr_schedules.SCHEDULES)}, found {type(schedule).__name__}")
        if schedule is not None:
            missing = [n for n in self._rate_names if n not in self._base_rates]
            if not self._rate_names or missing:
                raise TrainingOpError("set_lr_schedule: the model has no learning-rate input with a "
                                      f"default value to schedule ({missing or 'no inputs'})")
        if isinstance(step, bool) or not isinstance(step, int) or step < 0:
            raise TrainingOpError(f"set_lr_schedule: step must be an int >= 0, found {step!r}")
        self._schedule, self._schedule_step = schedule, step

    @property
    def properties(self) -> dict[str, Any]:
        """User values (str, int, float, bool) saved atomically with each checkpoint and
        restored with it: epoch, best metric, data position (onnxruntime-training's
        ``CheckpointState`` properties)."""
        return self._properties

    @_locked
    def evaluate(self, feeds: Mapping[str, Any], outputs: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """The loss (the eval-mode loss of a ``mode="train"`` model: dropout off, BatchNorm
        running statistics) and ``outputs`` with the current weights; nothing changes."""
        program = self._eval_program(tuple(outputs))
        required, optional = _program_feeds(program)
        self._check_feeds(feeds, {f.name for f in required}, {f.name for f in optional})
        result, _ = run_program(program, feeds, None, self._state, "ignore")
        eval_loss, loss = self._meta.get("eval_loss"), self._meta.get("loss")
        if eval_loss in result and loss not in outputs:  # the eval-mode loss, under the loss's name
            result[loss] = result.pop(eval_loss)
        return result

    def _eval_program(self, outputs: tuple[str, ...]) -> Program:
        if outputs not in self._eval_programs:
            loss = self._meta.get("eval_loss") or self._meta.get("loss", "")
            if not loss and not outputs:
                raise TrainingOpError("evaluate: the model names no loss (metadata 'loss'); pass outputs=[...]")
            derived = evaluation_model(self._model, loss, list(outputs)) if loss else \
                evaluation_model(self._model, outputs[0], list(outputs[1:]))
            program = build_program(derived, 0, self._state, self._state_protos, self._meta, False,
                                    prune_inputs=True)
            self._eval_programs[outputs] = open_program(program, self._state, self._session_options(),
                                                        self._providers)
        return self._eval_programs[outputs]

    def _stage_programs(self):
        if self._stages is None:
            stages = split_stages(self._model)
            protos = dict(self._state_protos)
            buffers = stages.buffers
            for t in stages.backward.training_info[0].algorithm.initializer:
                if t.name in buffers:
                    protos[t.name] = t
            self._acc, self._acc_flat = _flat_accumulators(
                {name: numpy_helper.to_array(protos[name]) for name in buffers})
            state = {**self._state, **self._acc}
            programs = []
            for derived in (stages.backward, stages.apply):
                program = build_program(derived, 0, state, protos, self._meta, self.fast, prune_inputs=True)
                program.flat_nodes = flatten_cut_state(program.cut_nodes, program.cut_sources, state,
                                                       rehome=False, prescale=program.prescale)
                programs.append(open_program(program, state, self._session_options(), self._providers,
                                             in_place=not self.fast and derived is stages.apply))
            self._stages = (programs[0], programs[1], stages, state)
        return self._stages

    @_locked
    def backward(self, feeds: Mapping[str, Any], scale: float = 1.0) -> dict[str, np.ndarray]:
        """Add this batch's gradients (times ``scale``) to the accumulated ones; returns the
        loss. Parameters and optimizer state do not change (BatchNorm running statistics do,
        as in torch's forward). For the mean over k micro-batches pass ``scale=1/k``, as
        torch users divide the loss. Non-finite losses follow ``on_nonfinite``."""
        backward, _, _, state = self._stage_programs()
        required, optional = _program_feeds(backward)
        self._check_feeds(feeds, {f.name for f in required} - {GRAD_SCALE}, {f.name for f in optional})
        scale = checked_learning_rate(scale, "backward: scale")
        result, skipped = run_program(backward, {**feeds, GRAD_SCALE: np.array(scale, np.float64)}, None,
                                      state, self.on_nonfinite)
        if skipped:
            self.skipped_steps += 1
        else:
            self._accumulated += 1
        return result

    @_locked
    def optimizer_step(self, lr: float | Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
        """Apply the accumulated gradients (clipping, weight decay, the optimizer, T + 1),
        then zero them; returns the apply stage's outputs (``grad_norm`` when clipping)."""
        if not self._accumulated:
            raise TrainingOpError("optimizer_step: no gradients accumulated since the last optimizer "
                                  "step; call backward(feeds) first")
        _, apply, _, state = self._stage_programs()
        result, _ = run_program(apply, {}, self._rates(lr), state, "ignore")
        self.zero_grad()
        self._schedule_step += 1
        return result

    @_locked
    def zero_grad(self) -> None:
        """Forget the accumulated gradients (torch's ``zero_grad(set_to_none=False)``)."""
        for acc in self._acc.values() if self._stages is not None else ():
            acc.fill(0)
        self._accumulated = 0

    @_locked
    def gradients(self) -> dict[str, np.ndarray]:
        """A copy of each trainable's accumulated gradient (zeros before any backward). A
        sparse table's (``sparse_updates``) is dense, table-sized: the summed gradients of its
        looked-up rows, zero elsewhere (which rows count as touched is kept apart)."""
        _, _, stages, state = self._stage_programs()
        return {param: state[acc].copy() for param, acc in stages.gradients.items()}

    @_locked
    def gradient_buffers(self) -> list[np.ndarray]:
        """The live accumulated gradients as flat 1-D buffers, one per dtype: every
        ``gradients()`` entry is a view into one of them. Changing them in place (an
        all-reduce across processes) changes what :meth:`optimizer_step` applies. A sparse
        table adds two views to its dtype's buffer, after the dense gradients: its dense
        gradient, then a per-row counter of lookups (> 0: the row is updated), so a sum
        then × 1/world over processes keeps both right."""
        self._stage_programs()
        return list(self._acc_flat)

    @_locked
    def gradient_views(self) -> list[tuple[str, np.ndarray]]:
        """(trainable, live accumulator) pairs: views into :meth:`gradient_buffers`, for
        collectives that treat trainables apart (a sharded optimizer reduces each gradient to
        the rank that owns its trainable). A sparse table has two, back to back: its dense
        gradient, then its per-row touched counter (see :meth:`gradient_buffers`)."""
        _, _, stages, state = self._stage_programs()
        return [(param, state[name]) for param, name in stages.views]

    @_locked
    def state_views(self, names: Sequence[str]) -> list[np.ndarray]:
        """The live arrays of the state variables ``names``: writing into them in place (an
        all-gather or broadcast across processes) changes the state the next run reads."""
        unknown = [n for n in names if n not in self._state]
        if unknown:
            raise TrainingOpError(f"state_views: unknown state variable(s) {unknown}")
        return [self._state[n] for n in names]

    @property
    def buffer_names(self) -> list[str]:
        """State the backward stage updates from the batch (BatchNorm running statistics), not
        the optimizer: per-process in data-parallel training, like torch's module buffers."""
        backward = self._stage_programs()[0]
        return [k for k in backward.binding if k in self._state]

    def with_model(self, model: ModelLike) -> "TrainingSession":
        """A new session for ``model`` with this session's providers and options."""
        return type(self)(model, self._providers, fast=self.fast, on_nonfinite=self.on_nonfinite,
                          sess_options=self._sess_options, session_config=self._session_config)

    @property
    def accumulated_batches(self) -> int:
        """How many ``backward`` calls the accumulated gradients hold."""
        return self._accumulated

    @property
    def feeds(self) -> list[Feed]:
        """What :meth:`step` takes: name, dtype, shape and whether it is optional, like
        ``InferenceSession.get_inputs()``."""
        required, optional = [], []
        for program in self._programs:
            r, o = _program_feeds(program)
            required += r
            optional += o
        return feed_list(required, optional)

    @_locked
    def eval_feeds(self, outputs: Sequence[str] = ()) -> list[Feed]:
        """What :meth:`evaluate` takes (for the same ``outputs``)."""
        return feed_list(*_program_feeds(self._eval_program(tuple(outputs))))

    # ------------------------------------------------------------------ inference, export

    @_locked
    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        """Run the main (inference) graph with the current state; like ``InferenceSession.run``."""
        if self._inference is None:
            self._inference = inference_session(self._model, self._state, self._session_options(), self._providers)
        session, state_inputs = self._inference
        full = dict(feeds)
        for name in state_inputs:
            if name in full:
                raise TrainingOpError(f"run: {name!r} is a state variable, not a feed")
            full[name] = self._state[name]
        try:
            return session.run(output_names, full)
        except TrainingOpError:
            raise
        except Exception as error:
            raise TrainingOpError(f"run: {error}") from error

    @_locked
    def training_model(self) -> onnx.ModelProto:
        """The training model with the current state as initializers, the properties and the
        schedule's position (what :meth:`save` writes)."""
        return checkpoint.write_state(self._model, self._state, self.checkpoint_metadata())

    def checkpoint_metadata(self) -> dict[str, str]:
        """The metadata entries a checkpoint of this session carries (properties, schedule)."""
        schedule = "" if self._schedule is None else lr_schedules.to_json(self._schedule, self._schedule_step)
        return {META_PREFIX + "properties": _checked_properties(self._properties) if self._properties else "",
                META_PREFIX + "lr_schedule": schedule}

    @_locked
    def save(self, path: str | os.PathLike) -> str:
        """Write the training model with the current state, atomically; reloading resumes bit-exact."""
        if "shard" in self._meta:
            raise TrainingOpError(
                "save: this session holds one rank's shard of the optimizer state (ZeRO-1); save through "
                "DistributedTrainingSession.save, which gathers the whole state into one checkpoint")
        return checkpoint.save_model(self.training_model(), path)

    @_locked
    def export_inference_model(self, path: str | os.PathLike | None = None) -> onnx.ModelProto:
        """The main graph with the trained weights and no training_info (written to ``path`` if given)."""
        model = inference_model(self._model, self._state, with_state_values=True)
        if not model.graph.output:
            raise TrainingOpError("export_inference_model: the main graph has no outputs")
        if path is not None:
            checkpoint.save_model(model, path)
        return model

    # ------------------------------------------------------------------ introspection

    @property
    def fast_path_nodes(self) -> list[str]:
        """Labels of the optimizer nodes the fast path applies in place."""
        return [node_label(n) for p in self._programs for n in p.cut_nodes]

    @_locked
    def end_profiling(self) -> list[str]:
        """With ``sess_options.enable_profiling``: end profiling in every onnxruntime session
        this session opened (step programs, stages, evaluation, inference) and return the
        trace files onnxruntime wrote."""
        sessions = [p.session for p in self._programs] + [p.session for p in self._eval_programs.values()]
        if self._stages is not None:
            sessions += [self._stages[0].session, self._stages[1].session]
        if self._inference is not None:
            sessions.append(self._inference[0])
        return [path for path in (s.end_profiling() for s in sessions) if path]

    @property
    def metadata(self) -> dict[str, str]:
        """The builder's metadata (optimizer, loss, labels, learning_rate, trainable), if any."""
        return dict(self._meta)


def _flat_accumulators(arrays: Mapping[str, np.ndarray]) -> tuple[dict[str, np.ndarray], list[np.ndarray]]:
    """Copies of ``arrays`` as views into one flat buffer per dtype (name order kept), and
    the buffers: the gradients of a step are one contiguous block to reduce or inspect."""
    by_dtype: dict[np.dtype, list[str]] = {}
    for name, array in arrays.items():
        by_dtype.setdefault(array.dtype, []).append(name)
    views, buffers = {}, []
    for dtype, names in by_dtype.items():
        flat = np.empty(sum(arrays[n].size for n in names), dtype)
        offset = 0
        for name in names:
            size = arrays[name].size
            views[name] = flat[offset:offset + size].reshape(arrays[name].shape)
            views[name][...] = arrays[name]
            offset += size
        buffers.append(flat)
    return {name: views[name] for name in arrays}, buffers


def _warm_up_fused_kernels() -> None:
    """Load the fused kernels once per process (from numba's disk cache after the first run)."""
    try:
        from ..kernels import fused
    except ImportError:  # pragma: no cover - the reference kernels serve without numba
        return
    fused.warm_up()
