"""The parameter index: what every parameter group of an optimizer holds, listed in one attribute.

Listing a run's parameters from their own groups costs, per parameter, four HDF5 object opens and three attribute
reads, each through the checked file object (guards.GuardedFile): `upd info` on 5,000 one-element parameters took
17 s for a listing it could read from one place. So the recorder, when it closes a run, writes on each optimizer's
``params`` group one JSON attribute (schema.PARAM_INDEX) listing every parameter: its group's name, its ``meta``, its
committed rows, its tensor kinds with their storage dtypes and its state keys. A reader lists the parameters from it
and opens a parameter's group only when it reads that parameter's data.

The index repeats what the groups hold; it is an untrusted file's word like any other (docs/reliability.md):
- an index that cannot be used as a whole (not JSON, not this layout, written for another number of records, naming
  other groups than the params group holds) is ignored: the run is read from its groups, as a file without one;
- an index that is well-formed but wrong about a parameter is what `upd info` shows (it reads nothing else), and is
  checked against that parameter's group when its data is first read: a disagreement refuses the file in one line.
"""
from __future__ import annotations

from typing import NamedTuple

from . import schema
from .schema import (INDEX_KEY as KEY, INDEX_KINDS as KINDS, INDEX_META as META, INDEX_PARAMS as PARAMS,
                     INDEX_RECORDS as RECORDS, INDEX_ROWS as ROWS, INDEX_STATE_KEYS as STATE_KEYS)

__all__ = ["KEY", "KINDS", "META", "PARAMS", "RECORDS", "ROWS", "STATE_KEYS", "Listed", "entry", "document", "parse",
           "disagreement"]
MAX_DTYPE_NAME = 40  # "bfloat16", "complex128": names are short; a longer one is not a dtype name


class Listed(NamedTuple):
    """One parameter as the index lists it: its group's name, metadata, committed rows, {kind: storage dtype}, and
    state keys in the column order of its state_present."""

    key: str
    meta: dict
    rows: int
    kinds: dict
    state_keys: list


def entry(key: str, meta: dict) -> dict:
    """A new parameter's entry, before its first row."""
    return {KEY: key, META: meta, ROWS: 0, KINDS: {}, STATE_KEYS: []}


def document(records: int, entries) -> dict:
    """The attribute's JSON value: the number of committed records it describes and one entry per parameter."""
    return {RECORDS: records, PARAMS: list(entries)}


def parse(value, records: int, members: set, meta_problem) -> dict[str, Listed] | str:
    """{group name: Listed} from the decoded attribute, or why it cannot be used as a whole (then it is ignored).

    records: the optimizer's committed records (an index written for another number is stale: a run resumed by a
    recorder that did not rewrite it); members: the names the params group holds; meta_problem(meta): why a
    parameter's metadata is not acceptable (validate.meta_problem), or None."""
    if not isinstance(value, dict) or not isinstance(value.get(PARAMS), list):
        return "not a JSON object with a list of parameters"
    if value.get(RECORDS) != records or isinstance(value.get(RECORDS), bool):
        return f"written for {str(value.get(RECORDS))[:20]} records, the file has {records}"
    listed: dict[str, Listed] = {}
    for item in value[PARAMS]:
        problem = _entry_problem(item, records, meta_problem)
        if problem:
            return problem
        if item[KEY] in listed:
            return f"lists {item[KEY][:80]!r} twice"
        listed[item[KEY]] = Listed(item[KEY], item[META], item[ROWS], dict(item[KINDS]), list(item[STATE_KEYS]))
    if set(listed) != members:
        return f"lists {len(listed)} parameters, the group holds {len(members)} others"
    return listed


def _entry_problem(item, records: int, meta_problem) -> str | None:
    if not isinstance(item, dict) or not isinstance(item.get(KEY), str) or not isinstance(item.get(META), dict):
        return "an entry is not an object with a key and a meta object"
    rows, kinds, keys = item.get(ROWS), item.get(KINDS), item.get(STATE_KEYS)
    if not (isinstance(rows, int) and not isinstance(rows, bool) and 0 <= rows <= records):
        return f"{item[KEY][:80]!r}: rows {str(rows)[:20]} is not a count of committed records"
    if not isinstance(kinds, dict) or not all(k in schema.TENSOR_KINDS and isinstance(d, str)
                                              and len(d) <= MAX_DTYPE_NAME for k, d in kinds.items()):
        return f"{item[KEY][:80]!r}: kinds is not an object of tensor kinds and dtype names"
    if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys) and len(set(keys)) == len(keys)):
        return f"{item[KEY][:80]!r}: state_keys is not a list of distinct names"
    problem = meta_problem(item[META])
    return f"{item[KEY][:80]!r}: metadata {problem}" if problem else None


def disagreement(listed: Listed, rows: int, kinds: list, state_keys: list) -> str | None:
    """How a parameter's group disagrees with its entry (rows committed, kinds present, state keys), or None."""
    if rows != listed.rows:
        return f"the index lists {listed.rows} rows, the group holds {rows}"
    if sorted(kinds) != sorted(listed.kinds):
        return f"the index lists kinds {sorted(listed.kinds)}, the group holds {sorted(kinds)}"
    if list(state_keys) != listed.state_keys:
        return f"the index lists state keys {listed.state_keys[:8]}, the group holds {list(state_keys)[:8]}"
    return None
