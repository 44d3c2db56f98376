"""Starting one pdd instance as a child process, and saying why one did not start.

:func:`spawn_instance` runs ``pdd launch --role ROLE --name NAME --config FILE`` in a session of
its own, stopping itself if its parent dies (``PARENT_ENV``, watched by
``pdd.launch.watch_parent``); :func:`start_failure_cause` turns its log into one line. A restart
(``pdd serve``'s supervisor, ``Topology.restart``) appends to the instance's log after a
:func:`restart_marker` line, so the run that crashed keeps its traceback. Used by
``pdd.launch.Topology`` (a whole topology) and by ``pdd.gateway.membership`` (a slot added while
the gateway serves), so the gateway does not import the launcher that starts it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from datetime import datetime, timezone
from pathlib import Path

__all__ = ["PARENT_ENV", "RESTART_MARK", "note_stop", "restart_marker", "spawn_instance", "start_failure_cause"]

PARENT_ENV = "PDD_PARENT_PID"
_pumps: dict[str, threading.Thread] = {}  # log path -> the thread copying its instance's stdout into it
RESTART_MARK = "--- restart "  # how the line that starts a restarted run's part of a log begins


def _stamp(when: datetime | None) -> str:
    """``when`` (default: now, UTC) as a log line's ISO time to the second."""
    return (when or datetime.now(timezone.utc)).isoformat(timespec="seconds")


def restart_marker(n: int, previous_exit: int | None = None, when: datetime | None = None) -> str:
    """The line written to an instance's log before its ``n``-th restart's output:
    ``--- restart 2 at 2026-12-05T00:31:07+00:00 (the previous run exited with code -9) ---``."""
    why = f" (the previous run exited with code {previous_exit})" if previous_exit is not None else ""
    return f"{RESTART_MARK}{n} at {_stamp(when)}{why} ---\n"


def _after_last_run(log_path: Path) -> str:
    """Wait (2 s at most) for the stdout copier of the run last started with ``log_path`` to
    write that run's last lines; returns the newline a line appended now needs first ("" unless
    the run ended mid-line; "" without a log)."""
    old = _pumps.pop(str(log_path), None)
    if old is not None:
        old.join(timeout=2.0)
    return "\n" if Path(log_path).exists() and _ends_mid_line(Path(log_path)) else ""


_BIND_FAILED = "error while attempting to bind on address"  # asyncio's words, uvicorn's too
# where the ports an instance binds come from, named before its bind error
BIND_FIELDS = "cannot listen on its port (gateway_port / base_port; pdd serve --port / --base-port)"

# exceptions an instance dies of at start whose cause is a config field (the field named first)
_KNOWN_START_ERRORS = (
    ("Torch not compiled with CUDA enabled",
     "engine.device: cuda, but this torch has no CUDA (use device: cpu, or a CUDA build of torch)"),
    ("can't allocate memory",
     "engine.num_pages: the KV pool does not fit in this machine's memory (lower num_pages)"),
    ("CUDA out of memory",
     "engine.num_pages: the KV pool does not fit in the device's memory (lower num_pages)"),
)


def note_stop(log_path: Path, exits: int, window_s: float, last_exit: int | None,
              when: datetime | None = None) -> None:
    """Append to an instance's log why it was not restarted (``pdd serve``'s supervisor gave up
    on a crash loop), after its last run's output: ``--- not restarted at <UTC time>: exited 6
    times in 60 s (the last run exited with code -9); the topology stopped ---``. An unwritable
    log (its directory gone) is left as it is: the supervisor's own message says the same."""
    why = f" (the last run exited with code {last_exit})" if last_exit is not None else ""
    line = (f"--- not restarted at {_stamp(when)}: exited {exits} times in {window_s:.0f} s{why}; the topology "
            "stopped ---\n")
    try:
        lead = _after_last_run(log_path)
        with open(log_path, "a") as f:
            f.write(lead + line)
    except OSError:
        pass


