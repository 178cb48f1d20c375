"""Files torch-upd writes for the user (plots, CSV tables), created where the user said and nowhere else.

`upd analyze --out DIR` writes fixed names (summary.csv, update_to_data.png, ...) into a folder that may hold what
someone else put there: a symlink named summary.csv pointing at ~/.bashrc would have the write land in ~/.bashrc, and
a hard link would have it overwrite the linked file in place. So an output file is never opened by its name: it is
written as a new temporary file in the folder (O_EXCL, O_NOFOLLOW, relative to the folder's descriptor) and then
renamed over the name, which replaces whatever link was there instead of writing through it. A name that is a
folder, a device or a FIFO is refused, not replaced. The folder itself is the user's (a link to a folder named on
the command line is followed). A failure says what went wrong in one line (OutputError); docs/reliability.md, "Output
files".

Only a path the user typed may be followed. A default derived from the run's name (``run-analysis/`` next to
``run.h5``) is never followed when it is a symlink: a link shipped with the run would send the outputs, and the
replacement of files of the same names, anywhere (`derived_folder`). And no output replaces an input: ``upd analyze
run.h5 --csv run.h5`` would replace the run with its table (`refuse_inputs`).
"""
from __future__ import annotations

import errno
import os
import secrets
import stat
from contextlib import contextmanager

import pandas as pd

from .runfile.ranks import rank_files
from .safe_text import csv_safe_frame


class OutputError(OSError):
    """An output file or folder cannot be written; the message is one line naming it and why."""


def _reason(exc: OSError) -> str:
    return exc.strerror or str(exc) or type(exc).__name__


def derived_folder(base: str, suffix: str) -> str:
    """The default output folder of the file `base` (its name without the extension, plus `suffix`); OutputError
    when that name is a symlink, which is never followed since the user did not type it."""
    folder = os.path.splitext(os.fspath(base))[0] + suffix
    if os.path.islink(folder):
        raise OutputError(f"{folder}: the default output folder is a symbolic link, which is never followed; "
                          "give the folder to write into with --out")
    return folder


def input_files(run_paths) -> list[str]:
    """The files the runs `run_paths` are read from: each path, and the rank files of a distributed job's path."""
    files = []
    for path in run_paths:
        files.append(os.fspath(path))
        try:
            files.extend(rank_files(path)[1].values())
        except ValueError:  # ambiguous rank files: the reader refuses them; nothing of them is replaced here
            pass
    return files


def refuse_inputs(outputs, inputs) -> None:
    """OutputError when an output path (a name to be replaced) is one of the input files (same file, by device and
    inode, whatever the spelling of the path); paths that do not exist yet are not inputs."""
    read = set()
    for path in inputs:
        try:
            st = os.stat(path)
        except OSError:
            continue
        read.add((st.st_dev, st.st_ino))
    for path in outputs:
        if not path:
            continue
        try:
            st = os.lstat(path)  # the name itself: replacing a link to an input leaves the input alone
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in read:
            raise OutputError(f"{path}: is an input file of this command; refusing to replace it with an output")


def make_output_dir(folder: str) -> str:
    """Create `folder` (and its parents) if needed; OutputError when it cannot be, or is not a folder."""
    try:
        os.makedirs(folder, exist_ok=True)
    except FileExistsError:
        raise OutputError(f"{folder}: exists and is not a folder") from None
    except OSError as exc:
        raise OutputError(f"{folder}: cannot create the output folder ({_reason(exc)})") from None
    if not os.path.isdir(folder):
        raise OutputError(f"{folder}: exists and is not a folder")
    return folder


@contextmanager
def open_output(path: str, text: bool = False):
    """A new file object whose content replaces `path` when the block ends without an error (never written through
    a link, never half-written). text=True: UTF-8 text with newline='' (for CSV)."""
    path = os.fspath(path)
    folder, name = os.path.split(os.path.abspath(path))
    if not name:
        raise OutputError(f"{path}: names a folder, not a file")
    try:
        dir_fd = os.open(folder, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError as exc:
        raise OutputError(f"{path}: cannot write into {folder} ({_reason(exc)})") from None
    tmp = f".{name[:100]}.{secrets.token_hex(4)}.tmp"
    try:
        try:
            existing = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
        except FileNotFoundError:
            existing = None
        if existing is not None and not (stat.S_ISREG(existing.st_mode) or stat.S_ISLNK(existing.st_mode)):
            kind = "a folder" if stat.S_ISDIR(existing.st_mode) else "not a regular file"
            raise OutputError(f"{path}: is {kind}; refusing to replace it with an output file")
        try:
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_NOFOLLOW", 0), 0o666,
                         dir_fd=dir_fd)
        except OSError as exc:
            raise OutputError(f"{path}: cannot write ({_reason(exc)})") from None
        try:
            with (os.fdopen(fd, "w", encoding="utf-8", newline="") if text else os.fdopen(fd, "wb")) as f:
                yield f
            os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
        except BaseException as exc:
            try:
                os.unlink(tmp, dir_fd=dir_fd)
            except OSError:
                pass
            if isinstance(exc, OSError) and not isinstance(exc, OutputError) and exc.errno in (
                    errno.ENOSPC, errno.EDQUOT, errno.EIO, errno.EROFS, errno.EACCES, errno.EPERM, errno.EISDIR,
                    errno.EXDEV, errno.EFBIG):
                raise OutputError(f"{path}: cannot write ({_reason(exc)})") from None
            raise
    finally:
        os.close(dir_fd)


def write_csv(frame: pd.DataFrame, path: str) -> str:
    """`frame` as a CSV file at `path` (written as open_output does), every text cell spreadsheet-safe."""
    with open_output(path, text=True) as f:
        csv_safe_frame(frame).to_csv(f, index=False)
    return path
