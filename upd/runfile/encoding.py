"""How values are encoded in the run file: JSON text for metadata, numpy dtypes for tensors (bfloat16 as raw bits).

The torch -> numpy dtype map lives here and nowhere else; docs/format.md describes the same encoding.
"""
from __future__ import annotations

import contextlib
import functools
import gc
import json
import math
from typing import TYPE_CHECKING, Any

import numpy as np

from .schema import MAX_META_BYTES

if TYPE_CHECKING:
    import torch
# torch is imported by the functions that use it: reading a run's JSON and listing it (`upd info`) needs no torch.


def to_json(obj: Any) -> str:
    return json.dumps(jsonable(obj), sort_keys=True, allow_nan=True)


def from_json(text: Any) -> Any:
    if isinstance(text, bytes):
        text = text.decode("utf-8")
    if not isinstance(text, str):
        raise ValueError(f"expected a JSON string, found {type(text).__name__}")
    if len(text) > MAX_META_BYTES:
        raise ValueError(f"JSON attribute of {len(text)} bytes exceeds the {MAX_META_BYTES} byte limit")
    if json_depth(text) > MAX_JSON_DEPTH:
        # Everything that walks the parsed value (text cleaning for the terminal, comparisons) recurses: bounded
        # here, before parsing, so neither the parser nor a later walk can exhaust the stack
        raise ValueError(f"JSON nested deeper than {MAX_JSON_DEPTH} levels")
    with gc_paused():
        return json.loads(text)


@contextlib.contextmanager
def gc_paused():
    """Python's cyclic garbage collector off while a block builds many small containers that hold no cycles (a
    parsed attribute, one entry per parameter): each collection rescans every container made so far, which took
    three quarters of building 200,000 parameters' entries. Restored as it was (nested uses leave it off)."""
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was_enabled:
            gc.enable()


MAX_JSON_DEPTH = 100  # a tensor hyperparameter of HDF5's largest rank (32) inside a group list nests about 35 deep
_NESTING = np.zeros(256, np.int8)
_NESTING[[ord("["), ord("{")]] = 1
_NESTING[[ord("]"), ord("}")]] = -1


_SIGNIFICANT = _NESTING != 0
_SIGNIFICANT[[ord('"'), ord("\\")]] = True


def json_depth(text: str) -> int:
    """How deeply lists and objects nest in JSON text: brackets outside strings, counted with numpy over the
    brackets, quotes and backslashes alone (no walk of the parsed value). Malformed text gets some number; the
    parser refuses it afterwards."""
    if "[" not in text and "{" not in text:
        return 0
    raw = np.frombuffer(text.encode("utf-8", "surrogatepass"), np.uint8)
    where = np.flatnonzero(_SIGNIFICANT[raw])
    chars = raw[where]
    quote = chars == ord('"')
    if "\\" in text:  # a quote is escaped when an odd run of backslashes ends right before it
        m = chars.size
        order = np.arange(m)
        backslash = chars == ord("\\")
        adjacent = np.zeros(m, bool)
        adjacent[1:] = np.diff(where) == 1
        continues = backslash & adjacent
        continues[1:] &= backslash[:-1]
        continues[0] = False
        run_start = np.maximum.accumulate(np.where(backslash & ~continues, order, 0))
        run_length = np.where(backslash, order - run_start + 1, 0)
        before = np.zeros(m, np.int64)
        before[1:] = np.where(backslash[:-1] & adjacent[1:], run_length[:-1], 0)
        quote &= before % 2 == 0
    inside = (np.cumsum(quote) % 2).astype(bool)  # from an opening quote up to its closing one
    nesting = np.where(inside | quote, 0, _NESTING[chars]).astype(np.int64)
    return int(np.cumsum(nesting).max()) if nesting.size else 0


def jsonable(value: Any) -> Any:
    """Turn a hyperparameter or metadata value into plain JSON types.

    Tensor hyperparameters (a tensor lr, tensor betas) become {"tensor": value, "dtype": ...} so a replay can tell
    them apart from Python floats; anything else unknown becomes {"repr": ...} rather than failing the record.
    """
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value
    import torch

    if isinstance(value, torch.Tensor):
        data = value.detach().cpu()
        return {"tensor": data.double().tolist() if data.is_floating_point() else data.tolist(),
                "dtype": dtype_name(data.dtype)}
    if isinstance(value, (list, tuple)):
        return [jsonable(v) for v in value]
    if isinstance(value, dict):
        return {str(k): jsonable(v) for k, v in value.items()}
    if isinstance(value, torch.dtype):
        return dtype_name(value)
    if isinstance(value, (np.floating, np.integer, np.bool_)):
        return value.item()
    return {"repr": repr(value)}


