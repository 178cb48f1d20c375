"""The test suite. A package so that `tests.harness`, the code tests and benchmarks share, imports by one name."""
