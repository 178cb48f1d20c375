"""Sorting rows into model order costs memory by rows, never by the longest name: a run file's names are the file's
to choose. Before, in_model_order built a fixed-width '<U{longest}' copy of the name column (rows x longest name x 4
bytes: a 20,001-name statistics run with one 4096-character name made analyze take 2.03 GB instead of 452 MB)."""
import tracemalloc

import numpy as np
import pandas as pd

from upd.runfile.stats_table import in_model_order

LONG = "L" * 10_000


def test_model_order_sorts_by_codes_not_a_fixed_width_copy_of_the_names():
    rows = 2_000  # a '<U10000' copy of 2,000 names: 80 MB
    names = [f"p{i % 100}" for i in range(rows - 1)] + [LONG]
    table = pd.DataFrame({"optimizer": 0, "param": names, "step": np.arange(rows)[::-1]})
    metas = {0: {f"p{i}": {"group": 0, "index_in_group": 99 - i} for i in range(100)}}  # LONG has none: it goes last
    tracemalloc.start()
    try:
        out = in_model_order(table, metas)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert peak < 8 << 20, f"{peak / 2 ** 20:.0f} MiB"
    assert list(dict.fromkeys(out["param"])) == [f"p{i}" for i in range(99, -1, -1)] + [LONG]
    assert all(part["step"].is_monotonic_increasing for _, part in out.groupby("param"))
