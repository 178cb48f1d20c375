"""Fixtures shared by every test folder. Shared code that is not a fixture (models, training loops, paths) lives in
tests/harness/, which tests import by name."""
import os
import shutil

import pytest

from tests.harness.paths import SAMPLE_DIR


@pytest.fixture
def sample_copy(tmp_path):
    """A writable copy of a committed sample run."""
    def copy(name):
        dst = tmp_path / name
        shutil.copy(os.path.join(SAMPLE_DIR, name), dst)
        return str(dst)
    return copy


@pytest.fixture
def cpu_mesh(tmp_path):
    """A one-process gloo process group and its DeviceMesh("cpu", [0]), destroyed after the test."""
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with the gloo backend is not available in this torch build")
    from torch.distributed.device_mesh import DeviceMesh

    dist.init_process_group("gloo", store=dist.FileStore(str(tmp_path / "store"), 1), rank=0, world_size=1)
    try:
        yield DeviceMesh("cpu", [0])
    finally:
        dist.destroy_process_group()
