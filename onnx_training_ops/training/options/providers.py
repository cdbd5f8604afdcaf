"""Where a TrainingSession trains: its execution providers and the device its state lives on.

onnxruntime quietly trains on the CPU when a requested provider is not in the installed
build (it logs a warning and drops it): :func:`placement` refuses that up front. And a
session whose state is bound from host arrays reads a device copy made once, at bind time,
for any input a device node reads (onnxruntime's ``IOBinding::BindInput``): from step 2 on it
would train on stale parameters. So a session with a device provider keeps its state on the
device as OrtValues (:mod:`..engine.memory`), its update in the graph (:mod:`..engine.graph`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import onnxruntime as ort

from ...errors import TrainingOpError
from ..graphs.static_shapes import checked_input_shapes

CPU = "CPUExecutionProvider"


def provider_name(provider: str | tuple[str, dict]) -> str:
    """The name of a provider given as ``"Name"`` or ``("Name", {options})``."""
    if isinstance(provider, tuple):
        entry: tuple = provider  # from the caller: checked, whatever its annotation says
        if not entry or not isinstance(entry[0], str):
            raise TrainingOpError(f"providers: expected a name or (name, options), found {provider!r}")
        return provider[0]
    if not isinstance(provider, str):
        raise TrainingOpError(f"providers: expected a name or (name, options), found {provider!r}")
    return provider


def require_available(providers: Sequence[str | tuple[str, dict]], available: Sequence[str] | None = None) -> None:
    """Raise :class:`TrainingOpError` unless every provider is in this onnxruntime build
    (onnxruntime itself drops a missing one with a logged warning and runs on the CPU)."""
    names = [provider_name(p) for p in providers]
    available = list(ort.get_available_providers() if available is None else available)
    missing = [n for n in names if n not in available]
    if missing:
        hint = " (install onnxruntime-gpu instead of onnxruntime)" if any("CUDA" in n or "Tensorrt" in n
                                                                          for n in missing) else ""
        raise TrainingOpError(
            f"providers: {', '.join(map(repr, missing))} not available in this onnxruntime build "
            f"{ort.__version__}{hint}; available: {', '.join(available)}. onnxruntime would train on "
            "the CPU without a word: ask for what is installed"
        )


# execution provider -> the OrtValue device type its inputs live on (others read host memory)
DEVICE_OF = {"CUDAExecutionProvider": "cuda", "TensorrtExecutionProvider": "cuda",
             "ROCMExecutionProvider": "cuda", "DmlExecutionProvider": "dml"}
# TrainingSession(device=...) -> the providers it means when none are given
_PROVIDERS_OF = {"cuda": "CUDAExecutionProvider", "dml": "DmlExecutionProvider"}


@dataclass(frozen=True)
class Placement:
    """Where a session trains: its providers and, for a device-resident state, the device."""

    providers: list
    device: str | None = None  # None: host arrays (the CPU session); else the OrtValues' device
    device_id: int = 0


def device_for(providers: Sequence[str | tuple[str, dict]]) -> tuple[str, int]:
    """The OrtValue device (and index) of the first provider with device memory, else the CPU."""
    for provider in providers:
        device = DEVICE_OF.get(provider_name(provider))
        if device is not None:
            options: object = provider[1] if isinstance(provider, tuple) and len(provider) > 1 else {}
            return device, int(options.get("device_id", 0)) if isinstance(options, dict) else 0
    return "cpu", 0


def device_providers(device: str, device_id: int = 0) -> list:
    """The providers that run a graph on ``device`` (its provider, then the CPU's)."""
    if device == "cpu":
        return [CPU]
    options = {"device_id": device_id} if device == "cuda" else {}
    return [(_PROVIDERS_OF[device], options), CPU]


def _parse_device(device: str) -> tuple[str, int]:
    if not isinstance(device, str):
        raise TrainingOpError(f"device must be a string such as 'cuda', 'cuda:1' or 'cpu', found {device!r}")
    kind, _, index = device.partition(":")
    if kind not in ("cpu", *_PROVIDERS_OF) or (index and not index.isdigit()) or (kind == "cpu" and index):
        raise TrainingOpError(f"device must be 'cpu', 'cuda', 'cuda:N' or 'dml', found {device!r}")
    return kind, int(index or 0)


def placement(providers: Sequence[str | tuple[str, dict]] | None, device: str | None = None,
              available: Sequence[str] | None = None) -> Placement:
    """Where a session trains, checked before anything is loaded.

    Args:
        providers: onnxruntime providers (None: the CPU's, or the device's given by ``device``).
        device: ``"cuda"``, ``"cuda:N"``, ``"dml"``: the state resident on that device (the
            providers default to its provider then the CPU's); ``"cpu"``: the device-resident
            engine on the CPU (OrtValues, the same graphs as on a GPU); None: the state on the
            device of the first device provider listed, else host arrays.
        available: the providers of this onnxruntime build (default: asked).

    Returns:
        The :class:`Placement`.

    Raises:
        TrainingOpError: a provider missing from this onnxruntime build (onnxruntime would train
            on the CPU without a word), an unknown device, or providers that do not run on it.
    """
    wanted = _parse_device(device) if device is not None else None
    if providers is None:
        listed: list = device_providers(*wanted) if wanted is not None else [CPU]
    else:
        listed = [providers] if isinstance(providers, (str, tuple)) else list(providers)
        if not listed:
            raise TrainingOpError(f"providers: empty list; leave it out (or pass [{CPU!r}]) to train on the CPU")
    require_available(listed, available)
    names = [provider_name(p) for p in listed]
    found = device_for(listed)
    if wanted is not None:
        if wanted[0] != "cpu" and found[0] != wanted[0]:
            raise TrainingOpError(f"device={device!r} but the providers {names} have none for it; "
                                  f"add {_PROVIDERS_OF[wanted[0]]!r}")
        return Placement(listed, wanted[0], wanted[1])
    if all(n == CPU for n in names):
        return Placement(listed)
    return Placement(listed, *found)


def device_inputs(shapes: Mapping[str, Sequence[int]] | None, device: str | None) -> dict[str, list[int]] | None:
    """``input_shapes`` checked (name -> dims of whole numbers > 0), for a device-resident session only."""
    if shapes is None:
        return None
    if device is None:
        raise TrainingOpError("input_shapes applies to a device-resident session: pass device='cuda' "
                              "(or device='cpu')")
    return checked_input_shapes(shapes, "input_shapes")
