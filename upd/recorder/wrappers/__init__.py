"""What torch-upd knows about each kind of wrapper and parallelism: one module per kind, each registering its
``upd.recorder.wrapper_registry.Wrapper`` on import (docs/distributed.md, "Adding a wrapper"). Importing this package
registers them all; the recorder, the launcher and the snapshots ask their questions through it."""
import importlib
import pkgutil

from ..wrapper_registry import (Wrapper, attribute, counts_toward_whole, global_names, in_use, is_job_optimizer,
                                job_optimizer, job_parameters, local_optimizer, local_part, model_chain, model_inside,
                                optimizer_inside, register, shard_layout, splits, unregister, wrappers)

__all__ = ["Wrapper", "attribute", "counts_toward_whole", "global_names", "in_use", "is_job_optimizer",
           "job_optimizer", "job_parameters", "local_optimizer", "local_part", "model_chain", "model_inside",
           "optimizer_inside", "register", "shard_layout", "splits", "unregister", "wrappers"]

for _module in pkgutil.iter_modules(__path__):
    importlib.import_module(f"{__name__}.{_module.name}")
