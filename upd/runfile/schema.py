"""The run file's layout, declared once: every group, dataset and attribute, with its dtype and shape rule.

The writer creates datasets from these declarations (and truncates them on resume by the same list), the reader's
validator checks a file against them, and the tests find paths through them. docs/format.md states the same
layout; tests/runfile/test_format_doc.py fails when the two disagree.

Adding a column to a table: declare it in the table below, fill it in ``writer.py``, add its row to docs/format.md.
Bump FORMAT_VERSION only when a reader of the old version could misread a new file (an added dataset or attribute
is ignored by older readers; see "Evolution" in docs/format.md).
"""
from __future__ import annotations

from dataclasses import dataclass

FORMAT_NAME = "torch-upd run"
FORMAT_VERSION = 1

# -- names ---------------------------------------------------------------------------------------------------------
# Root attributes.
ATTR_FORMAT = "format"
ATTR_VERSION = "format_version"
ATTR_META = "meta"  # also the metadata attribute of every optimizer and parameter group
ATTR_PARAMS_NOT_OPTIMIZED = "params_not_optimized"
ATTR_CLOSED_CLEANLY = "closed_cleanly"
ATTR_RESUMES = "resumes"

# The root meta's entry in a file written by one rank of a distributed job (docs/format.md, "Distributed jobs"):
# {"rank", "world_size", "recording_ranks": ALL_RANKS or a list, "parallelism": one of PARALLELISMS, "job_path"},
# and META_RECORDED_WEIGHTS where the recorded weights are not the model's own.
META_DISTRIBUTED = "distributed"
ALL_RANKS = "all"
FSDP, FSDP1, ZERO, DEEPSPEED, DDP, REPLICATED = "fsdp", "fsdp1", "zero", "deepspeed", "ddp", "replicated"
PARALLELISMS = (FSDP, FSDP1, ZERO, DEEPSPEED, DDP, REPLICATED)
WHOLE_ON_EVERY_RANK = (DDP, REPLICATED)  # parallelisms whose ranks hold whole copies of every parameter
# Parallelisms in which a plain (not part-of) tensor of a rank's optimizer is stepped by that rank alone:
# ZeroRedundancyOptimizer gives each parameter to one rank.
PARTITIONED = (ZERO,)

# How a rank's stored part of a distributed parameter sits in the whole tensor: the "part_layout" key of a part's
# parameter metadata (docs/format.md, "Distributed jobs"), and what readers stitch the parts by.
PART_LAYOUT = "part_layout"
# "box": the part is whole[offset[0]:offset[0] + shape[0], ...], a box of the tensor (FSDP2's DTensor shards).
PART_BOX = "box"
# "flat": the part is a contiguous run of the whole tensor flattened in row-major order, elements
# offset[0] .. offset[0] + shape[0] - 1 (one offset, a 1-d part): DeepSpeed ZeRO and FSDP1 flat partitions.
PART_FLAT = "flat"
PART_LAYOUTS = (PART_BOX, PART_FLAT)
# The key of a distributed file's "distributed" entry that says which weights a rank recorded, when they are not
# the model's own (DeepSpeed: the fp32 master partitions its optimizer steps).
META_RECORDED_WEIGHTS = "recorded_weights"

OPTIMIZERS = "optimizers"  # root group: one member group per optimizer, named by its index
FLIGHT_DUMPS = "flight_dumps"  # root dataset
EVENTS = "events"  # root dataset: the live alerts (upd.record(..., alerts=...)), one JSON object each
# The fields of an events entry (the columns of run.events()), and what a reader accepts of a stranger's table:
# at most MAX_EVENT_ROWS entries (the recorder stores at most 10,000) of at most MAX_EVENT_BYTES each.
EVENT_FIELDS = ("optimizer", "step", "kind", "param", "value", "wall_time")
MAX_EVENT_ROWS = 20_000
MAX_EVENT_BYTES = 4096

# Members of an optimizer's group.
RECORDS = "records"  # the record table
PARAMS = "params"  # one group per parameter, named param_key(its name)
STATS = "stats"  # the statistics table
SCALARS = "scalars"  # the logged-scalars table (rec.log, closure losses, total gradient norms)

# Table columns. Both tables commit a row by appending to STEP: its length is the number of committed rows.
STEP = "step"
BACKWARD_PASS = "backward_pass"
WALL_TIME = "wall_time"
LR = "lr"
HPARAMS = "hparams"
CLOSURE_LOSSES = "closure_losses"
VALUES = "values"
COMMIT_COLUMN = STEP

# Attribute of the scalars table: the name of each column of its VALUES.
SCALAR_COLUMNS = "columns"

