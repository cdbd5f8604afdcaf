"""Part of :class:`~onnx_training_ops.TrainingSession`: what a step takes (names, dtypes,
shapes, the checks before onnxruntime runs) and :meth:`run` of the main (inference) graph
with the current state, like ``InferenceSession.run``.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from ..errors import TrainingOpError
from ..storage.tensors import proto_of
from .feeds import Feed, check_feed_names, feed_array, feed_list, feed_spec
from .inference import inference_session
from .locked import locked
from .program import program_feeds


class FeedsAndRun:
    """A mixin of TrainingSession (``self._programs``, ``self._rates``, ``self._state``, the
    feed sets and batch checks it sets up)."""

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
        """The learning-rate inputs (one per parameter group), which ``lr=`` and schedules set."""
        return list(self._rates.names)

    @property
    def feeds(self) -> list[Feed]:
        """What :meth:`step` takes: name, dtype, shape and whether it is optional, like
        ``InferenceSession.get_inputs()``."""
        required, optional = [], []
        for program in self._programs:
            r, o = program_feeds(program)
            required += r
            optional += o
        return feed_list(required, optional)

    def _check_feeds(self, feeds: Mapping[str, Any], required: set[str], optional: set[str],
                     where: str = "step") -> None:
        if type(feeds) is not dict and not isinstance(feeds, Mapping):
            raise TrainingOpError(f"{where}: feeds must be a mapping of input name to array, found "
                                  f"{type(feeds).__name__}; inputs: {sorted(required)}")
        check_feed_names(feeds, required, optional, where)
        check = self._batch_checks[where]
        if check is not None:
            check(feeds)
        check = self._input_checks[where]
        if check is not None:
            check(feeds)

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
        self._check_filled("run")
        if self._inference is None:
            self._inference = inference_session(self._model, self._state, self._session_options(), self._providers)
        session, state_inputs = self._inference
        if self._run_specs is None:
            self._run_specs = {vi.name: feed_spec(vi) for vi in proto_of(self._model).graph.input}
        if not isinstance(feeds, Mapping):
            raise TrainingOpError(f"run: feeds must be a mapping of input name to array, found {type(feeds).__name__}")
        full = {name: feed_array(self._run_specs[name], value, "run") if name in self._run_specs else value
                for name, value in feeds.items()}  # a wrong dtype or shape: one line, as in step
        if self._input_checks["run"] is not None:
            self._input_checks["run"](full)
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