def _explain(exc_line: str) -> str:
    """``exc_line`` (``"RuntimeError: ..."``, a traceback's last line), prefixed with the config
    field behind it when it is a known start failure."""
    for needle, field in _KNOWN_START_ERRORS:
        if needle in exc_line:
            return f"{field}: {exc_line}"
    return exc_line


def _ends_mid_line(path: Path) -> bool:
    """Whether the file at ``path`` ends with a partial line (a run killed mid-write)."""
    with open(path, "rb") as f:
        if f.seek(0, os.SEEK_END) == 0:
            return False
        f.seek(-1, os.SEEK_END)
        return f.read(1) != b"\n"


def spawn_instance(cfg, role: str, name: str, cfg_file: Path, log_path: Path, restart: int = 0,
                   previous_exit: int | None = None) -> tuple[subprocess.Popen, threading.Event]:
    """Start instance ``name`` of ``role`` as ``pdd launch --role ROLE --name NAME --config
    CFG_FILE`` in a session of its own, its torch threads from its engine block, stopping
    itself if this process dies (``PARENT_ENV``). Its stdout and stderr go to ``log_path``;
    the returned event is set when it prints its READY line (the caller waits on it).
    ``restart``: 0 for a first start (a new log), else the restart's number: the log is kept
    and continued after a :func:`restart_marker` line (``previous_exit``: the exit code of the
    run before, named in it)."""
    lead = _after_last_run(log_path)  # the run before is gone: its last stdout lines land before the marker
    logf = open(log_path, "a" if restart else "w")
    if restart:
        logf.write(lead + restart_marker(restart, previous_exit))
        logf.flush()  # before the child writes to the same file
    env = dict(os.environ, OMP_NUM_THREADS=str(cfg.engine_for(name).torch_threads), PYTHONUNBUFFERED="1",
               **{PARENT_ENV: str(os.getpid())})
    cmd = [sys.executable, "-m", "pdd.cli", "launch", "--role", role, "--name", name, "--config", str(cfg_file)]
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=logf, stdin=subprocess.DEVNULL, env=env, text=True,
                         start_new_session=True)
    ready = threading.Event()

    def pump():
        assert p.stdout is not None
        for line in p.stdout:
            logf.write(line)
            logf.flush()
            if "READY" in line:
                ready.set()
        logf.close()

    t = _pumps[str(log_path)] = threading.Thread(target=pump, daemon=True)
    t.start()
    return p, ready


def start_failure_cause(log_path: Path) -> str:
    """One line for why an instance did not start: the exception its log ends with (a known one
    translated to the config field behind it), else the log's last lines; then where the whole
    log is. Only the last run's part of the log is read (after the last :func:`restart_marker`
    line): an earlier run's traceback is not this start's cause."""
    try:
        lines = Path(log_path).read_text().splitlines(True)
    except OSError:
        lines = []
    starts = [i for i, ln in enumerate(lines) if ln.startswith(RESTART_MARK)]
    tail = "".join((lines[starts[-1] + 1:] if starts else lines)[-400:])
    bind = [ln for ln in tail.splitlines() if _BIND_FAILED in ln]
    if bind:  # uvicorn logs it (no traceback), asyncio raises it: taken meanwhile, or below 1024 as a user
        said = bind[-1].split(":", 1)[1].strip() if bind[-1].startswith(("ERROR:", "OSError:")) else bind[-1].strip()
        return f"{BIND_FIELDS}: {said} (whole log: {log_path})"
    if "Traceback (most recent call last):" in tail:
        last = [ln for ln in tail.splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
        exc = last[-1].strip() if last else ""
        return f"{_explain(exc)} (whole log: {log_path})"
    tail = "".join(tail.splitlines(True)[-30:])
    return f"\n{tail}(whole log: {log_path})" if tail else f"no output (log: {log_path})"
