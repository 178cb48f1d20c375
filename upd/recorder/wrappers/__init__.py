"""What torch-upd knows about each kind of wrapper and parallelism: one module per kind, each registering its
``upd.recorder.wrapper_registry.Wrapper`` on import (docs/distributed.md, "Adding a wrapper")."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
