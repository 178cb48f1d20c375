"""Analysis of a recorded run: the ratio table, the per-parameter health summary, and the plots."""
