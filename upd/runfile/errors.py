"""The one error a reader of run files raises, and the I/O edge that turns library errors into it.

Every reader entry point promises one line naming the file and the problem (docs/reliability.md): whatever h5py,
numpy or the JSON decoder raise while a part of the file is read becomes a RunFileError here, and nowhere else.
"""
from __future__ import annotations


class RunFileError(Exception):
    """The file cannot be used as a torch-upd run. The message is one line naming the file and the problem."""

    def __init__(self, message="", *args):
        # One line, whatever an underlying library put into the text.
        super().__init__(" ".join(str(message).splitlines()), *args)


def phrase(exc: BaseException) -> str:
    """An exception as a short one-line phrase for a RunFileError message."""
    if isinstance(exc, MemoryError):  # a valid but large run on a small machine: say so, not numpy's wording
        return "not enough memory for it on this machine"
    text = " ".join(str(exc).split())
    if len(text) > 200:
        text = text[:200] + "..."
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


class Reading:
    """Context manager at the I/O edge: any error from h5py, numpy or JSON decoding while reading a part of the
    file becomes a RunFileError naming the file and that part. Wraps reads only, never the caller's own errors.

    raw: the file as HDF5 reads it (guards.GuardedFile), when it is read in place: a read after the file changed
    under the reader is refused rather than mixed with cached metadata."""

    __slots__ = ("path", "what", "raw")

    def __init__(self, path: str, what: str, raw=None):
        self.path, self.what, self.raw = path, what, raw

    def __enter__(self) -> None:
        if self.raw is not None and self.raw.changed_under_us():
            raise RunFileError(f"{self.path}: the file changed after it was opened (a recorder resumed it, or "
                               "something rewrote it); open it again to read it")
        return None

    def __exit__(self, etype, exc, tb) -> bool:
        if exc is None or isinstance(exc, RunFileError) or not isinstance(exc, Exception):
            return False
        raise RunFileError(f"{self.path}: cannot read {self.what} ({phrase(exc)})") from exc
