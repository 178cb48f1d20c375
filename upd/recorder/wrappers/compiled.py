"""torch.compile: an ``OptimizedModule`` keeps the compiled module under ``_orig_mod``, a component of the names of
everything inside it (``naming.without_compile_prefix`` drops it, also from compiled submodules)."""
from __future__ import annotations

from ..naming import COMPILED_MODULE
from ..wrapper_registry import Wrapper, is_instance, loaded_class, register


@register
class Compiled(Wrapper):
    name = "torch.compile"
    priority = 5

    def model_inside(self, model):
        optimized = loaded_class("torch._dynamo.eval_frame", "OptimizedModule")
        return getattr(model, COMPILED_MODULE) if is_instance(model, optimized) else None
