"""Loading onnxruntime-extensions without its package ``__init__`` (which imports torch).

Its ``cvt`` module imports torch and transformers when installed (1.5-5 s) and sets
``PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION=python`` for every later subprocess (DESIGN.md
section 2): only the PyOp module ``_ocos`` and the custom-op library are loaded here.
"""

from __future__ import annotations

from ..errors import TrainingOpError

_EXTENSIONS = "onnxruntime_extensions"


def extensions_pyop_module():
    """onnxruntime-extensions' PyOp module (``onnxruntime_extensions._ocos``), loaded without
    running the package's ``__init__`` unless the caller already imported the package.

    The module is imported under a placeholder parent package that is removed right after,
    so a later ``import onnxruntime_extensions`` runs the real ``__init__``, which finds this
    same ``_ocos`` (and its compiled ``_extensions_pydll``) in ``sys.modules``: one op list,
    one invocation hook, shared with the user's own PyOps. (One trace of the trick: on that
    later package, ``_ocos`` is reached through ``from onnxruntime_extensions import _ocos``
    or ``sys.modules``, not as an attribute set by the import system.)
    """
    import importlib
    import importlib.util
    import sys
    import types

    name = f"{_EXTENSIONS}._ocos"
    if name in sys.modules:
        return sys.modules[name]
    if _EXTENSIONS in sys.modules:
        return importlib.import_module(name)
    spec = importlib.util.find_spec(_EXTENSIONS)
    if spec is None or not spec.submodule_search_locations:
        raise TrainingOpError("onnxruntime-extensions is not installed: pip install onnxruntime-extensions "
                              "(or prepare the model with portable=True, which needs no plugin)")
    placeholder = types.ModuleType(_EXTENSIONS)
    placeholder.__path__ = list(spec.submodule_search_locations)
    placeholder.__package__ = _EXTENSIONS
    sys.modules[_EXTENSIONS] = placeholder
    try:
        return importlib.import_module(name)
    finally:
        if sys.modules.get(_EXTENSIONS) is placeholder:
            del sys.modules[_EXTENSIONS]


def extensions_library_path() -> str:
    """Path of the onnxruntime-extensions custom-op library (nothing registered)."""
    return extensions_pyop_module().get_library_path()
