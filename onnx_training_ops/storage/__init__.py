"""Model files on disk and models past protobuf's 2 GB: reading, atomic writes, checkpoint integrity.

* :mod:`.tensors` — where a tensor's values are (in the message, an array, a file), sizes,
  constant fills; :func:`~.tensors.large_model_bytes`, the size past which a model is large;
* :mod:`.large_model` — :class:`~.large_model.LargeModel`: a ModelProto and its big tensors
  as numpy arrays (onnx's ``ModelContainer``), never serialized together;
* :mod:`.external_data` — tensors in files: memory-mapped reads, ``readinto`` reads that
  hash on the way, streamed aligned writes; :mod:`.inline_offsets` finds an inline
  tensor's bytes in an ``.onnx`` file;
* :mod:`.model_files` — :func:`load_model` (a ModelProto, or with ``large=True`` a
  LargeModel memory-mapped from its file); :func:`~.model_files.as_model`, the one model
  type every inner layer takes, whatever the size;
* :mod:`.checkpoint` — atomic writes, SHA-256 checksums (streamed for external data);
  :mod:`.snapshot` — the state written into a model; :mod:`.save` — :func:`save_model`,
  one file or the message plus one data file, atomically across both.

May import: errors, walk (nothing above them: every other layer reads and writes through here).
"""

from .large_model import LargeModel
from .model_files import as_model, load_model
from .save import data_files, save_model
from .tensors import large_model_bytes

__all__ = ["LargeModel", "as_model", "data_files", "large_model_bytes", "load_model", "save_model"]