# Scalars the recorder logs itself (rec.log refuses these names). The loss of a step(closure) step is its first
# closure evaluation's (at the parameters before the step), logged as "loss" unless rec.log gave one.
SCALAR_LOSS = "loss"
# Total L2 norm over the optimizer's gradients, as accumulated by the backward pass (before any clipping,
# unscaling or other change between backward and step), and as the optimizer saw them at the step.
SCALAR_GRAD_NORM_BACKWARD = "total_grad_norm_backward"
SCALAR_GRAD_NORM_AT_STEP = "total_grad_norm_step"
# A step torch.amp.GradScaler handed to a fused optimizer (optimizer.grad_scale and .found_inf set for the step):
# the factor the gradients it received still carried (1 after scaler.unscale_), and 1.0 where the scaler found an
# inf/NaN gradient and the fused kernel skipped the step. The run's gradients are shown divided by the scale.
SCALAR_AMP_GRAD_SCALE = "amp_grad_scale"
SCALAR_AMP_FOUND_INF = "amp_found_inf"
RECORDER_SCALARS = (SCALAR_GRAD_NORM_BACKWARD, SCALAR_GRAD_NORM_AT_STEP, SCALAR_AMP_GRAD_SCALE, SCALAR_AMP_FOUND_INF)
# Names a logged scalar cannot have: the key columns of the tables that show scalars next to records (run.steps(),
# run.scalars()), and their per-group learning-rate columns (prefix).
RESERVED_SCALAR_NAMES = ("optimizer", "record", "stats_row", "step", "backward_pass", "wall_time")
RESERVED_SCALAR_PREFIX = "lr_group"

# Attributes of the statistics table.
STATS_PARAMS = "params"
STATS_COLUMNS = "columns"
STATS_PARAM_META = "param_meta"

# Tensor kinds stored per parameter (dataset names inside a parameter's group).
KIND_PARAM = "param"  # parameter before optimizer.step()
KIND_PARAM_AFTER = "param_after"  # parameter after optimizer.step()
KIND_GRAD = "grad"  # gradient as the optimizer saw it
TENSOR_KINDS = (KIND_PARAM, KIND_GRAD, KIND_PARAM_AFTER)
STATE_GROUP = "state"  # optimizer state before the step, one dataset per state key
STATE_KEYS = "keys"  # attribute of the state group: JSON list of the keys, in state_present's column order
STATE_PRESENT = "state_present"  # (rows, keys) uint8 mask: was this state key present at this row
RECORD_INDEX = "record"  # (rows,) which record of the optimizer each row belongs to
PARAM_INDEX = "index"  # attribute of an optimizer's params group: every parameter's listing (param_index.py)
# Its members: the committed records it describes and one entry per parameter group, with these fields.
INDEX_RECORDS, INDEX_PARAMS = "records", "params"
INDEX_KEY, INDEX_META, INDEX_ROWS, INDEX_KINDS, INDEX_STATE_KEYS = "key", "meta", "rows", "kinds", "state_keys"

# Attributes of every tensor dataset.
ATTR_TORCH_DTYPE = "torch_dtype"  # the dtype of the stored values (bfloat16 is stored as raw uint16 bits)
ATTR_SOURCE_DTYPE = "source_dtype"  # the recorded tensor's own dtype

WHAT_CHOICES = ("param", "grad", "state")

# Storage dtypes a user can choose. bfloat16 has no HDF5/numpy type: it is stored as its raw uint16 bits with the
# attribute torch_dtype="bfloat16" (readers reinterpret the bits; see docs/format.md).
STORAGE_DTYPES = ("keep", "float32", "float16", "bfloat16")

HDF5_SIGNATURE = b"\x89HDF\r\n\x1a\n"  # starts the superblock (at byte 0 of every file this writer creates)

MAX_META_BYTES = 16 * 1024 * 1024  # readers refuse larger JSON attributes rather than parse them
# The longest parameter name the recorder writes (characters): a longer one keeps its start and end around a marker
# (recorder.naming.bounded_name). Readers take a stranger's longer names and bound what they show (safe_text).
MAX_NAME_CHARS = 4096

def param_key(name: str) -> str:
    """A parameter's name as the name of its group under PARAMS: '/' separates HDF5 path components, so '%' and '/'
    are written '%25' and '%2F' (reversible: param_name)."""
    return name.replace("%", "%25").replace("/", "%2F")


def param_name(key: str) -> str:
    """The parameter's name from its group's name (param_key reversed)."""
    return key.replace("%2F", "/").replace("%25", "%") if "%" in key else key


