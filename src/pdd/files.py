"""Bounded reads of the input files a user names (``--trace``, ``--profile``, a recorded run's
files): only a regular file is read, and at most a cap of bytes. ``/dev/zero`` given as a trace
was "no such file" (it exists) and, as a profile, read until memory ran out; a FIFO with no
writer hung. Imports nothing of pdd (``config.py`` bounds its config files the same way)."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

MAX_JSON_BYTES = 64 << 20  # a profile or a run's JSON: the largest in the repo is a few hundred KiB
MAX_DATA_BYTES = 1 << 30  # a trace or a run's requests.jsonl (the bundled trace is 3 MB)


class InputFileError(ValueError):
    """An input file that is not a regular file, is larger than its cap or is not UTF-8 text; the
    message is one line starting with the path."""


def open_regular(path: str | Path, max_bytes: int, what: str) -> io.BufferedReader:
    """``path`` opened for reading in binary, once it is known to be a regular file of at most
    ``max_bytes`` bytes (the size its inode gives; a reader of it stops there too). ``what``
    completes the refusal, e.g. "give a Mooncake-format JSONL trace". Opened non-blocking, so a
    FIFO without a writer is refused, not waited on. Raises FileNotFoundError (or another
    OSError: unreadable), IsADirectoryError, or :class:`InputFileError` (a device, FIFO or
    socket; too large)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    try:
        st = os.fstat(fd)
        if stat.S_ISDIR(st.st_mode):
            raise IsADirectoryError(21, "Is a directory", str(path))
        if not stat.S_ISREG(st.st_mode):
            raise InputFileError(f"{path}: not a regular file (a device, FIFO or socket); {what}")
        if st.st_size > max_bytes:
            raise InputFileError(f"{path}: larger than {max_bytes:,} bytes ({st.st_size:,}); {what}")
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def read_text(path: str | Path, max_bytes: int = MAX_JSON_BYTES, what: str = "give a JSON file") -> str:
    """The UTF-8 text of regular file ``path`` of at most ``max_bytes`` bytes
    (:func:`open_regular`; at most ``max_bytes`` + 1 bytes are read, whatever its inode said).
    Raises OSError (missing, unreadable, a directory) or :class:`InputFileError` (not a regular
    file, too large, not UTF-8)."""
    with open_regular(path, max_bytes, what) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew since fstat
        raise InputFileError(f"{path}: larger than {max_bytes:,} bytes; {what}")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError(f"{path}: not UTF-8 text (a binary file?); {what}") from None
