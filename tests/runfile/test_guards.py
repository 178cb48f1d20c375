"""The superblock parsing the writer (end of allocation) and the reader (address sizes) share."""
import os

import h5py
import numpy as np

from upd.runfile import schema
from upd.runfile.guards import SUPERBLOCK_BYTES, find_superblock, parse_superblock


def _head(path: str, at: int = 0) -> bytes:
    with open(path, "rb") as f:
        f.seek(at)
        return f.read(SUPERBLOCK_BYTES)


def test_end_of_allocation_of_a_closed_file_is_its_length(tmp_path):
    path = str(tmp_path / "plain.h5")
    with h5py.File(path, "w") as f:  # HDF5's default file format: superblock version 0
        f["x"] = np.arange(1000.0)
    found = parse_superblock(_head(path))
    assert (found.version, found.offset_size, found.length_size) == (0, 8, 8)
    assert found.end_of_allocation == os.path.getsize(path)


def test_version_1_keeps_its_addresses_4_bytes_later(tmp_path):
    """h5py cannot ask HDF5 for a version 1 superblock (a non-default indexed storage K): the same superblock as
    version 1 is version 0's bytes with the version byte set and K plus 2 reserved bytes before the addresses."""
    path = str(tmp_path / "plain.h5")
    with h5py.File(path, "w") as f:
        f["x"] = np.arange(1000.0)
    v0 = _head(path)
    v1 = v0[:8] + b"\x01" + v0[9:24] + (32).to_bytes(2, "little") + bytes(2) + v0[24:]
    found = parse_superblock(v1)
    assert found.version == 1 and found.end_of_allocation == os.path.getsize(path)


def test_newer_versions_give_sizes_but_no_end_of_allocation(tmp_path):
    path = str(tmp_path / "latest.h5")
    with h5py.File(path, "w", libver="latest") as f:
        f["x"] = np.arange(10.0)
    found = parse_superblock(_head(path))
    assert found.version >= 2 and (found.offset_size, found.length_size) == (8, 8)
    assert found.end_of_allocation is None


def test_the_reader_finds_a_superblock_after_a_user_block(tmp_path):
    path = str(tmp_path / "userblock.h5")
    with h5py.File(path, "w", userblock_size=1024) as f:
        f["x"] = np.arange(10.0)
    assert parse_superblock(_head(path)) is None  # not at byte 0: the writer's files always start with it
    fd = os.open(path, os.O_RDONLY)
    try:
        found = find_superblock(fd, os.path.getsize(path))
    finally:
        os.close(fd)
    assert found is not None and found.offset_size == 8


def test_no_superblock_in_other_bytes():
    assert parse_superblock(b"") is None
    assert parse_superblock(b"not an HDF5 file at all, just text") is None
    assert parse_superblock(schema.HDF5_SIGNATURE) is None  # too short to hold the sizes
