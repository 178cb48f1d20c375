"""Text from a run file, made safe for where torch-upd shows it: a terminal, a spreadsheet, a plot.

Parameter names, the optimizer's class, torch_version and every other string in a run file are the file's to
choose, and run files get shared. Printed raw, a name holding ``ESC [2J`` clears the user's screen, ``ESC ]0;...BEL``
retitles the window, ``\\r`` overwrites a line and ``\\n`` prints a line of the file's choosing; written raw into a
CSV cell, ``=HYPERLINK(...)`` runs as a formula when the spreadsheet opens it; in a plot, ``$...$`` is parsed as
mathtext. Every command passes file-derived text through one of these functions at the point it leaves for the
terminal, a CSV file or a plot (docs/reliability.md, "Text from a run file"). The Python API returns the real strings.
"""
from __future__ import annotations

import unicodedata

import pandas as pd

# Unicode's bidirectional overrides and isolates reorder what follows them on screen ("Trojan Source"): shown escaped.
_BIDI_CONTROLS = frozenset("\u061c\u200e\u200f\u202a\u202b\u202c\u202d\u202e\u2066\u2067\u2068\u2069")
_ESCAPES = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# A spreadsheet evaluates a cell starting with one of these as a formula (OWASP, "CSV Injection").
_FORMULA_STARTS = ("=", "+", "-", "@", "\t", "\r")
PLOT_LABEL_CHARS = 80


def _escape(ch: str) -> str:
    if ch in _ESCAPES:
        return _ESCAPES[ch]
    code = ord(ch)
    return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}" if code < 0x10000 else f"\\U{code:08x}"


def _unsafe(ch: str) -> bool:
    # Cc: C0 and C1 controls and DEL (ESC, BEL, CSI...); Zl/Zp: line and paragraph separators; Cs: a lone surrogate
    # (an undecodable byte, as Python keeps it), which a terminal cannot be given at all.
    return unicodedata.category(ch) in ("Cc", "Zl", "Zp", "Cs") or ch in _BIDI_CONTROLS


def terminal_safe(text) -> str:
    """`text` with every control character shown as a visible escape (``\\x1b``, ``\\n``, ``\\u202e``): one line
    that cannot move the cursor, change colours, retitle the window or hide what follows. Not a string: str() of it."""
    text = text if isinstance(text, str) else str(text)
    if text.isprintable() and text.isascii():  # the common case, at C speed
        return text
    return "".join(_escape(ch) if _unsafe(ch) else ch for ch in text)


