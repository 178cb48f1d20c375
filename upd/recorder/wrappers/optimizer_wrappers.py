"""Optimizer wrappers that expose the optimizer they wrap as an attribute: Accelerate's ``AcceleratedOptimizer``
and Lightning's ``LightningOptimizer`` / Fabric's ``_FabricOptimizer`` (``optimizer``, ``_optimizer``), and others
(``optim``). AcceleratedOptimizer subclasses torch.optim.Optimizer without initialising it: it has no step hooks of
its own, so the recorder hooks the optimizer inside."""
from __future__ import annotations

from ..wrapper_registry import Wrapper, attribute, register

# Where optimizer wrappers keep the optimizer they wrap, tried in this order.
WRAPPED_OPTIMIZER_ATTRIBUTES = ("optimizer", "optim", "_optimizer")


@register
class OptimizerWrappers(Wrapper):
    name = "Accelerate / Lightning optimizer wrapper"
    priority = -10  # after the wrappers that know their own class (a ZeroRedundancyOptimizer also has .optim)

    def optimizer_inside(self, obj) -> tuple:
        return tuple(v for v in (attribute(obj, name) for name in WRAPPED_OPTIMIZER_ATTRIBUTES) if v is not None)
