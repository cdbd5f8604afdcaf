"""One training step of a program: bind the feeds, run onnxruntime, check the loss, write the state.

**Non-finite loss**: after onnxruntime ran and *before* any state is written, the loss
outputs (the builder's ``loss``; for other models every returned float output of one
element) are checked. ``on_nonfinite="raise"`` raises :class:`NonFiniteLossError` and
leaves every state variable (parameters, V, H, T) as it was before the step; ``"skip"``
does the same without raising (the step is dropped, the returned dict has the loss);
``"ignore"`` trains through.

With ``fast=False`` the native optimizer kernels write the new state during the
onnxruntime run (:mod:`..fastpath.in_place`). Under ``"raise"`` and ``"skip"`` a guard in the graph
stops the run before the first optimizer node when a loss is not finite; the step is then
run again by a copying twin of the program (opened on first need), whose loss check
raises or skips as above. (A graph with random ops may draw a finite loss the second time:
that step is applied.) Ctrl-C is held for the whole in-place run, and an onnxruntime error
after an optimizer node ran leaves that node's update applied.

**Ctrl-C** (:mod:`...interrupts`): one that arrives before the state is written cancels the
step (KeyboardInterrupt, state as before); one that lands while it is written is raised when
the write ends: the step counts (T says so), and the state is never partial.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from ...errors import TrainingOpError
from ...interrupts import held_interrupts
from ..fastpath.in_place import GUARD_FAILURE
from ..fastpath.sources import FromFeed, FromOutput, FromState
from ..inputs.feeds import checked_learning_rate, feed_array
from .binding import finish_binding, release_prebound
from .program import Program

NONFINITE_POLICIES = ("raise", "skip", "ignore")


class NonFiniteLossError(TrainingOpError):
    """The loss of a step was NaN or infinite; the step was not applied (state unchanged)."""



def run_program(
    program: Program,
    feeds: Mapping[str, Any],
    lr: float | Mapping[str, float] | None,
    state: dict[str, np.ndarray],
    on_nonfinite: str,
    then: Callable[[bool], None] | None = None,
) -> tuple[dict[str, np.ndarray], bool]:
    """Run one program's step; returns its outputs not bound to state, and whether the step was skipped.

    ``then(skipped)`` runs inside the same Ctrl-C-held section as the state write, right after
    it: the caller's bookkeeping of the step (counters, schedule position, zeroed gradients)
    lands with the state, or neither does."""
    io = program.io
    raw = io._iobinding
    bound = bind_feeds(program, feeds)  # onnxruntime reads these arrays: keep them until it has run
    set_learning_rates(program, feeds, lr)
    for name in program.analysis.dynamic_outputs:  # unallocated again: their shape changes from step to step
        io.bind_output(name, "cpu")
    for name, _ in program.returned_from_ort:  # likewise (logits: batch by batch); else onnxruntime
        io.bind_output(name, "cpu")            # reuses the last run's array and refuses another shape
    if program.in_place:  # the run itself writes state: it and the commit are one write
        with held_interrupts():
            if _run(program):
                return _committed(_commit(program, raw, feeds, state, on_nonfinite), then)
        # the guard stopped the run before any optimizer: redo the step the copying way,
        # which checks the loss (raise, skip) as usual
        if program.fallback is None:
            raise NonFiniteLossError(f"{program.where}: a loss of training_info[{program.index}] is not finite; "
                                     "the step was not applied, the state is unchanged")
        if callable(program.fallback):
            program.fallback = program.fallback()
        return run_program(program.fallback, feeds, lr, state, on_nonfinite, then)
    _run(program)
    del bound
    with held_interrupts():  # from here on the state is written: all of it, or none
        return _committed(_commit(program, raw, feeds, state, on_nonfinite), then)


def _committed(outcome: tuple[dict[str, np.ndarray], bool], then) -> tuple[dict[str, np.ndarray], bool]:
    if then is not None:
        then(outcome[1])
    return outcome


def _run(program: Program) -> bool:
    """Run onnxruntime; False if the non-finite guard stopped the run (:mod:`..fastpath.in_place`)."""
    try:
        if program.run is None:
            program.session._sess.run_with_iobinding(program.io._iobinding, None)
        else:
            program.run(program.io)
    except TrainingOpError:
        raise
    except Exception as error:  # onnxruntime's own errors: name what failed
        if program.guarded and GUARD_FAILURE in str(error):
            return False
        if program.prebound and program.copy_plan is None:  # a gradient not shaped like X
            release_prebound(program)
            return _run(program)
        raise TrainingOpError(f"{program.where}: onnxruntime failed on training_info[{program.index}]: "
                              f"{error}") from error
    return True


def _commit(program: Program, raw, feeds: Mapping[str, Any], state: dict[str, np.ndarray],
            on_nonfinite: str) -> tuple[dict[str, np.ndarray], bool]:
    if program.copy_plan is None:
        finish_binding(program, state)
    assert program.copy_plan is not None  # finish_binding planned it
    result = {}
    if program.returned_from_ort:
        outputs = raw.get_outputs()
        for name, i in program.returned_from_ort:
            result[name] = outputs[i].numpy()
    for name, buf in program.returned_buffers:
        result[name] = buf.copy()
    if on_nonfinite != "ignore":
        for name in program.analysis.loss_names:
            value = result[name]
            if not (math.isfinite(value.item()) if value.size == 1 else np.all(np.isfinite(value))):
                if on_nonfinite == "raise":
                    raise NonFiniteLossError(
                        f"{program.where}: loss {name!r} is {value.reshape(-1)[0] if value.size else value} "
                        f"(training_info[{program.index}]); the step was not applied, the state is unchanged"
                    )
                return result, True
    if program.needs_feeds:
        defaults = {spec.name: default for spec, default in program.optional_feeds}
        feeds = {**defaults, **feeds}

    if program.updates:
        def values(sources):
            return _cut_values(program, sources, raw, feeds, state)

        for update in program.updates:
            update.apply(values, feeds)
    for array, buf in program.copy_plan:
        np.copyto(array, buf)
    return result, False


def _cut_values(program: Program, sources, raw, feeds: Mapping[str, Any], state) -> dict[str, Any]:
    """What cut row/RMSProp updates read (``sources``, as :func:`..fastpath.fast_path.cut_sources` gives
    them): outputs of this run, state, learning rates, constants, feeds."""
    analysis = program.analysis
    dynamic = {}
    if analysis.dynamic_outputs:
        outputs = raw.get_outputs()
        first = len(analysis.returned) + len(analysis.fixed_outputs)
        dynamic = {name: outputs[first + i].numpy() for i, name in enumerate(analysis.dynamic_outputs)}
    values = {}
    for name, src in sources.items():
        if isinstance(src, FromOutput):
            values[name] = dynamic[name] if name in dynamic else program.fixed_buffers[name]
        elif isinstance(src, FromState):
            values[name] = state[src.name]
        elif not isinstance(src, FromFeed):  # a fixed array
            values[name] = src
        else:
            values[name] = feeds.get(name, dict((s.name, d) for s, d in program.optional_feeds).get(name))
    return values


def bind_feeds(program: Program, feeds: Mapping[str, Any]) -> list[np.ndarray]:
    """Bind the program's inputs to ``feeds`` (optional ones to their default if not fed).

    onnxruntime reads a bound array in place, so a feed that is the very array bound last
    step (same object, shape and dtype) is not checked and bound again: its current contents
    are what the run reads. Returns the bound arrays: the caller keeps them alive until
    onnxruntime has run.
    """
    raw = program.io._iobinding
    bound = program.bound_feeds
    arrays = []
    for spec in program.feeds:
        value = feeds[spec.name]
        last = bound.get(spec.name)
        if last is not None and value is last[0] and value.shape == last[1] and value.dtype == last[2]:
            arrays.append(value)
            continue
        array = feed_array(spec, value, program.where)
        arrays.append(array)
        raw.bind_input(spec.name, array)
        bound[spec.name] = (array, array.shape, array.dtype) if array is value else None
    for spec, default in program.optional_feeds:
        value = feeds.get(spec.name)
        array = default if value is None else feed_array(spec, value, program.where)
        arrays.append(array)
        raw.bind_input(spec.name, array)
    return arrays


def set_learning_rates(program: Program, feeds: Mapping[str, Any],
                       lr: float | Mapping[str, float] | None) -> None:
    """Write each learning-rate input's buffer: the fed value, else ``lr`` (one value for
    all, or per input name), else the model's default."""
    for name, buf in program.rate_inputs.items():
        given = lr.get(name) if type(lr) is dict else lr
        if name in feeds:
            value = np.asarray(feeds[name])
            if value.size != 1:
                raise TrainingOpError(f"step: learning rate {name!r} must be a scalar, found shape {list(value.shape)}")
            buf[...] = checked_learning_rate(value.reshape(()), f"step: learning rate feed {name!r}")
        elif given is not None:
            buf[...] = given
        elif program.analysis.rate_defaults[name] is not None:
            buf[...] = program.analysis.rate_defaults[name]
        else:
            raise TrainingOpError(f"step: learning rate {name!r} has no default; pass lr=... or feed it")
