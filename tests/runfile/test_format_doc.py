"""docs/format.md states the schema of upd/runfile/schema.py: every declared group has its section, every declared
dataset and attribute its table row with the declared shape and dtype, and no row names something undeclared."""
import os

from upd.runfile import schema

from tests.harness.paths import REPO_ROOT

FORMAT_MD = os.path.join(REPO_ROOT, "docs", "format.md")


def _member(name: str) -> str:
    return name.replace("{", "<").replace("}", ">")  # "{key}" in the schema is "<key>" in the doc


def expected_rows(group: schema.Group) -> dict[str, str]:
    """{first cell: second cell} of the rows a group's section must have."""
    rows = {f"attr `{a.name}`": a.type for a in group.attrs}
    for d in group.datasets:
        rows[f"`{_member(d.name)}`"] = f"`{d.shape_text}` {d.dtype}"
        rows.update({f"attr `{a.name}`": a.type for a in d.attrs})
    return rows


def sections(text: str) -> dict[str, list[str]]:
    """{heading line: the lines up to the next heading of any level}."""
    out, heading = {}, None
    for line in text.splitlines():
        if line.startswith("#"):
            heading = line
            out[heading] = []
        elif heading is not None:
            out[heading].append(line)
    return out


def table_rows(lines: list[str]) -> dict[str, str]:
    """{first cell: second cell} of the table rows in lines, header rows left out."""
    rows, cells = {}, [[c.strip() for c in line.strip().strip("|").split("|")] for line in lines
                       if line.startswith("|")]
    for i, row in enumerate(cells):
        is_header = i + 1 < len(cells) and set("".join(cells[i + 1])) <= set("-: ")
        if not is_header and not set("".join(row)) <= set("-: ") and len(row) >= 2:
            rows[row[0]] = row[1]
    return rows


def doc_problems(text: str) -> list[str]:
    """Where the doc text and the schema disagree; empty when they agree."""
    problems, found = [], sections(text)
    for group in schema.GROUPS:
        expected = expected_rows(group)
        if not expected:
            continue  # a group with no attributes or datasets of its own (/optimizers/, .../params/)
        heading = [h for h in found if f"`{group.doc_path}`" in h]
        if len(heading) != 1:
            problems.append(f"{group.doc_path}: {len(heading)} sections name it, expected 1")
            continue
        rows = table_rows(found[heading[0]])
        for first, second in expected.items():
            if first not in rows:
                problems.append(f"{group.doc_path}: no row for {first} ({second})")
            elif rows[first] != second:
                problems.append(f"{group.doc_path}: {first} is documented as {rows[first]!r}, declared as {second!r}")
        problems += [f"{group.doc_path}: row {first} is not declared in schema.py" for first in rows
                     if first not in expected]
    return problems


def read_doc() -> str:
    with open(FORMAT_MD, encoding="utf-8") as f:
        return f.read()


def test_format_md_states_the_schema():
    assert doc_problems(read_doc()) == []


def test_every_declared_name_is_checked():
    """Each dataset and attribute of the schema is in some group's expected rows: nothing escapes the check."""
    expected = {first for group in schema.GROUPS for first in expected_rows(group)}
    for name in (schema.STEP, schema.CLOSURE_LOSSES, schema.VALUES, schema.STATE_PRESENT, schema.RECORD_INDEX,
                 schema.FLIGHT_DUMPS, *schema.TENSOR_KINDS):
        assert f"`{name}`" in expected
    for name in (schema.ATTR_FORMAT, schema.ATTR_VERSION, schema.ATTR_META, schema.ATTR_CLOSED_CLEANLY,
                 schema.ATTR_RESUMES, schema.ATTR_PARAMS_NOT_OPTIMIZED, schema.STATE_KEYS, schema.STATS_PARAM_META,
                 schema.ATTR_TORCH_DTYPE, schema.ATTR_SOURCE_DTYPE):
        assert f"attr `{name}`" in expected


def test_a_name_missing_from_the_doc_fails():
    text = read_doc()
    row = next(line for line in text.splitlines() if line.startswith("| `closure_losses` |"))
    problems = doc_problems(text.replace(row + "\n", ""))
    assert problems == ["/optimizers/<k>/records/: no row for `closure_losses` (`(R,)` UTF-8 string)"]


def test_a_wrong_dtype_or_shape_in_the_doc_fails():
    text = read_doc()
    wrong_dtype = text.replace("| `step` | `(R,)` int64 |", "| `step` | `(R,)` int32 |")
    assert doc_problems(wrong_dtype) == [
        "/optimizers/<k>/records/: `step` is documented as '`(R,)` int32', declared as '`(R,)` int64'"]
    wrong_shape = text.replace("| `values` | `(S, P, C)` float32 |", "| `values` | `(S, P)` float32 |")
    assert len(doc_problems(wrong_shape)) == 1 and "`values`" in doc_problems(wrong_shape)[0]
    wrong_type = text.replace("| attr `keys` | JSON list |", "| attr `keys` | JSON object |")
    assert len(doc_problems(wrong_type)) == 1 and "attr `keys`" in doc_problems(wrong_type)[0]


def test_a_row_the_schema_does_not_declare_fails():
    text = read_doc()
    row = next(line for line in text.splitlines() if line.startswith("| `wall_time` | `(R,)` float64 |"))
    problems = doc_problems(text.replace(row, row + "\n| `loss` | `(R,)` float64 | the training loss |"))
    assert problems == ["/optimizers/<k>/records/: row `loss` is not declared in schema.py"]


def test_a_missing_section_fails():
    text = read_doc()
    heading = next(line for line in text.splitlines() if "`/optimizers/<k>/stats/`" in line)
    problems = doc_problems(text.replace(heading, "### Statistics"))
    assert problems == ["/optimizers/<k>/stats/: 0 sections name it, expected 1"]


def test_the_doc_points_nowhere_outside_the_repository():
    assert "../shared" not in read_doc()
