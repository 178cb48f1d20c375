"""Parameter names in the run file, and which parameters ``include=``/``exclude=`` select.

A name is fixed the first time the recorder sees a parameter and never changes afterwards: it is the parameter's
dataset path in the file, and resuming a run matches parameters by it. Names are the model's own: wrappers that
only run it differently (torch.compile's ``_orig_mod.``, DDP's ``module.``, see ``upd.recorder.wrappers``) add
nothing to them, so a run compiled or not, distributed or not, has the same names.
"""
from __future__ import annotations

import fnmatch
import sys

# The attribute torch.compile's OptimizedModule keeps the compiled module under, and so a component of the names
# of everything inside it.
COMPILED_MODULE = "_orig_mod"


def uncompiled(model):
    """The module inside torch.compile's wrapper (OptimizedModule), else `model` itself."""
    optimized = getattr(sys.modules.get("torch._dynamo.eval_frame"), "OptimizedModule", None)
    while optimized is not None and isinstance(model, optimized):
        model = getattr(model, COMPILED_MODULE)
    return model


def without_compile_prefix(name: str) -> str:
    """A name without the ``_orig_mod.`` components of compiled modules (a compiled submodule puts one in the
    middle of its parameters' names)."""
    return ".".join(part for part in name.split(".") if part != COMPILED_MODULE) or name


def named_parameters(model):
    """(name, parameter) for the model's parameters, as the run names them."""
    return [(without_compile_prefix(n), p) for n, p in model.named_parameters()]


def model_names(model) -> dict[int, str]:
    """id(parameter) -> name in the model. named_parameters() already drops duplicates: a tied parameter is recorded
    once, under its first name."""
    return {} if model is None else {id(p): n for n, p in named_parameters(model)}


class ParamNames:
    """The names of one optimizer's parameters: from the model, else the optimizer's ``param_names`` (an optimizer
    built from ``named_parameters()``), else ``group{g}.param{i}``; unique within the optimizer."""

    def __init__(self, names_in_model: dict[int, str]):
        self._names_in_model = names_in_model
        self._by_id: dict[int, str] = {}

    def name(self, param, group_index: int, index_in_group: int, group: dict) -> str:
        """The parameter's name, given on first sight."""
        name = self._by_id.get(id(param))
        if name is not None:
            return name
        name = self._names_in_model.get(id(param))
        if name is None and "param_names" in group and index_in_group < len(group["param_names"]):
            name = without_compile_prefix(group["param_names"][index_in_group])
        if name is None:
            name = f"group{group_index}.param{index_in_group}"
        # A '/' is kept: the writer escapes it in the file (schema.param_key) and readers show the name as it was.
        if name in self._by_id.values():
            name = f"{name}#{len(self._by_id)}"
        self._by_id[id(param)] = name
        return name

    def __getitem__(self, param) -> str:
        """The name of a parameter already named."""
        return self._by_id[id(param)]


def patterns(value) -> list[str]:
    """include=/exclude= as a list: one glob pattern, several, or None."""
    return [value] if isinstance(value, str) else list(value or [])


def is_selected(name: str, include: list[str], exclude: list[str]) -> bool:
    """True when `name` matches an include pattern (or there are none) and no exclude pattern."""
    if include and not any(fnmatch.fnmatchcase(name, pat) for pat in include):
        return False
    return not any(fnmatch.fnmatchcase(name, pat) for pat in exclude)
