"""The run file's layout: every name the writer creates and the reader looks for, declared once.

Everything here is documented in docs/format.md; change both together and bump FORMAT_VERSION when a reader of
the old version could misread a new file.
"""
from __future__ import annotations

FORMAT_NAME = "torch-upd run"
FORMAT_VERSION = 1

# Root attributes.
ATTR_FORMAT = "format"
ATTR_VERSION = "format_version"
ATTR_META = "meta"

# Tensor kinds stored per parameter (dataset names inside a parameter's group).
KIND_PARAM = "param"  # parameter before optimizer.step()
KIND_PARAM_AFTER = "param_after"  # parameter after optimizer.step()
KIND_GRAD = "grad"  # gradient as the optimizer saw it
STATE_GROUP = "state"  # optimizer state before the step, one dataset per state key
STATE_PRESENT = "state_present"  # (rows, keys) uint8 mask: was this state key present at this row
RECORD_INDEX = "record"  # (rows,) which record of the optimizer each row belongs to

WHAT_CHOICES = ("param", "grad", "state")

# Storage dtypes a user can choose. bfloat16 has no HDF5/numpy type: it is stored as its raw uint16 bits with the
# attribute torch_dtype="bfloat16" (readers reinterpret the bits; see docs/format.md).
STORAGE_DTYPES = ("keep", "float32", "float16", "bfloat16")

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"  # starts the superblock (at byte 0 of every file this writer creates)

MAX_META_BYTES = 16 * 1024 * 1024  # readers refuse larger JSON attributes rather than parse them
