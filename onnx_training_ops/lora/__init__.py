"""LoRA on ONNX models: adapters beside linear layers (4-bit ``MatMulNBits`` included), out to peft and onnxruntime.

* :func:`add_lora` (:mod:`.inject`) — peft's LoRA beside the ``MatMul``, ``Gemm`` and
  ``MatMulNBits`` nodes that ``targets`` picks (:mod:`.targets`: module paths, Hugging Face
  names, onnxruntime-genai's fused ``qkv_proj``), recorded in the model (:mod:`.spec`);
* :mod:`.formats` — the trained adapters written as a peft folder or onnxruntime's
  ``.onnx_adapter``, read back, and the base model onnxruntime-genai serves them with.

May import: the foundation, storage, passes (below builder: the builder picks the adapters
as the trainables; TrainingSession saves them).
"""

from .formats import read_adapter, save_adapter, write_serving_model
from .inject import add_lora
from .spec import Adapter, LoraSpec, lora_spec

__all__ = ["Adapter", "LoraSpec", "add_lora", "lora_spec", "read_adapter", "save_adapter", "write_serving_model"]
