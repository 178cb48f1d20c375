"""Replay rules: one small module per optimizer family, registered by optimizer class.

Every module in this package registers its rules on import; add your own with ``upd.replay.register(MyOptimizer)``
(see docs/verify.md).
"""
import importlib
import pkgutil

from .registry import (NotReplayable, Replayed, ReplayRule, load_plugins, lookup, register, registered,
                       unregister)

for _module in pkgutil.iter_modules(__path__):
    if _module.name != "registry":
        importlib.import_module(f"{__name__}.{_module.name}")

__all__ = ["register", "unregister", "lookup", "registered", "load_plugins", "Replayed", "ReplayRule",
           "NotReplayable"]
