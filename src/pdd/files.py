"""Bounded reads of the files a user names: a trace (``--trace``), a profile (``--profile``), a
recorded run's files (``--live-from``) and a config file (``--config``, ``ClusterConfig.load``).

Only a regular file is read, and at most a cap of bytes:

- :func:`open_regular`: the file opened non-blocking (a FIFO without a writer is refused, not
  waited on), once its inode says it is a regular file within the cap;
- :func:`read_bytes`: its bytes, at most cap + 1 read whatever the inode said;
- :func:`read_text`: those bytes as UTF-8 text.

Caps: :data:`MAX_JSON_BYTES` (64 MiB) for a profile or a run's JSON, :data:`MAX_DATA_BYTES`
(1 GiB) for a trace or a run's ``requests.jsonl``; a caller may give its own
(``pdd.config.MAX_CONFIG_BYTES``, ``pdd.workload.records.MAX_TRACE_BYTES``).

Errors: OSError for a file that cannot be opened (FileNotFoundError, PermissionError,
IsADirectoryError for a directory); :class:`InputFileError`, one line starting with the path and
ending with the caller's ``what`` (what to give instead), for a device, FIFO or socket (``PATH:
not a regular file (a device, FIFO or socket); WHAT``), a file over the cap (``PATH: larger than
the cap of N bytes (M bytes); WHAT``) and text that is not UTF-8. Imports nothing of pdd."""

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
            raise InputFileError(too_large(path, max_bytes, st.st_size, what))
    except BaseException:
        os.close(fd)
        raise
    return os.fdopen(fd, "rb")


def too_large(path: str | Path, max_bytes: int, size: int | None, what: str) -> str:
    """The refusal of a file over its cap: ``"PATH: larger than the cap of 1,048,576 bytes
    (2,000,000 bytes); WHAT"`` (``size`` None: its size is not known, the parenthesis is left
    out)."""
    has = f" ({size:,} bytes)" if size is not None else ""
    return f"{path}: larger than the cap of {max_bytes:,} bytes{has}; {what}"


def read_bytes(path: str | Path, max_bytes: int = MAX_JSON_BYTES, what: str = "give a JSON file") -> bytes:
    """The bytes of regular file ``path`` of at most ``max_bytes`` bytes (:func:`open_regular`;
    at most ``max_bytes`` + 1 bytes are read, whatever its inode said). Raises OSError (missing,
    unreadable, a directory) or :class:`InputFileError` (not a regular file, too large)."""
    with open_regular(path, max_bytes, what) as f:
        data = f.read(max_bytes + 1)
    if len(data) > max_bytes:  # it grew since fstat
        raise InputFileError(too_large(path, max_bytes, None, what))
    return data


def read_text(path: str | Path, max_bytes: int = MAX_JSON_BYTES, what: str = "give a JSON file") -> str:
    """The UTF-8 text of regular file ``path`` of at most ``max_bytes`` bytes
    (:func:`read_bytes`). Raises OSError (missing, unreadable, a directory) or
    :class:`InputFileError` (not a regular file, too large, not UTF-8)."""
    data = read_bytes(path, max_bytes, what)
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError:
        raise InputFileError(f"{path}: not UTF-8 text (a binary file?); {what}") from None
