"""Model files on disk: reading models (external data included), atomic writes, checkpoint integrity.

* :mod:`.model_files` — :func:`load_model` (a ModelProto from a proto, a path or bytes);
* :mod:`.checkpoint` — atomic writes, SHA-256 checksums, the state written into a model.

May import: errors, walk (nothing above them: every other layer reads and writes through here).
"""
