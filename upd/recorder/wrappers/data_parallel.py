"""torch.nn.DataParallel (one process, the model copied to each device per forward pass) and Lightning Fabric's
``_FabricModule``: wrappers that only run the model; their own names would prefix the model's."""
from __future__ import annotations

import torch

from ..wrapper_registry import Wrapper, attribute, register

# Module wrappers of optional packages, by class name, and the attribute that holds the model.
MODEL_ATTRIBUTES = {"_FabricModule": "_original_module"}


@register
class ModuleRunners(Wrapper):
    name = "DataParallel / Fabric module"

    def model_inside(self, model):
        if isinstance(model, torch.nn.DataParallel):
            return model.module
        name = MODEL_ATTRIBUTES.get(type(model).__name__)
        inner = attribute(model, name) if name else None
        return inner if isinstance(inner, torch.nn.Module) else None
