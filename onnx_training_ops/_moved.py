"""Module paths from before the package had its layers (0.1 and earlier), kept working.

``import onnx_training_ops.plugin`` (or ``from onnx_training_ops.builder import metadata``)
gives the module that now lives at ``onnx_training_ops.runtime.plugin``: the same module
object, not a copy, loaded only when asked for (importing the package stays cheap).
New code imports the new paths; ``docs/architecture.md`` has the layout.
"""

from __future__ import annotations

import importlib
import importlib.abc
import importlib.util
import sys

PACKAGE = __name__.rsplit(".", 1)[0]
MOVED = {
    "build": "builder",
    "losses": "builder.losses",
    "optimizers": "builder.optimizers",
    "rmsprop": "builder.rmsprop",
    "update_graph": "builder.emit_update",
    "param_groups": "builder.param_groups",
    "grad_clip": "builder.grad_clip",
    "sparse_updates": "builder.sparse_updates",
    "train_mode": "builder.train_mode",
    "plugin": "runtime.plugin",
    "native": "runtime.native",
    "session": "runtime.session",
    "checkpoint": "storage.checkpoint",
    "schedules": "training.schedules",
}


_identity: dict = {}  # old name -> the module's own (spec, loader), between create and exec


class _MovedModules(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Finds ``onnx_training_ops.<old name>`` and hands out the module at its new path."""

    def find_spec(self, fullname, path=None, target=None):
        package, _, name = fullname.rpartition(".")
        if package != PACKAGE or name not in MOVED:
            return None
        return importlib.util.spec_from_loader(fullname, self)

    def create_module(self, spec):
        module = importlib.import_module(f"{PACKAGE}.{MOVED[spec.name.rpartition('.')[2]]}")
        _identity[spec.name] = module.__spec__, module.__loader__
        return module

    def exec_module(self, module):
        # already executed under its new name; the import system stamped the old name's spec on
        # the module: give it back its own
        module.__spec__, module.__loader__ = _identity.pop(module.__spec__.name)


def install() -> None:
    """Add the finder once per process."""
    if not any(isinstance(finder, _MovedModules) for finder in sys.meta_path):
        sys.meta_path.insert(0, _MovedModules())  # before editable-install finders
