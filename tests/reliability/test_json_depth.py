"""JSON nesting is bounded when parsing (upd.runfile.encoding.from_json): metadata nested ~900 deep parsed, then
raised RecursionError in `upd info`'s text cleaning. The depth is counted on the text, brackets inside strings (with
escaped quotes) not counted."""
import json

import pytest

from upd.runfile import encoding

CASES = [('[1, {"a": [2]}]', 3), ('{"x": "[[[[[[", "y": "\\"[[["}', 1), ("17", 0), ('"[["', 0),
         ('["a\\\\", [[1]]]', 3), ('["\\\\\\"[[[", 1]', 1), ('{"k]]]": [[[]]]}', 4), ("[]", 1)]


@pytest.mark.parametrize("text, depth", CASES)
def test_depth_counts_brackets_outside_strings(text, depth):
    json.loads(text)  # each case is valid JSON
    assert encoding.json_depth(text) == depth


@pytest.mark.parametrize("text", ["[" * 101 + "]" * 101, "[" * 900 + "0" + "]" * 900, "[" * 50_000,
                                  json.dumps({"argv": "x"}).replace('"x"', "[" * 200 + "]" * 200)])
def test_deeper_than_the_limit_is_refused_before_parsing(text):
    with pytest.raises(ValueError, match="nested deeper"):
        encoding.from_json(text)


def test_the_limit_itself_parses():
    assert encoding.from_json("[" * encoding.MAX_JSON_DEPTH + "]" * encoding.MAX_JSON_DEPTH) is not None
