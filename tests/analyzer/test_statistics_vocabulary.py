"""upd.statistics: every statistic has a merge rule, and merging shards by the rules gives the whole tensor's."""
import numpy as np
import pytest

from upd import statistics as S


def recorded(x: np.ndarray) -> dict:
    """The full set of one tensor, computed directly (float64), as (1,) arrays."""
    n = x.size
    return {S.MEAN: [x.mean()], S.STD: [x.std(ddof=1) if n > 1 else np.nan], S.NORM: [np.sqrt((x * x).sum())],
            S.ABSMAX: [np.abs(x).max()], S.ZERO_FRAC: [(x == 0).mean()], S.NONFINITE: [0.0]}


def test_every_statistic_has_a_rule_the_merge_implements():
    assert set(S.MERGE) == set(S.STATS)
    assert set(S.MERGE.values()) <= {S.WEIGHTED_MEAN, S.POOLED_STD, S.ROOT_SUM_SQUARES, S.MAXIMUM, S.COUNT_FRACTION,
                                     S.SUM}
    assert all(S.split_column(c)[0] in S.LEAN_KINDS for c in S.LIVE_COLUMNS if c not in S.RATIOS)
    assert S.split_column(S.column("state.exp_avg", S.ZERO_FRAC)) == ("state.exp_avg", S.ZERO_FRAC)


@pytest.mark.parametrize("sizes", [(5, 7, 1, 13), (1, 1), (2000, 3)])
def test_shards_merged_by_the_rules_give_the_whole_tensors_statistics(sizes):
    rng = np.random.default_rng(0)
    x = 3.0 + rng.standard_normal(sum(sizes))  # |mean| > std: the spread must not cancel
    x[::4] = 0.0
    total = None
    for part in np.split(x, np.cumsum(sizes)[:-1]):
        total = S.merge(total, S.sufficient(part.size, recorded(part)))
    got, expected = S.finish(total, 1), recorded(x)
    for stat in S.STATS:
        assert got[stat][0] == pytest.approx(expected[stat][0], rel=1e-12), stat
    assert np.isnan(S.finish(None, 1)[S.STD]).all()