def hparam_value(value: Any) -> Any:
    """The numeric value of a JSON-encoded hyperparameter: a tensor hyperparameter becomes its number when it holds
    one element (torch accepts ``lr=torch.tensor([0.1])``), else its (nested) list; lists element-wise."""
    if isinstance(value, dict) and "tensor" in value:
        single = value["tensor"]
        while isinstance(single, list) and len(single) == 1:
            single = single[0]
        return value["tensor"] if isinstance(single, list) else single
    if isinstance(value, list):
        return [hparam_value(v) for v in value]
    return value


def lr_of(group_hparams: dict) -> float:
    lr = hparam_value(group_hparams.get("lr", math.nan))
    try:
        return float(lr)
    except (TypeError, ValueError):
        return math.nan


def dtype_name(dtype: torch.dtype) -> str:
    """How the run file names a torch dtype: ``float32``, ``bfloat16``."""
    return str(dtype).replace("torch.", "")


@functools.lru_cache(maxsize=64)
def numpy_dtype_of(torch_dtype_name: str) -> np.dtype | None:
    """The numpy dtype a tensor of this torch dtype is stored as (uint16 for bfloat16, its raw bits); None when the
    name is no torch dtype or has no numpy counterpart. Names come from files too: only torch's dtypes are looked up.
    """
    import torch

    target = getattr(torch, torch_dtype_name, None) if torch_dtype_name.isidentifier() else None
    if not isinstance(target, torch.dtype):
        return None
    if target == torch.bfloat16:
        return np.dtype(np.uint16)
    try:
        return np.dtype(torch.empty((), dtype=target).numpy().dtype)
    except (TypeError, RuntimeError):
        return None


def storage_numpy_dtype(torch_dtype: torch.dtype, storage: str) -> tuple[np.dtype, str]:
    """(numpy dtype on disk, torch dtype name it represents) for a tensor of torch_dtype under a storage choice."""
    import torch

    if storage == "keep" or not torch_dtype.is_floating_point:
        target = torch_dtype
    else:
        target = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[storage]
    name = dtype_name(target)
    found = numpy_dtype_of(name)
    if found is None:
        raise TypeError(f"torch dtype {name} has no numpy dtype to store it as")
    return found, name


def state_storage_dtype(tensor: torch.Tensor, storage: str) -> str:
    """Storage choice for one optimizer-state tensor under the user's dtype= option.

    Scalar state (step counters) is kept exact: bfloat16 cannot count past 256. float16 state is widened to
    float32: second moments (~1e-3 * grad^2) fall below float16's normal range and would replay as zeros.
    """
    if tensor.dim() == 0:
        return "keep"
    if storage == "float16":
        return "float32"
    return storage


def tensor_to_numpy(tensor: torch.Tensor, torch_dtype_name: str) -> np.ndarray:
    """CPU tensor -> numpy array in the storage encoding named by torch_dtype_name."""
    import torch

    target = getattr(torch, torch_dtype_name)
    if tensor.dtype != target:  # (a no-op .to() still costs a dispatch, per tensor and record)
        tensor = tensor.to(target)
    if target == torch.bfloat16:
        return tensor.view(torch.uint16).numpy()
    return tensor.numpy()


def numpy_to_tensor(array: np.ndarray, torch_dtype_name: str) -> torch.Tensor:
    """Inverse of tensor_to_numpy."""
    import torch

    array = np.ascontiguousarray(array)
    if torch_dtype_name == "bfloat16":
        return torch.from_numpy(array.view(np.uint16).copy()).view(torch.bfloat16)
    return torch.from_numpy(array.copy())


def class_path(cls: type | str) -> str:
    """How the run file names a class: ``torch.optim.Adam`` for torch's optimizers (the way users write it, when
    ``torch.optim.<name>`` is that class), else ``module.QualifiedName``. A string is taken as already named."""
    if isinstance(cls, str):
        return cls
    import torch

    public = getattr(torch.optim, cls.__name__, None)
    return f"torch.optim.{cls.__name__}" if public is cls else defining_path(cls)


def defining_path(cls: type) -> str:
    """``module.QualifiedName`` of the module that defines cls (``torch.optim.adam.Adam``): the optimizer's MRO
    is stored this way, so a rule registered for a base class is found whatever public alias it has."""
    return f"{cls.__module__}.{cls.__qualname__}"
