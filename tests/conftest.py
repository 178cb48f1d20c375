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
