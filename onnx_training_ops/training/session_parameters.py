"""Part of :class:`~onnx_training_ops.TrainingSession`: the parameters as one flat vector, and
nominal sessions (opened from ``save(path, nominal=True)``) waiting for their values.

onnxruntime-training's ``Module.get_contiguous_parameters``, ``get_parameters_size`` and
``copy_buffer_to_parameters`` (:mod:`.flat_parameters` says the order). Trainable parameters
are state variables; the others (frozen: constants of the model) live in the onnxruntime
graphs, so loading new values into them reopens the session's onnxruntime sessions (once, e.g.
to fill a nominal model; accumulated gradients are dropped then).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from ..errors import TrainingOpError
from ..storage import checkpoint
from ..storage.large_model import LargeModel
from ..storage.tensors import add_array, location, proto_of
from .flat_parameters import contiguous, flat_copy, parameter_names, split_into
from .locked import locked


class FlatParameters:
    """A mixin of TrainingSession (``self._model``, ``self._state``, ``self._meta``)."""

    def _trainable_names(self) -> list[str]:
        """The trainables in the builder's order; for a hand-written model, the state
        variables that are initializers of the main graph."""
        listed = [n for n in self._meta.get("trainable", "").split(",") if n]
        if listed:
            return listed
        main = {t.name for t in self._model.model_proto.graph.initializer}
        return [n for n in self._state if n in main]

    def _parameters(self, trainable_only: bool) -> dict[str, np.ndarray]:
        """name -> live state array (trainables) or the model's value (frozen), in flat order."""
        names = parameter_names(self._model.model_proto, self._trainable_names(), trainable_only)
        constants = {t.name: t for t in self._model.model_proto.graph.initializer}
        return {n: self._state[n] if n in self._state else self._model.array(constants[n]) for n in names}

    @locked
    def parameters_size(self, trainable_only: bool = True) -> int:
        """How many elements :meth:`get_flat_parameters` holds (``get_parameters_size``).

        Args:
            trainable_only: count only the trained parameters.

        Returns:
            The number of elements.
        """
        return int(sum(a.size for a in self._parameters(trainable_only).values()))

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
        params = self._parameters(trainable_only)
        if not copy:
            names = list(params)
            live = all(n in self._state for n in names)
            buffer = contiguous([params[n] for n in names]) if live else None
            if buffer is None:
                reason = ("the frozen parameters are constants of the model, not state" if not live else
                          "they are laid out per optimizer node (parameter groups), not as one buffer")
                raise TrainingOpError(f"get_flat_parameters(copy=False): the parameters are not one live "
                                      f"buffer: {reason}; use copy=True")
            return buffer
        return flat_copy(list(params.values()), list(params), "get_flat_parameters")

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
        params = self._parameters(trainable_only)
        values = split_into(buffer, params, "load_flat_parameters")
        frozen = {n: v for n, v in values.items() if n not in self._state}
        for name, value in values.items():
            if name in self._state:
                np.copyto(self._state[name], value)
        changed = {n: v for n, v in frozen.items() if not np.array_equal(v, params[n])}
        if changed:
            self._reopen_with_constants(changed)
        self._unfilled.difference_update(values)

    def _reopen_with_constants(self, values: dict[str, np.ndarray]) -> None:
        """Rebuild this session on its current training model with new constant values."""
        model = self.training_model()
        for tensor in proto_of(model).graph.initializer:
            if tensor.name in values:
                if isinstance(model, LargeModel) and location(tensor) is not None:
                    add_array(model, tensor, np.array(values[tensor.name], copy=True))
                else:
                    checkpoint.set_initializer(tensor, values[tensor.name])
        unfilled, skipped, lock = set(self._unfilled), self.skipped_steps, self._lock
        fresh = self.with_model(model if isinstance(model, LargeModel) else checkpoint.add_checksums(model))
        self.__dict__.update(fresh.__dict__)
        self._lock, self.skipped_steps, self._unfilled = lock, skipped, unfilled

    def _check_filled(self, what: str) -> None:
        """Refuse ``what`` while a nominal session's parameters have no values yet."""
        if self._unfilled:
            missing = sorted(self._unfilled)
            raise TrainingOpError(
                f"{what}: this session was opened from a nominal checkpoint and {len(missing)} parameter(s) "
                f"have no values yet ({', '.join(missing[:3])}{', ...' if len(missing) > 3 else ''}): "
                "load them first with load_flat_parameters(buffer, trainable_only=False)")

    @property
    def nominal(self) -> bool:
        """True while parameters of a nominal checkpoint still wait for their values."""
        return bool(self._unfilled)

    def _mark_loaded(self, names: Sequence[str]) -> None:
        """``names`` now hold loaded values (:meth:`load_state_dict` of trainables)."""
        self._unfilled.difference_update(names)
