"""Replay rules for every torch.optim optimizer: one module per optimizer family, each registering on import."""
import importlib
import pkgutil

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
