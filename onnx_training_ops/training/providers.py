"""Which onnxruntime execution providers a TrainingSession may run on, checked up front.

onnxruntime quietly trains on the CPU when a requested provider is not in the installed
build (it logs a warning and drops it), and a session whose state is bound from host arrays
reads a device copy made once, at bind time, for any input a device node reads (onnxruntime's
``IOBinding::BindInput``): from step 2 on it would train on stale parameters. Until the
state lives on the device for the session's life, a TrainingSession runs on the CPU only and
says so, instead of returning a silently wrong result.
"""

from __future__ import annotations

from collections.abc import Sequence

import onnxruntime as ort

from ..errors import TrainingOpError

CPU = "CPUExecutionProvider"

_GPU_HINT = (
    "To train on a GPU today: export the step (onnx_training_ops.export.export_step, or "
    "`onnx-training-ops export-step`) and train it with onnx_training_ops.export.DeviceTrainer(directory, "
    "providers=['CUDAExecutionProvider', 'CPUExecutionProvider']), which keeps the state on the device"
)


def provider_name(provider: str | tuple[str, dict]) -> str:
    """The name of a provider given as ``"Name"`` or ``("Name", {options})``."""
    if isinstance(provider, tuple):
        if not provider or not isinstance(provider[0], str):
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


def checked_providers(providers: Sequence[str | tuple[str, dict]] | None,
                      available: Sequence[str] | None = None) -> list:
    """``providers`` as a list, after checking that the session can train correctly on them.

    Raises :class:`TrainingOpError` when a provider is not in this onnxruntime build (instead
    of onnxruntime's silent fallback to the CPU), and for any provider but the CPU's (the
    state would be read from a stale device copy from step 2 on).
    """
    if providers is None:
        return [CPU]
    if isinstance(providers, (str, tuple)):
        providers = [providers]
    listed = list(providers)
    if not listed:
        raise TrainingOpError(f"providers: empty list; leave it out (or pass [{CPU!r}]) to train on the CPU")
    require_available(listed, available)
    names = [provider_name(p) for p in listed]
    other = [n for n in names if n != CPU]
    if other:
        raise TrainingOpError(
            f"providers: TrainingSession trains on {CPU} only for now, found {', '.join(map(repr, other))}: "
            f"a device provider would read the parameters of step 1 from then on (state bound from host "
            f"arrays is copied to the device once, at bind time). {_GPU_HINT}"
        )
    return listed