# -- declarations --------------------------------------------------------------------------------------------------
STRING = "UTF-8 string"  # dtype of variable-length UTF-8 text (JSON, mostly)
STORAGE = "storage dtype"  # dtype of a tensor dataset: the tensor's dtype under dtype= (ATTR_TORCH_DTYPE says which)

# Dtype kinds a reader accepts, as numpy's dtype.kind letters ("string": UTF-8 text).
INTEGERS = "iu"
NUMBERS = "fiu"
FLOATS = "f"
TENSOR_NUMBERS = "fiucb"  # float, int, uint, complex, bool
MASK = "iub"


@dataclass(frozen=True)
class Attr:
    """An attribute: its name and how its value is stored ("string", "int" or JSON text of the given type)."""

    name: str
    type: str
    required: bool = True  # False: a reader accepts an object without it


@dataclass(frozen=True)
class Dataset:
    """A dataset: dtype as the writer creates it, shape rule, what a reader accepts, and the writer's chunking.

    shape names the axes: the first one is the row axis (rows are appended); every axis the writer creates
    resizable, starting at size 0. "*shape" stands for the axes of the recorded tensor (fixed, from its metadata).
    """

    name: str
    dtype: str  # numpy dtype name ("int64", ...), STRING or STORAGE
    shape: tuple[str, ...]
    accepts: str | None  # dtype kinds a reader accepts (INTEGERS, ..., or "string"); None: upd never reads it
    chunks: tuple[int, ...] | None = None  # None: sized by the writer when it creates the dataset (first row)
    fill: float | None = None  # value of unwritten elements (None: HDF5's default, zero or empty)
    required: bool = True  # False: a reader accepts a file without it
    attrs: tuple[Attr, ...] = ()

    @property
    def rank(self) -> int | None:
        """Number of dimensions, None when it depends on the recorded tensor."""
        return None if any(axis.startswith("*") for axis in self.shape) else len(self.shape)

    @property
    def shape_text(self) -> str:
        """The shape as docs/format.md writes it: ``(R,)``, ``(R, G)``, ``(N, *shape)``."""
        return "(" + ", ".join(self.shape) + ("," if len(self.shape) == 1 else "") + ")"


@dataclass(frozen=True)
class Group:
    """A group: where it is (a path template with {k} for the optimizer index, {name} for the parameter name), its
    attributes and its datasets. A table is a group whose datasets share the row axis and commit with STEP."""

    template: str
    attrs: tuple[Attr, ...] = ()
    datasets: tuple[Dataset, ...] = ()

    @property
    def name(self) -> str:
        return self.template.rsplit("/", 1)[-1]

    @property
    def doc_path(self) -> str:
        """How docs/format.md names it in a heading: ``/optimizers/<k>/records/``."""
        return self.template.replace("{", "<").replace("}", ">") + ("" if self.template == "/" else "/")

    def path(self, **where) -> str:
        """The group's path in a file: RECORD_TABLE.path(k=0) == "/optimizers/0/records"."""
        return self.template.format(**where)

    def at(self, member: str, **where) -> str:
        """The path of a declared member (dataset or group) of this group; KeyError for a name not declared."""
        members = [d.name for d in self.datasets] + [g.name for g in GROUPS if g.parent is self]
        if member not in members:
            raise KeyError(f"{self.template} declares no member {member!r} (it declares {members})")
        return f"{self.path(**where).rstrip('/')}/{member}"

    def dataset(self, name: str) -> Dataset:
        for d in self.datasets:
            if d.name == name:
                return d
        raise KeyError(f"{self.template} declares no dataset {name!r}")

    def attr(self, name: str) -> Attr:
        for a in self.attrs:
            if a.name == name:
                return a
        raise KeyError(f"{self.template} declares no attribute {name!r}")

    @property
    def parent(self) -> "Group | None":
        up = self.template.rsplit("/", 1)[0] or "/"
        return next((g for g in GROUPS if g.template == up), None) if self.template != "/" else None


TENSOR_ATTRS = (Attr(ATTR_TORCH_DTYPE, "string"), Attr(ATTR_SOURCE_DTYPE, "string"))

ROOT = Group(
    "/",
    attrs=(Attr(ATTR_FORMAT, "string"), Attr(ATTR_VERSION, "int"), Attr(ATTR_META, "JSON object"),
           Attr(ATTR_PARAMS_NOT_OPTIMIZED, "JSON list", required=False),
           Attr(ATTR_CLOSED_CLEANLY, "JSON true", required=False),
           Attr(ATTR_RESUMES, "JSON list", required=False)),
    datasets=(Dataset(FLIGHT_DUMPS, STRING, ("D",), "string", chunks=(64,), required=False),
              Dataset(EVENTS, STRING, ("E",), "string", chunks=(256,), required=False)),
)

