"""Code that the tests and the benchmarks share, importable by one name from the repository root.

    from tests.harness.training import MLP, train_steps

- `paths`: where the repository and its committed sample runs are.
- `training`: the little models and real training loops most tests record.
- `cases` and `replay_matrix`: every optimizer configuration the replay matrix records and verifies.
- `kill`, `live`, `disk_full`: the cross-process experiments (SIGKILL a recording process, read a run while another
  process writes it, fill the disk under one); the tests run a few trials, `python -m benchmarks.NAME` many.

pytest finds this package through `pythonpath = ["."]` in pyproject.toml; the benchmarks run as modules
(`python -m benchmarks.kill_test`) from the repository root, which puts the root on sys.path.
"""
