"""The record of torch's names in a model's ``metadata_props``: where each ``state_dict`` entry went.

``{"onnx initializer": {"torch": [names], "transpose": bool, "alias_of": source}}`` under
:data:`KEY`: the torch names an initializer holds (several for one tied tensor), whether it
holds them transposed, and the initializer it is an ``Identity`` alias of (equal values the
TorchScript exporter merged). :data:`PARAMETERS_KEY` (made from the module, not from a
``state_dict`` alone): ``{torch parameter: requires_grad}``, what torch trains, the
builder's default trainables. :data:`UNHELD_KEY` lists the torch parameters that no initializer
holds and no constant was found to be computed from (``{name: why}``: unused by ``forward``,
or folded beyond recognition): the builder names them in a warning. :data:`LOST_KEY`: the
torch parameters certainly folded beyond repair (a BatchNorm folded into a convolution, found
by value): the builder refuses to train them, as it does a dynamo export's.

:func:`~onnx_training_ops.training.state.torch_names.record_torch_names` writes it at export time;
the builder adds what it restores (:mod:`.dynamo_params`) and keeps it (outside its own
metadata prefix); ``TrainingSession.to_torch_state_dict`` reads it.
"""

from __future__ import annotations

import json

import onnx

from ..errors import TrainingOpError

KEY = "torch.state_dict_names"
PARAMETERS_KEY = "torch.parameters"
LOST_KEY = "torch.lost_parameters"
UNHELD_KEY = "torch.unheld_parameters"


def read(model: onnx.ModelProto, key: str = KEY) -> dict | None:
    """The JSON object recorded under ``key``, or None."""
    for m in model.metadata_props:
        if m.key == key:
            try:
                return json.loads(m.value)
            except json.JSONDecodeError as error:
                raise TrainingOpError(f"metadata {key!r} is not JSON: {error}") from error
    return None


def write(model: onnx.ModelProto, value: dict | None, key: str = KEY) -> None:
    """Record ``value`` under ``key`` (in place), replacing an earlier record; None removes it."""
    kept = [m for m in model.metadata_props if m.key != key]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    if value is not None:
        model.metadata_props.add(key=key, value=json.dumps(value))