OPTIMIZERS_GROUP = Group(f"/{OPTIMIZERS}")

OPTIMIZER = Group(f"/{OPTIMIZERS}/{{k}}", attrs=(Attr(ATTR_META, "JSON object"),))

# R: committed records; G: param groups (grows with add_param_group, NaN before a group existed).
RECORD_TABLE = Group(
    f"/{OPTIMIZERS}/{{k}}/{RECORDS}",
    datasets=(
        Dataset(STEP, "int64", ("R",), INTEGERS, chunks=(1024,)),
        Dataset(BACKWARD_PASS, "int64", ("R",), INTEGERS, chunks=(1024,)),
        Dataset(WALL_TIME, "float64", ("R",), NUMBERS, chunks=(1024,)),
        Dataset(LR, "float64", ("R", "G"), FLOATS, chunks=(256, 8), fill=float("nan")),
        Dataset(HPARAMS, STRING, ("R",), "string", chunks=(256,)),
        Dataset(CLOSURE_LOSSES, STRING, ("R",), "string", chunks=(256,), required=False),  # absent in early files
    ),
)

PARAMS_GROUP = Group(f"/{OPTIMIZERS}/{{k}}/{PARAMS}", attrs=(Attr(PARAM_INDEX, "JSON object", required=False),))

# N: rows of this parameter (one per committed record that holds it); S: state keys (grows as keys appear).
PARAMETER = Group(
    f"/{OPTIMIZERS}/{{k}}/{PARAMS}/{{name}}",
    attrs=(Attr(ATTR_META, "JSON object"),),
    datasets=(
        Dataset(RECORD_INDEX, "int64", ("N",), INTEGERS, chunks=(1024,)),
        *(Dataset(kind, STORAGE, ("N", "*shape"), TENSOR_NUMBERS, required=False, attrs=TENSOR_ATTRS)
          for kind in TENSOR_KINDS),
        # Required as soon as the state group lists a key.
        Dataset(STATE_PRESENT, "uint8", ("N", "S"), MASK, chunks=(256, 8), required=False),
    ),
)

STATE = Group(
    f"/{OPTIMIZERS}/{{k}}/{PARAMS}/{{name}}/{STATE_GROUP}",
    attrs=(Attr(STATE_KEYS, "JSON list", required=False),),
    datasets=(Dataset("{key}", STORAGE, ("N", "*state_shape"), TENSOR_NUMBERS, required=False, attrs=TENSOR_ATTRS),),
)

# S: committed statistics rows; G: param groups; P: parameter slots; C: statistic columns (P and C grow).
STATS_TABLE = Group(
    f"/{OPTIMIZERS}/{{k}}/{STATS}",
    attrs=(Attr(STATS_PARAMS, "JSON list"), Attr(STATS_COLUMNS, "JSON list"),
           Attr(STATS_PARAM_META, "JSON object", required=False)),
    datasets=(
        Dataset(STEP, "int64", ("S",), INTEGERS, chunks=(1024,)),
        Dataset(BACKWARD_PASS, "int64", ("S",), INTEGERS, chunks=(1024,)),
        Dataset(WALL_TIME, "float64", ("S",), NUMBERS, chunks=(1024,)),
        Dataset(LR, "float64", ("S", "G"), FLOATS, chunks=(256, 8), fill=float("nan")),
        # The param groups' other hyperparameters (lr is the column above), "" where unchanged from the row before.
        Dataset(HPARAMS, STRING, ("S",), "string", chunks=(256,)),
        # Created at the first row, when P and C are known: chunks of up to 64 rows (writer.py).
        Dataset(VALUES, "float32", ("S", "P", "C"), FLOATS, fill=float("nan")),
    ),
)

# L: committed rows (one per optimizer step that logged something; a step can have several rows, e.g. after a
# resume, and readers merge them, later values winning); C: scalar columns (grows as names appear).
SCALARS_TABLE = Group(
    f"/{OPTIMIZERS}/{{k}}/{SCALARS}",
    attrs=(Attr(SCALAR_COLUMNS, "JSON list"),),
    datasets=(
        Dataset(STEP, "int64", ("L",), INTEGERS, chunks=(1024,)),
        Dataset(WALL_TIME, "float64", ("L",), NUMBERS, chunks=(1024,)),
        Dataset(VALUES, "float64", ("L", "C"), FLOATS, chunks=(256, 8), fill=float("nan")),
    ),
)

GROUPS = (ROOT, OPTIMIZERS_GROUP, OPTIMIZER, RECORD_TABLE, PARAMS_GROUP, PARAMETER, STATE, STATS_TABLE,
          SCALARS_TABLE)
