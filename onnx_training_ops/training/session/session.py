"""TrainingSession: run an ONNX training model (``ModelProto.training_info``) in stock onnxruntime.

A training model is a stateful object (onnx ``docs/IR.md``): its *state variables* are the
initializers named as keys of an ``update_binding`` or ``initialization_binding``. The
session keeps each in one numpy array for its whole life; onnxruntime reads these arrays
zero-copy (:mod:`..graphs.binding`), so state never round-trips through fresh arrays between steps.

``step(feeds)`` runs every TrainingInfoProto's algorithm in order, on the main graph and the
algorithm graph concatenated (:mod:`..graphs.program`), :func:`~onnx_training_ops.prepare`-d
(Gradient expansion, plugin kernels). ``fast=True`` (the default on host arrays) applies the optimizer
nodes in place with the fused kernels (:mod:`..fastpath.fast_path`); ``fast=False`` runs them in
onnxruntime; both agree bit for bit. ``on_nonfinite`` says what a NaN or infinite loss does
(:mod:`..graphs.step`): ``"raise"`` :class:`NonFiniteLossError`, ``"skip"`` the step (counted in
``skipped_steps``) or ``"ignore"`` it; the first two leave the state unchanged. With
``fast=False`` the native optimizer kernels write the new state straight into the state
arrays during the run, no copies (:mod:`..fastpath.in_place`; a guard keeps a non-finite loss from
reaching them).

The class is thin: it holds the caller's choices, one lock, and the four parts of the engine
(:mod:`..engine`), each opened from the model by :func:`~..engine.open.open_parts` —
:class:`~..engine.store.StateStore` (the state variables), :class:`~..engine.programs.SessionPrograms`
(the onnxruntime programs over them), :class:`~..engine.loop.TrainingLoop` (steps,
evaluation, accumulation, learning rates) and :class:`~..engine.files.Checkpointer`
(checkpoints and exports). Each public method takes the lock and calls one part. Where the
state lives and where the update runs are the engine's two strategies (:mod:`..engine.config`):
``device`` and ``repr`` say which run.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort

from ...errors import TrainingOpError, node_label
from ...lora import formats as lora_formats
from ...lora.spec import LoraSpec
from ...runtime.session import InferenceSession
from ...storage.large_model import LargeModel
from ...storage.model_files import ModelLike
from ..engine import RuntimeConfig, check_threads, checked_config, open_parts
from ..engine.config import describe_strategies
from ..graphs.step import NONFINITE_POLICIES, NonFiniteLossError
from ..inputs.feeds import Feed
from ..options import precision
from ..options.providers import device_inputs, placement
from ..summary import ModelSummary, summary
from .from_graph import graph_to_training_model
from .locked import locked
from .session_summary import describe, torch_state_dict

__all__ = ["NONFINITE_POLICIES", "NonFiniteLossError", "TrainingSession"]


class TrainingSession:
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
        providers: onnxruntime execution providers (one missing from the installed build is
            refused). With a device provider (``CUDAExecutionProvider``...) the state lives on
            that device (see ``device``).
        fast: apply the optimizer nodes in place with the fused kernels (the default on host
            arrays); False runs them in onnxruntime (native kernels writing the state during the
            run). Both agree bit for bit. With a ``device`` the update runs in the graph:
            ``fast=True`` is refused there.
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
        device: where the state lives: ``"cuda"``, ``"cuda:N"`` (the providers default to the
            device's and the CPU's), or ``"cpu"`` for the same device-resident engine on the CPU.
            Default: the device of the first device provider listed, else host arrays. On a
            device every parameter, optimizer state, update count and accumulated gradient is
            an OrtValue there for the session's life; per step only the batch and the learning
            rates go up and the returned values come down; the optimizers run lowered to
            standard ops in onnxruntime (``fast`` does not apply). With ``"cpu"`` the state stays in
            host arrays bound zero-copy (``state_views``, ``gradient_buffers`` work). docs/gpu.md.
        input_shapes: with a ``device``, the step's data inputs' static shapes
            (``{"input_ids": [8, 256]}``): its shape arithmetic is folded once, and every
            ``step`` batch must have these shapes (``evaluate`` takes any).
        cuda_graph: with a CUDA device, replay the step as a CUDA graph. None (default): when
            safe, i.e. static step inputs (their own or ``input_shapes``), the state written in
            place, and every node on the CUDA EP; True: an error
            naming what prevents it (refused without a CUDA ``device``); False: never.

    Raises:
        TrainingOpError: a model without ``training_info``, a damaged or mismatched
            checkpoint (checksums), a refused provider or a bad argument.
    """

    def __init__(
        self,
        model_or_path: ModelLike,
        providers: Sequence[str | tuple[str, dict]] | None = None,
        *,
        fast: bool | None = None,
        on_nonfinite: str = "raise",
        sess_options: ort.SessionOptions | None = None,
        session_config: Mapping[str, str] | None = None,
        threads: int | None = None,
        device: str | None = None,
        input_shapes: Mapping[str, Sequence[int]] | None = None,
        cuda_graph: bool | None = None,
    ) -> None:
        if on_nonfinite not in NONFINITE_POLICIES:
            raise TrainingOpError(f"on_nonfinite must be one of {NONFINITE_POLICIES}, found {on_nonfinite!r}")
        check_threads(threads, sess_options)
        where = placement(providers, device)  # before anything is loaded: a clear error, never a CPU run
        config = checked_config(where.providers, fast, on_nonfinite, sess_options, session_config, threads,
                                where.device, where.device_id, device_inputs(input_shapes, where.device), cuda_graph)
        self._open(model_or_path, config)

    def _open(self, model_or_path: ModelLike, config: RuntimeConfig) -> None:
        """Open the engine on ``model_or_path`` with ``config`` (checked)."""
        self._config = config
        # one step, save, run or state change at a time: concurrent callers wait their turn
        self._lock = threading.RLock()
        self._store, self._programs, self._loop, self._files = open_parts(model_or_path, config)

    @classmethod
    def _opened(cls, model_or_path: ModelLike, config: RuntimeConfig) -> TrainingSession:
        """A session on ``model_or_path`` with a checked ``config`` (the engine's other openers)."""
        session = cls.__new__(cls)
        session._open(model_or_path, config)
        return session

    @classmethod
    def from_graph(
        cls,
        model: ModelLike,
        feedback: Mapping[str, str],
        *,
        initial_state: Mapping[str, np.ndarray] | None = None,
        **kwargs: Any,
    ) -> TrainingSession:
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

    def with_model(self, model: ModelLike) -> TrainingSession:
        """A new session for ``model`` with this session's providers and options.

        Args:
            model: the training model or checkpoint to open.

        Returns:
            The new TrainingSession.
        """
        return type(self)._opened(model, self._config)

    # ------------------------------------------------------------------ steps and evaluation

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
        return self._loop.step(feeds, lr, outputs)

    @locked
    def eval_feeds(self, outputs: Sequence[str] = ()) -> list[Feed]:
        """What :meth:`evaluate` takes (for the same ``outputs``).

        Args:
            outputs: the extra outputs :meth:`evaluate` would be asked for.

        Returns:
            One entry per input: name, dtype, shape and whether it is optional.
        """
        return self._programs.eval_feeds(tuple(outputs))

    @locked
    def evaluate(self, feeds: Mapping[str, Any], outputs: Sequence[str] = ()) -> dict[str, np.ndarray]:
        """The loss and ``outputs`` with the current weights; nothing changes.

        The loss of a ``mode="train"`` model is its eval-mode loss (dropout off, BatchNorm
        running statistics), bit-equal to a step's in eval mode.

        Args:
            feeds: the inputs of the model and the loss (e.g. ``input`` and ``labels``).
            outputs: more values to return (any value of the main graph).

        Returns:
            ``{"loss": ..., **outputs}``.

        Raises:
            TrainingOpError: a missing, unknown or mis-shaped feed, or an unknown output.
        """
        return self._loop.evaluate(feeds, outputs)

    @locked
    def run(self, output_names: Sequence[str] | None, feeds: Mapping[str, Any]) -> list[np.ndarray]:
        """Run the main (inference) graph with the current state; like ``InferenceSession.run``.

        Args:
            output_names: the outputs to return (any value of the main graph); None for all outputs.
            feeds: the main graph's inputs.

        Returns:
            The values, in the order asked for.

        Raises:
            TrainingOpError: a missing, unknown or mis-shaped feed, or an unknown output.
        """
        self._store.check_filled("run")
        return self._programs.run(output_names, feeds)

    @property
    def fast(self) -> bool:
        """Whether the fused kernels apply the optimizer nodes in place (``fast=`` when opened;
        False where the update runs in the graph)."""
        return self._config.fast

    @property
    def on_nonfinite(self) -> str:
        """What a NaN or infinite loss does (``on_nonfinite=`` when opened)."""
        return self._config.on_nonfinite

    @property
    def skipped_steps(self) -> int:
        """Steps (and ``backward`` calls) skipped for a non-finite loss under ``on_nonfinite="skip"``."""
        return self._loop.skipped_steps

    @property
    def loss_scale(self) -> float | None:
        """The current dynamic loss scale (``build_training_model(..., precision="fp16")``), or None
        for a model without loss scaling."""
        return precision.loss_scale(self._programs.meta, self._store.arrays)

    @property
    def overflow_steps(self) -> int:
        """Steps the loss scaling skipped for a non-finite gradient (parameters, optimizer state
        and T left unchanged, the scale backed off); 0 without loss scaling."""
        return precision.overflow_steps(self._programs.meta, self._store.arrays)

    # ------------------------------------------------------------------ gradient accumulation

    @locked
    def backward(self, feeds: Mapping[str, Any], scale: float = 1.0) -> dict[str, np.ndarray]:
        """Add this batch's gradients (times ``scale``) to the accumulated ones.

        Parameters and optimizer state do not change (BatchNorm running statistics do, as in
        torch's forward). Non-finite losses follow ``on_nonfinite``.

        Args:
            feeds: the algorithm's inputs (the model's inputs and e.g. ``labels``).
            scale: factor on this batch's gradients; for the mean over k micro-batches pass
                ``scale=1/k``, as torch users divide the loss.

        Returns:
            ``{"loss": ...}``: this batch's loss.

        Raises:
            TrainingOpError: a missing, unknown or mis-shaped feed.
            NonFiniteLossError: a NaN or infinite loss with ``on_nonfinite="raise"``.
        """
        return self._loop.backward(feeds, scale)

    @locked
    def optimizer_step(self, lr: float | Mapping[str, float] | None = None) -> dict[str, np.ndarray]:
        """Apply the accumulated gradients (clipping, weight decay, the optimizer, T + 1), then zero them.

        Args:
            lr: the learning rate for this step, one for all groups or ``{input name: lr}``
                (default: the schedule's, else the model's value).

        Returns:
            The apply stage's outputs (``grad_norm`` when clipping).

        Raises:
            TrainingOpError: no gradients accumulated (call :meth:`backward` first), or a bad ``lr``.
        """
        return self._loop.optimizer_step(lr)

    @locked
    def zero_grad(self) -> None:
        """Forget the accumulated gradients (torch's ``zero_grad(set_to_none=False)``)."""
        self._loop.accumulation.zero()

    @property
    def accumulated_batches(self) -> int:
        """How many ``backward`` calls the accumulated gradients hold."""
        return self._loop.accumulation.count

    @locked
    def gradients(self) -> dict[str, np.ndarray]:
        """A copy of each trainable's accumulated gradient (zeros before any backward). A
        sparse table's (``sparse_updates``) is dense, table-sized: the summed gradients of its
        looked-up rows, zero elsewhere (which rows count as touched is kept apart)."""
        return self._loop.accumulation.gradients()

    @locked
    def gradient_buffers(self) -> list[np.ndarray]:
        """The live accumulated gradients as flat 1-D buffers, one per dtype: every
        ``gradients()`` entry is a view into one of them. Changing them in place (an
        all-reduce across processes) changes what :meth:`optimizer_step` applies. A sparse
        table adds two views to its dtype's buffer, after the dense gradients: its dense
        gradient, then a per-row counter of lookups (> 0: the row is updated), so a sum
        then × 1/world over processes keeps both right."""
        return self._loop.accumulation.buffers

    @locked
    def gradient_views(self) -> list[tuple[str, np.ndarray]]:
        """(trainable, live accumulator) pairs: views into :meth:`gradient_buffers`, for
        collectives that treat trainables apart (a sharded optimizer reduces each gradient to
        the rank that owns its trainable). A sparse table has two, back to back: its dense
        gradient, then its per-row touched counter (see :meth:`gradient_buffers`)."""
        return self._loop.accumulation.views()

    @locked
    def gradient_tensors(self) -> list[Any]:
        """The live accumulated gradients as flat 1-D buffers, one per dtype, wherever they
        live: numpy arrays in host memory (:meth:`gradient_buffers`), onnxruntime OrtValues on a
        device. Both are DLPack exporters: ``torch.from_dlpack(b)`` (or cupy's, jax's) shares
        the memory, so a collective reduces them in place, without a copy (what
        :class:`~onnx_training_ops.distributed.DistributedTrainingSession` does). On a GPU,
        onnxruntime's runs have finished when they return; work queued on another stream must
        be synchronized before the next :meth:`optimizer_step`. :meth:`gradient_layout` says
        where each trainable's gradient lies."""
        return self._loop.accumulation.exported

    @locked
    def gradient_layout(self) -> list[tuple[str, int, int, tuple[int, ...]]]:
        """(trainable, index into :meth:`gradient_tensors`, element offset, shape) of each
        accumulated gradient, in :meth:`gradient_views`' order (a sparse table: its gradient,
        then its touched counter), in either memory; the same on every process that opens
        the same model."""
        return self._loop.accumulation.layout()

    @property
    def buffer_names(self) -> list[str]:
        """State the backward stage updates from the batch (BatchNorm running statistics), not
        the optimizer: per-process in data-parallel training, like torch's module buffers."""
        return self._loop.buffer_names()

    # ------------------------------------------------------------------ learning rates

    @property
    def learning_rates(self) -> dict[str, float]:
        """The learning rate of each input for the next optimizer step (schedule or default)."""
        return self._loop.rates.next()

    @property
    def lr_schedule(self):
        """The attached schedule (:mod:`onnx_training_ops.schedules`) or None."""
        return self._loop.rates.schedule

    @property
    def lr_schedule_step(self) -> int:
        """Optimizer steps taken under the schedule (torch's ``scheduler.last_epoch``)."""
        return self._loop.rates.step

    @locked
    def set_lr_schedule(self, schedule, step: int = 0) -> None:
        """Drive every learning-rate input by ``schedule``, saved in checkpoints with its position.

        Each input uses its own default as the base rate, as torch's ``base_lrs``. Schedules are
        not called directly: the session steps them once per optimizer step.

        Args:
            schedule (Schedule | None): one of :mod:`onnx_training_ops.schedules` (``WarmupCosineLR(...)``...), or
                None to detach the current one.
            step: the optimizer step the schedule starts from.

        Raises:
            TrainingOpError: not a schedule, or a negative ``step``.
        """
        self._loop.rates.attach(schedule, step)

    # ------------------------------------------------------------------ state

    @property
    def state_names(self) -> list[str]:
        """Names of the state variables (parameters, optimizer state, update count)."""
        return self._store.names

    @locked
    def state_dict(self) -> dict[str, np.ndarray]:
        """A copy of every state variable."""
        return self._store.copy()

    @locked
    def load_state_dict(self, state: Mapping[str, np.ndarray], strict: bool = True) -> None:
        """Copy values into the state variables (same dtype and shape required).

        Args:
            state: state variable name -> array.
            strict: the keys must be exactly the state variables; False: unknown keys still raise
                and missing ones keep their value.

        Raises:
            TrainingOpError: an unknown or (strict) missing name, or a dtype or shape that differs;
                nothing is changed then.
        """
        self._store.load(state, strict)

    @locked
    def state_views(self, names: Sequence[str]) -> list[np.ndarray]:
        """The live arrays of the state variables ``names``.

        Writing into them in place (an all-gather or broadcast across processes) changes the state
        the next run reads.

        Args:
            names: state variable names.

        Returns:
            One array per name, the session's own (no copy).

        Raises:
            TrainingOpError: an unknown name.
        """
        return self._store.views(names)

    @locked
    def state_tensors(self, names: Sequence[str]) -> list[Any]:
        """The live buffers of the state variables ``names``, wherever they live: the arrays of
        :meth:`state_views` in host memory, onnxruntime OrtValues on a device. Both are DLPack
        exporters (``torch.from_dlpack``): writing into them changes the state the next run
        reads. On a device whose step cannot write in place (``repr`` says "two sets") a step
        swaps each for its spare: take them again after each step.

        Raises:
            TrainingOpError: an unknown name.
        """
        return self._store.exported(names)

    @locked
    def initialize(self) -> None:
        """Reset every state variable to its initializer, then run the initialization graphs
        (accumulated gradients are dropped)."""
        self._loop.accumulation.zero()
        providers = self._config.providers
        self._store.reset(lambda init: InferenceSession(init, providers=providers))

    @locked
    def parameters_size(self, trainable_only: bool = True) -> int:
        """How many elements :meth:`get_flat_parameters` holds (``get_parameters_size``).

        Args:
            trainable_only: count only the trained parameters.

        Returns:
            The number of elements.
        """
        return int(sum(a.size for a in self._store.parameters(trainable_only).values()))

    @locked
    def get_flat_parameters(self, trainable_only: bool = True, copy: bool = True) -> np.ndarray:
        """The parameters raveled into one 1-D vector (onnxruntime-training's ``get_contiguous_parameters``).

        Args:
            trainable_only: only the trained parameters; False adds the frozen ones.
            copy: False returns the live buffer the trainables already are views of (writing into
                it changes the parameters).

        Returns:
            The vector, in the session's parameter order.

        Raises:
            TrainingOpError: ``copy=False`` when the parameters are not one buffer (several
                optimizer nodes laid them out apart, or ``trainable_only=False`` with frozen
                parameters, which are constants of the model).
        """
        return self._store.flat_parameters(trainable_only, copy)

    @locked
    def load_flat_parameters(self, buffer, trainable_only: bool = True) -> None:
        """Copy ``buffer`` into the parameters (onnxruntime-training's ``copy_buffer_to_parameters``).

        Trainables are written in place; frozen ones, when their values change, by reopening the
        onnxruntime sessions. A nominal session is complete once every parameter has been loaded.

        Args:
            buffer (np.ndarray): a vector in :meth:`get_flat_parameters`'s order, dtype and size.
            trainable_only: the vector holds only the trained parameters.

        Raises:
            TrainingOpError: a buffer of another dtype or size.
        """
        changed = self._store.load_flat_parameters(buffer, trainable_only)
        if changed:
            self._reopen_with_constants(changed)

    def _reopen_with_constants(self, values: dict[str, np.ndarray]) -> None:
        """Reopen every part on the current training model with new constant values (the
        parameters still waiting for values and the skipped-step count carry over)."""
        model = self._files.snapshot()
        for tensor in model.model_proto.graph.initializer:
            if tensor.name in values:
                model.set_value(tensor, values[tensor.name])
        unfilled, skipped = set(self._store.unfilled), self._loop.skipped_steps
        self._store, self._programs, self._loop, self._files = open_parts(model, self._config)
        self._store.unfilled, self._loop.skipped_steps = unfilled, skipped

    @property
    def nominal(self) -> bool:
        """True while parameters of a nominal checkpoint still wait for their values."""
        return bool(self._store.unfilled)

    # ------------------------------------------------------------------ checkpoints and exports

    @property
    def properties(self) -> dict[str, Any]:
        """User values (str, int, float, bool) saved atomically with each checkpoint and
        restored with it: epoch, best metric, data position (onnxruntime-training's
        ``CheckpointState`` properties)."""
        return self._files.properties

    @locked
    def training_model(self) -> onnx.ModelProto | LargeModel:
        """The training model with the current state as initializers, the properties and the
        schedule's position (what :meth:`save` writes). A large model comes back as a
        LargeModel whose arrays are copies of the state."""
        return self._files.training_model()

    def checkpoint_metadata(self) -> dict[str, str]:
        """The metadata entries a checkpoint of this session carries (properties, schedule)."""
        return self._files.checkpoint_metadata()

    @locked
    def save(self, path: str | os.PathLike, nominal: bool = False) -> str:
        """Write the training model with the current state, atomically; reloading resumes bit-exact.

        Args:
            path: the checkpoint file (``.onnx``; a large model also writes one data file beside it).
            nominal: names, dtypes and shapes only (onnxruntime-training's nominal checkpoint): the
                graphs without the values of the state and the parameters, for a device that opens
                it and loads the parameters it receives (:meth:`load_flat_parameters`).

        Returns:
            The path written.

        Raises:
            TrainingOpError: the file cannot be written (``FileWriteError``, naming the path); the
                previous file at ``path`` is left whole.
        """
        return self._files.save(path, nominal)

    @locked
    def export_inference_model(self, path: str | os.PathLike | None = None,
                               outputs: Sequence[str] | None = None) -> onnx.ModelProto | LargeModel:
        """The main graph with the trained weights and no ``training_info``.

        Args:
            path: where to write it, atomically (a large model with its weights in external
                data); None: only return it.
            outputs: the values it computes (any of the main graph; default its outputs), without
                what they do not need (onnxruntime-training's ``export_model_for_inferencing``).

        Returns:
            The inference model; a large model comes back as a LargeModel, memory-mapped from
            ``path`` when given, else over copies of the weights.

        Raises:
            TrainingOpError: an unknown output name, or a file that cannot be written.
        """
        return self._files.export_inference_model(path, outputs)

    @locked
    def save_adapter(self, path: str | os.PathLike, format: str = "peft",  # noqa: A002 - peft's word
                     base_model: str | os.PathLike | None = None) -> str:
        """Write the LoRA adapters (of a model from :func:`~onnx_training_ops.add_lora`) where they are used.

        Args:
            path: ``format="peft"``: a folder (``adapter_model.safetensors``,
                ``adapter_config.json``) that ``peft.PeftModel.from_pretrained`` loads onto the
                Hugging Face model; ``"onnxruntime"``: an ``.onnx_adapter`` file
                (``onnxruntime.AdapterFormat``) that onnxruntime-genai's multi-LoRA serves.
            format: ``"peft"`` or ``"onnxruntime"``.
            base_model: with ``"onnxruntime"``, a folder to write the base model that serves the
                adapter too: the model add_lora was given with the adapters' weights as inputs
                (and, for onnxruntime-genai's folder, its config and tokenizer files); once for
                all adapters of the same targets. See :mod:`onnx_training_ops.lora.formats`.

        Returns:
            The path written.

        Raises:
            TrainingOpError: a model without adapters, an unknown format, or a path that
                cannot be written.
        """
        spec = self._lora_spec()
        values = dict(zip(spec.trainable, self.state_views(spec.trainable)))
        return lora_formats.save_adapter(spec, values, path, format, base_model)

    @locked
    def load_adapter(self, path: str | os.PathLike) -> None:
        """Load LoRA adapters saved by :meth:`save_adapter` (or trained by peft for the same
        base and targets) into this session's adapters; the optimizer state is kept.

        Raises:
            TrainingOpError: a model without adapters, or an adapter made for another base
                model, other targets or another rank (naming what differs); nothing changes then.
        """
        self.load_state_dict(lora_formats.read_adapter(self._lora_spec(), path), strict=False)

    def _lora_spec(self) -> LoraSpec:
        text = self._programs.meta.lora
        if text is None:
            raise TrainingOpError("the model has no LoRA adapters: make it with onnx_training_ops.add_lora "
                                  "before build_training_model")
        return LoraSpec.from_json(text)

    @locked
    def end_profiling(self) -> list[str]:
        """With ``sess_options.enable_profiling``: end profiling in every onnxruntime session
        this session opened (step programs, stages, evaluation, inference) and return the
        trace files onnxruntime wrote."""
        sessions = self._programs.sessions() + self._loop.sessions()
        return [path for path in (s.end_profiling() for s in sessions) if path]

    # ------------------------------------------------------------------ introspection

    @property
    def feed_names(self) -> list[str]:
        """Inputs ``step`` needs (learning-rate inputs are optional: ``lr=`` or their default)."""
        return list(self._programs.required)

    @property
    def optional_feed_names(self) -> list[str]:
        """Inputs ``step`` takes but does not need: learning rates and inputs with a default value."""
        return sorted(self._programs.optional)

    @property
    def learning_rate_names(self) -> list[str]:
        """The learning-rate inputs (one per parameter group), which ``lr=`` and schedules set."""
        return list(self._loop.rates.names)

    @property
    def feeds(self) -> list[Feed]:
        """What :meth:`step` takes: name, dtype, shape and whether it is optional, like
        ``InferenceSession.get_inputs()``."""
        return self._programs.feeds()

    @property
    def fast_path_nodes(self) -> list[str]:
        """Labels of the optimizer nodes the fast path applies in place."""
        return [node_label(n) for n in self._programs.fast_path_nodes()]

    @property
    def providers(self) -> list[str]:
        """The execution providers this session trains on (names, in onnxruntime's order)."""
        return [p[0] if isinstance(p, tuple) else p for p in self._config.providers]

    @property
    def device(self) -> str | None:
        """The device of a session whose update runs in the graph (``device=`` or a device
        provider): ``"cuda"``, ``"cpu"``...; None for the host session (host arrays, the update
        by the fused or the native kernels). ``repr`` names both strategies."""
        return self._config.device

    @property
    def cuda_graph(self) -> bool:
        """Whether the step replays a CUDA graph (see ``cuda_graph=``); ``repr`` says why not on a CUDA device."""
        return self._programs.graph_capture()

    @property
    def metadata(self) -> dict[str, str]:
        """The builder's metadata (optimizer, loss, labels, learning_rate, trainable), if any."""
        return self._programs.meta.to_props()

    def summary(self) -> ModelSummary:
        """Trainable and frozen tensors, optimizer and its state size, loss, gradient ops.

        Returns:
            A :class:`~onnx_training_ops.training.summary.ModelSummary` over the session's
            live state (``print`` it for a table).
        """
        return summary(self._store.model, self._store.described())

    def __repr__(self) -> str:  # cheap: no shape inference (summary() walks the graph)
        engine = describe_strategies(self._config, self._programs.in_place(), self._programs.graph_capture(),
                                     self._programs.capture_note())
        return describe(self._store.described(), self._programs.meta, self.learning_rates, self.lr_schedule_step,
                        self.providers, engine)

    @locked
    def to_torch_state_dict(self, mapping: Mapping[str, dict] | None = None, tensors: bool = True) -> dict[str, Any]:
        """The current weights under torch's names, for ``module.load_state_dict``.

        Args:
            mapping: ``{initializer: {"torch": [names], "transpose": bool}}``; default: the
                mapping :func:`~onnx_training_ops.training.state.torch_names.record_torch_names`
                recorded in the model, else the initializers' own names (exports with
                ``dynamo=True, optimize=False`` name them as torch does), exporter-made
                names (``onnx::MatMul_3``, ``val_4``) left out.
            tensors: return ``torch.Tensor`` values (needs torch); False: numpy arrays.

        Returns:
            ``{torch name: tensor}`` holding copies of the weights (frozen ones too).

        Raises:
            TrainingOpError: the mapping names an initializer the model lacks, or torch is
                missing with ``tensors=True``.
        """
        return torch_state_dict(self._store.model, self._store.arrays, mapping, tensors)
