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