def terminal_safe_data(value):
    """terminal_safe applied to every string (keys too) inside nested dicts, lists and tuples."""
    if isinstance(value, str):
        return terminal_safe(value)
    if isinstance(value, dict):
        return {terminal_safe_data(k): terminal_safe_data(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(terminal_safe_data(v) for v in value)
    return value


def _map_strings(frame: pd.DataFrame, fn) -> pd.DataFrame:
    out = frame.copy()
    for column in out.columns:
        if out[column].dtype == object or pd.api.types.is_string_dtype(out[column]):
            out[column] = out[column].map(lambda v: fn(v) if isinstance(v, str) else v)
    return out


def terminal_safe_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of `frame` whose string cells are terminal_safe (for to_string and the like)."""
    return _map_strings(frame, terminal_safe)


def csv_safe(cell: str) -> str:
    """A CSV cell a spreadsheet shows as text: one starting with ``= + - @``, a tab or a carriage return is
    prefixed with an apostrophe (the spreadsheet-safe convention; the apostrophe is not displayed)."""
    return "'" + cell if cell.startswith(_FORMULA_STARTS) else cell


def csv_safe_frame(frame: pd.DataFrame) -> pd.DataFrame:
    """A copy of `frame` whose string cells are csv_safe; numbers (a negative ratio) stay numbers."""
    return _map_strings(frame, csv_safe)


def plot_label(text, limit: int = PLOT_LABEL_CHARS) -> str:
    """A name as a matplotlib label: terminal_safe, ``$`` escaped (no mathtext), a leading ``_`` kept visible (the
    legend would drop it), at most `limit` characters (a 200,000-character name takes minutes to lay out)."""
    text = terminal_safe(text).replace("$", r"\$")
    if len(text) > limit:
        text = text[:limit - 1] + "\u2026"
    return " " + text if text.startswith("_") else text


# -- bounded text tables for the terminal ---------------------------------------------------------------------------
# Names are not bounded in a run file (a stranger's may hold a 1 MB one): what the commands print is bounded per cell,
# so a table's width never follows the longest name, and its size grows with the number of rows alone.
TABLE_WIDTH = 100  # the terminal tables fit this many columns unless --wide
NAME_CHARS = 40  # a name longer than this is shortened in the middle (its start and its end kept), marked with ELLIPSIS
WIDE_CELL_CHARS = 200  # with --wide: every column, and cells up to this long
MIN_NAME_CHARS = 16  # what a name column is never shortened below to fit TABLE_WIDTH
ELLIPSIS = "\u2026"


def shorten(text, limit: int = NAME_CHARS) -> str:
    """`text` terminal_safe and at most `limit` characters: a longer one keeps its start and its end around an
    ELLIPSIS ("model.layers.1…self_attn.q_proj.weight"). Time bounded by `limit`, not by the text's length."""
    text = text if isinstance(text, str) else str(text)
    if len(text) > 8 * limit:  # escaping at most multiplies the length by 10: escape only what can be shown
        text = text[:4 * limit] + ELLIPSIS + text[-4 * limit:]
    text = terminal_safe(text)
    if len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - 1 - head
    return text[:head] + ELLIPSIS + (text[-tail:] if tail else "")


LISTED_NAMES = 20  # names a line lists before "and N more" (--json and the tables have every one)


def shorten_all(names, limit: int = NAME_CHARS, most: int = LISTED_NAMES) -> str:
    """A comma-separated list of the first `most` names, each shortened, then how many more there are: a line
    bounded whatever the number and the length of the names."""
    names = list(names)
    more = f", and {len(names) - most} more" if len(names) > most else ""
    return ", ".join(shorten(n, limit) for n in names[:most]) + more


def _cell(value, fmt) -> str:
    if fmt is not None and not (value is None or value is pd.NA or (isinstance(value, float) and value != value)):
        return fmt(value)
    if value is None or value is pd.NA or (isinstance(value, float) and value != value):
        return "-"
    if isinstance(value, float):
        return f"{value:.2f}"
    return str(value)


def _header_lines(header: str, width: int) -> list[str]:
    """A header on one line, or on two split at a space when it is wider than its column's cells."""
    header = header.strip()  # a trailing space only tells two equal headers apart
    if len(header) <= width or " " not in header:
        return [header]
    splits = [i for i, ch in enumerate(header) if ch == " "]
    i = min(splits, key=lambda i: max(i, len(header) - i - 1))
    return [header[:i], header[i + 1:]]


def text_table(frame: pd.DataFrame, *, formats: dict | None = None, keep=(), drop=(), names=("param",),
               wide: bool = False, width: int = TABLE_WIDTH, wrap_headers: bool = True) -> str:
    """`frame` as an aligned text table (text left-aligned, numbers right), every cell terminal_safe and bounded.

    Without `wide` the table fits `width` columns: the columns not in `keep` are left out, those in `drop` first
    (in its order), then from the last one back, until it fits (a last line names them and says --wide shows them), then the `names` columns are shortened in the
    middle, down to MIN_NAME_CHARS. With `wide`: every column, cells up to WIDE_CELL_CHARS. `formats`: column ->
    function of a present value (missing values show as "-"; floats default to 2 decimals). wrap_headers: a header
    wider than its cells goes on two lines, split at a space (False: one line, a header that is a formula)."""
    formats = formats or {}
    columns = list(frame.columns)
    numeric = {c: pd.api.types.is_numeric_dtype(frame[c]) and not pd.api.types.is_bool_dtype(frame[c])
               for c in columns}
    limit = WIDE_CELL_CHARS if wide else NAME_CHARS
    raw = {c: [_cell(v, formats.get(c)) for v in frame[c].tolist()] for c in columns}
    cells = {c: [shorten(v, limit) for v in raw[c]] for c in columns}
    headers = {c: shorten(c, limit) for c in columns}

    def split(header, cells_width):
        return _header_lines(header, cells_width) if wrap_headers else [header.strip()]

    def column_width(c):
        body = max((len(v) for v in cells[c]), default=0)
        return max([body] + [len(h) for h in split(headers[c], max(body, 1))])

    widths = {c: column_width(c) for c in columns}
    total = lambda shown: sum(widths[c] for c in shown) + 2 * (len(shown) - 1)  # noqa: E731
    shown, left_out = list(columns), []
    if not wide:
        for c in [*(c for c in drop if c in columns), *(c for c in reversed(columns) if c not in drop)]:
            if total(shown) <= width:
                break
            if c not in keep and c not in names:
                shown.remove(c)
                left_out.append(c)
        left_out.sort(key=columns.index)
        over = total(shown) - width
        for c in (c for c in names if c in shown):
            if over <= 0:
                break
            new = max(MIN_NAME_CHARS, widths[c] - over)
            if new < widths[c]:
                cells[c] = [shorten(v, new) for v in raw[c]]
                headers[c] = shorten(c, new)
                over -= widths[c] - column_width(c)
                widths[c] = column_width(c)
    header_rows = [split(headers[c], widths[c]) for c in shown]
    depth = max((len(h) for h in header_rows), default=1)
    header_rows = [[""] * (depth - len(h)) + h for h in header_rows]

    def line(values):
        return "  ".join((v.rjust(widths[c]) if numeric[c] else v.ljust(widths[c]))
                         for c, v in zip(shown, values)).rstrip()

    lines = [line([h[i] for h in header_rows]) for i in range(depth)]
    lines += [line([cells[c][i] for c in shown]) for i in range(len(frame))]
    if left_out:
        lines.append(f"(left out to fit {width} columns: {', '.join(shorten(c, limit) for c in left_out)}; "
                     "--wide shows every column)")
    return "\n".join(lines)
