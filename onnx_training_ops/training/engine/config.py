"""The caller's runtime choices, and the two strategies they select (checked before anything opens).

* **memory** (:mod:`.memory`): host arrays on the CPU (the default session, ``device="cpu"``),
  device OrtValues on a device (``device="cuda"`` or a device provider);
* **update** (:mod:`.protocols`): ``"fused"`` (the fused kernels, the host session's default),
  ``"native"`` (``fast=False``: the native optimizer kernels in the graph) or ``"graph"`` (lowered
  to standard ops in the graph: every ``device=`` session).

A flag that cannot apply to the strategies chosen is refused with what applies.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import onnxruntime as ort

from ...errors import TrainingOpError

MEMORIES = ("host", "device")


@dataclass(frozen=True)
class RuntimeConfig:
    """How a session runs its programs: what the caller chose when opening it."""

    providers: Sequence[Any]
    fast: bool
    on_nonfinite: str
    sess_options: ort.SessionOptions | None = None
    session_config: Mapping[str, str] = field(default_factory=dict)
    threads: int | None = None  # as given (None: the package's default for the model's size)
    device: str | None = None  # the state's device (the in-graph engine), None: host arrays, fused kernels
    device_id: int = 0
    input_shapes: Mapping[str, Sequence[int]] | None = None  # the step's data inputs fixed (device)
    cuda_graph: bool | None = None  # None: CUDA graphs when safe
    in_place: bool | None = None  # in-graph update: None in place when safe, False two sets, True required
    memory: str | None = None  # None: host arrays on the CPU, device OrtValues on a device; "device" on the CPU too
    # the execution provider the in-graph programs are built for and checked against (None: the
    # device's); CUDAExecutionProvider with device="cpu" runs a GPU's very graphs on the CPU
    graphs_for: str | None = None

    @property
    def update(self) -> str:
        """Where the update runs: ``"fused"``, ``"native"`` or ``"graph"``."""
        if self.device is not None:
            return "graph"
        return "fused" if self.fast else "native"

    @property
    def host_memory(self) -> bool:
        """Whether the state lives in host arrays (the session's own numpy arrays)."""
        if self.memory is not None:
            return self.memory == "host"
        return self.device in (None, "cpu")


def checked_config(providers: Sequence[Any], fast: bool | None, on_nonfinite: str,
                   sess_options: ort.SessionOptions | None, session_config: Mapping[str, str] | None,
                   threads: int | None, device: str | None, device_id: int,
                   input_shapes: Mapping[str, Sequence[int]] | None, cuda_graph: bool | None,
                   in_place: bool | None = None, memory: str | None = None) -> RuntimeConfig:
    """The :class:`RuntimeConfig` of a session, its flags checked against the strategies they select.

    Raises:
        TrainingOpError: ``fast=True`` with a ``device`` (the update runs in the graph there),
            ``cuda_graph=True`` or ``in_place`` without a ``device``, a ``cuda_graph`` or
            ``in_place`` that is not a bool or None.
    """
    for name, value in (("fast", fast), ("cuda_graph", cuda_graph), ("in_place", in_place)):
        if value is not None and not isinstance(value, bool):
            raise TrainingOpError(f"{name} must be True, False or None, found {value!r}")
    if memory is not None and memory not in MEMORIES:
        raise TrainingOpError(f"memory must be one of {MEMORIES}, found {memory!r}")
    if device is not None and fast:
        raise TrainingOpError(
            f"fast=True applies the fused kernels to host arrays, but with device={device!r} the update runs in the "
            "graph (lowered to standard ops on the device): leave fast out (or pass fast=False), or drop device= "
            "for the fused kernels on the CPU")
    if device is None and cuda_graph:
        raise TrainingOpError(
            "cuda_graph=True needs the state on a CUDA device: pass device='cuda' (or a CUDAExecutionProvider) with "
            "static step inputs (input_shapes=...); this session trains host arrays on the CPU")
    if device is None and in_place is not None:
        raise TrainingOpError("in_place applies to the in-graph update of a device= session: the fused kernels "
                              "always write the host arrays in place")
    return RuntimeConfig(providers, device is None and fast is not False, on_nonfinite, sess_options,
                         {str(k): str(v) for k, v in (session_config or {}).items()}, threads, device, device_id,
                         input_shapes, cuda_graph, in_place, memory)


def describe_strategies(config: RuntimeConfig, in_place: bool | None, graph_capture: bool,
                        no_capture: str | None = None) -> str:
    """The strategies in words, for ``repr``: where the state lives and where the update runs;
    ``no_capture``: why a CUDA device's step replays no CUDA graph."""
    if config.device is None:
        return "host arrays, " + ("fused kernels" if config.fast else "native kernels in the graph")
    memory = "host arrays" if config.host_memory else "device memory"
    where = "in the graph" + ("" if in_place is None else ", in place" if in_place else ", two sets")
    capture = ", CUDA graph" if graph_capture else f", no CUDA graph ({no_capture})" if no_capture else ""
    return f"state on {config.device!r} ({memory}), update {where}{capture}"


__all__ = ["MEMORIES", "RuntimeConfig", "checked_config", "describe_strategies"]
