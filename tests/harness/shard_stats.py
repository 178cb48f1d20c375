"""Statistics of shards combined, in the shapes the tests state them: built on upd.runfile.shard_stats, which
combines them inside a job's reader (Job.stats) without these conveniences."""
from __future__ import annotations

import numpy as np
import pandas as pd

from upd.runfile.shard_stats import ShardCombiner
from upd.statistics import finish, merge, sufficient


def combine_tensor_stats(counts, stats: dict) -> dict:
    """The statistics of the concatenation of shards, from each shard's.

    counts: (H,) elements of each shard (0 for an empty shard, which contributes nothing). stats: {stat: (H, S)
    array} with the names of ``upd.statistics.STATS``; returns {stat: (S,) array}. NaN in a shard's statistic (NaN/Inf
    values, a count not taken) makes the combined statistic NaN, as it is on the whole tensor."""
    rows = np.asarray(next(iter(stats.values()))).shape[1]
    total = None
    for i, count in enumerate(counts):
        if count > 0:
            total = merge(total, sufficient(int(count), {k: np.asarray(v)[i] for k, v in stats.items()}))
    return finish(total, rows)


def combine_shard_frames(shards: list[tuple[int, pd.DataFrame]]) -> pd.DataFrame:
    """One parameter's statistics rows combined over its shards: (element count, rows) each, at the steps all have."""
    if not shards:
        return pd.DataFrame(columns=["step", "lr"])
    steps = shards[0][1]["step"].to_numpy()
    combiner = ShardCombiner(np.unique(steps))
    for count, frame in shards:
        combiner.add(count, frame)
    return combiner.frame()
