"""What :func:`~onnx_training_ops.lora.add_lora` records in a model: the adapters and their settings.

The record is one JSON entry of the model's ``metadata_props`` (:data:`KEY`); the builder
carries it into the training model, where it picks the trainables (the adapters) and
:meth:`~onnx_training_ops.TrainingSession.save_adapter` reads it back.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass

import onnx

from ..errors import TrainingOpError

META_NAME = "lora"  # the builder's metadata entry (onnx_training_ops.<name>)
KEY = f"onnx_training_ops.{META_NAME}"


@dataclass(frozen=True)
class Adapter:
    """One LoRA adapter: ``y[..., start:stop] += scaling * (x @ a) @ b`` beside a linear node.

    ``a`` is ``[in_features, rank]`` and ``b`` ``[rank, stop - start]`` (MatMul's layout:
    peft's ``lora_A.weight``/``lora_B.weight`` transposed). ``output`` is the linear node's
    output in the model add_lora was given (its anchor there); ``module`` the Hugging Face
    module the adapter is peft's adapter of (``model.layers.0.self_attn.q_proj``).
    """

    module: str
    output: str
    a: str
    b: str
    start: int
    stop: int
    in_features: int
    node_out_features: int  # the whole output of its linear node (several modules on a fused one)

    @property
    def out_features(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class LoraSpec:
    """The LoRA settings (peft's names) and the adapters of a model.

    ``source``: the file or folder add_lora read (None for a model given in memory);
    ``model_type``: onnxruntime-genai's ``genai_config.json`` ``model.type`` (``llama``,
    ``phi3``...) when known; ``activation_dtype``: the dtype of the linear layers' input
    (float16 in a CUDA fp16 model), which the served adapter takes; ``targets``: as given
    (a list of module-name suffixes, or a regular expression that full-matches module names).
    """

    rank: int
    alpha: float
    dropout: float
    targets: tuple[str, ...] | str
    adapters: tuple[Adapter, ...]
    source: str | None = None
    model_type: str | None = None
    activation_dtype: str = "float32"  # the linear layers' input dtype: a served adapter's dtype

    @property
    def scaling(self) -> float:
        """peft's ``lora_alpha / r``: what the adapters' product is multiplied by."""
        return self.alpha / self.rank

    @property
    def trainable(self) -> list[str]:
        """The adapters' tensors, A then B for each adapter."""
        return [name for a in self.adapters for name in (a.a, a.b)]

    def to_json(self) -> str:
        fields = dataclasses.asdict(self)
        fields["targets"] = self.targets if isinstance(self.targets, str) else list(self.targets)
        return json.dumps(fields, separators=(",", ":"))

    @classmethod
    def from_json(cls, text: str) -> LoraSpec:
        try:
            fields = json.loads(text)
            adapters = tuple(Adapter(**a) for a in fields.pop("adapters"))
            targets = fields.pop("targets")
            return cls(adapters=adapters, targets=targets if isinstance(targets, str) else tuple(targets), **fields)
        except (ValueError, TypeError, KeyError) as error:
            raise TrainingOpError(f"the model's LoRA record ({KEY}) is malformed: {error}") from None


def lora_spec(model: onnx.ModelProto) -> LoraSpec | None:
    """The LoRA record of ``model`` (a message), or None when add_lora made none."""
    for entry in model.metadata_props:
        if entry.key == KEY:
            return LoraSpec.from_json(entry.value)
    return None


def set_lora_spec(model: onnx.ModelProto, spec: LoraSpec) -> None:
    """Write ``spec`` into ``model``'s metadata (in place), replacing an earlier one."""
    kept = [m for m in model.metadata_props if m.key != KEY]
    del model.metadata_props[:]
    model.metadata_props.extend(kept)
    model.metadata_props.add(key=KEY, value=spec.to_json())
