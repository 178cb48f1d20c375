"""Benchmarks: run each from the repository root as a module, `python -m benchmarks.NAME` (benchmarks/README.md), so
that the code they share with the tests imports as `tests.harness`."""
