"""The lock protocol that lets a run be read while it is being written (documented in docs/format.md, "Live reading").

HDF5 without SWMR gives a concurrent reader no consistency: the writer rewrites metadata in place, so a reader can
see half of a flush, or cache a B-tree node that a later flush splits and then miss chunks (read as fill values,
silently). SWMR would fix that but forbids creating datasets after writing starts, which this format needs (state
appears after the first step, param groups are added mid-run). Instead, between two records the file on disk is
exactly what a SIGKILL would leave, and the kill test proves such a file reads in full. So the writer marks the
moments the file is *not* in that state, and a live reader copies the file only outside them:

- ``WRITER_BYTE``: the writer holds an exclusive lock on it for as long as the run is open for writing. A reader
  that cannot take a shared lock on it knows the run is live.
- ``COMMIT_BYTE``: the writer holds it exclusively from its first change to the file until the flush that ends the
  record (or the structural change). A live reader takes it shared while it copies the file, then reads the copy.

Both are open-file-description locks (Linux ``F_OFD_SETLK``) on bytes far beyond the end of the run file, so they
touch no data, conflict between threads and processes alike, do not mix with HDF5's own ``flock`` lock, and vanish
when the process dies (a killed writer leaves no stale lock). Where OFD locks do not exist, ``supported()`` is False
and readers fall back to copying until two size/mtime observations around the copy agree.
"""
from __future__ import annotations

import errno
import os
import struct
import tempfile
import time

try:
    import fcntl
except ImportError:  # pragma: no cover - Windows
    fcntl = None

from .. import lifetime

WRITER_BYTE = 1 << 62
COMMIT_BYTE = WRITER_BYTE + 1

_SETLK = getattr(fcntl, "F_OFD_SETLK", None)


def supported() -> bool:
    return _SETLK is not None


def _flock(kind: int, start: int) -> bytes:
    # struct flock {short l_type; short l_whence; off_t l_start; off_t l_len; pid_t l_pid;} - l_pid must be 0 for
    # OFD locks. Trailing padding so the kernel never reads past the buffer on 64-bit ABIs.
    return struct.pack("hhqqi4x", kind, os.SEEK_SET, start, 1, 0)


def try_lock(fd: int, start: int, exclusive: bool) -> bool:
    """Take a lock on one byte without waiting; False when another holder conflicts."""
    if not supported():
        return True
    try:
        fcntl.fcntl(fd, _SETLK, _flock(fcntl.F_WRLCK if exclusive else fcntl.F_RDLCK, start))
        return True
    except OSError as exc:
        if exc.errno in (errno.EAGAIN, errno.EACCES):
            return False
        raise


def lock(fd: int, start: int, exclusive: bool, timeout: float) -> bool:
    """Take a lock, polling up to `timeout` seconds; False when it stayed taken."""
    deadline = time.monotonic() + timeout
    delay = 0.0005
    while not try_lock(fd, start, exclusive):
        if time.monotonic() >= deadline:
            return False
        time.sleep(delay)
        delay = min(delay * 2, 0.02)
    return True


def unlock(fd: int, start: int) -> None:
    if supported():
        fcntl.fcntl(fd, _SETLK, _flock(fcntl.F_UNLCK, start))


def writer_present(fd: int) -> bool:
    """True while some process (this one included) has the run open for writing."""
    if not supported():
        return False
    try:
        if try_lock(fd, WRITER_BYTE, exclusive=False):
            unlock(fd, WRITER_BYTE)
            return False
    except OSError:  # a filesystem without byte-range locks: no writer can have taken one either
        return False
    return True


class WriterLocks:
    """The writer's side: WRITER_BYTE for life, COMMIT_BYTE around every change until the flush that ends it.

    Waiting for readers is bounded: a reader holds COMMIT_BYTE only while it copies the file; one that holds it
    longer than `patience` seconds (a stopped process) is not allowed to stall training, and the writer goes on
    (the reader's own size/mtime check then catches a copy the writer changed).
    """

    def __init__(self, path: str, patience: float = 30.0):
        self.patience = patience
        self.held = False
        self._fd = -1
        if not supported():
            return
        try:
            self._fd = os.open(path, os.O_RDWR)
        except OSError:
            return  # no locks then: live readers fall back to their copy check
        if not try_lock(self._fd, WRITER_BYTE, exclusive=True):
            os.close(self._fd)
            self._fd = -1
            raise OSError(errno.EBUSY, f"{path} is being written by another recorder")
        lifetime.written_through(self._fd)  # a forked child must not keep the lock's file description alive

    def begin(self) -> None:
        """Before changing the file."""
        if self._fd < 0 or self.held:
            return
        self.held = lock(self._fd, COMMIT_BYTE, exclusive=True, timeout=self.patience)

    def end(self) -> None:
        """Right after a flush that left the file complete."""
        if self._fd >= 0 and self.held:
            unlock(self._fd, COMMIT_BYTE)
            self.held = False

    def close(self) -> None:
        if self._fd >= 0:
            lifetime.no_longer_written(self._fd)
            os.close(self._fd)  # releases both locks
            self._fd = -1
            self.held = False


def _copy(src: int, dst: int, size: int) -> None:
    done = 0
    try:
        while done < size:  # in-kernel copy: no Python buffers, and a reflink where the filesystem has them
            n = os.copy_file_range(src, dst, size - done, done, done)
            if n == 0:
                break
            done += n
        return
    except (AttributeError, OSError):  # other filesystem than the temp folder's on old kernels, or no syscall
        pass
    while done < size:
        chunk = os.pread(src, min(8 << 20, size - done), done)
        if not chunk:
            break
        os.pwrite(dst, chunk, done)
        done += len(chunk)


def snapshot(fd: int, timeout: float, tmpdir: str | None = None, attempts: int = 5) -> int:
    """A copy of the run open at `fd`, taken between two records; returns the fd of an unlinked temporary file.

    Raises TimeoutError when the writer kept the file mid-record for `timeout` seconds, and RuntimeError when the
    file changed during every attempt (a writer that ignores the lock: a platform without OFD locks, or one that
    gave up waiting for a stopped reader).
    """
    deadline = time.monotonic() + timeout
    for _ in range(attempts):
        if not lock(fd, COMMIT_BYTE, exclusive=False, timeout=max(0.0, deadline - time.monotonic())):
            raise TimeoutError(f"the writer stayed inside one record for {timeout:g} s")
        try:
            before = os.fstat(fd)
            with tempfile.TemporaryFile(dir=tmpdir) as tmp:
                _copy(fd, tmp.fileno(), before.st_size)
                copy_fd = os.dup(tmp.fileno())  # the file is unlinked already: it lives as long as this fd
            after = os.fstat(fd)
        finally:
            unlock(fd, COMMIT_BYTE)
        if (before.st_size, before.st_mtime_ns) == (after.st_size, after.st_mtime_ns) and \
                os.fstat(copy_fd).st_size == before.st_size:
            return copy_fd
        os.close(copy_fd)
    raise RuntimeError(f"the file changed during each of {attempts} copies")
