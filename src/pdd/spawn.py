"""Starting one pdd instance as a child process, and saying why one did not start.

:func:`spawn_instance` runs ``pdd launch --role ROLE --name NAME --config FILE`` in a session of
its own, stopping itself if its parent dies (``PARENT_ENV``, watched by
``pdd.launch.watch_parent``); :func:`start_failure_cause` turns its log into one line. Used by
``pdd.launch.Topology`` (a whole topology) and by ``pdd.gateway.membership`` (a slot added while
the gateway serves), so the gateway does not import the launcher that starts it.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path

__all__ = ["PARENT_ENV", "spawn_instance", "start_failure_cause"]

PARENT_ENV = "PDD_PARENT_PID"


# exceptions an instance dies of at start whose cause is a config field (the field named first)
_KNOWN_START_ERRORS = (
    ("Torch not compiled with CUDA enabled",
     "engine.device: cuda, but this torch has no CUDA (use device: cpu, or a CUDA build of torch)"),
    ("can't allocate memory",
     "engine.num_pages: the KV pool does not fit in this machine's memory (lower num_pages)"),
    ("CUDA out of memory",
     "engine.num_pages: the KV pool does not fit in the device's memory (lower num_pages)"),
)


def _explain(exc_line: str) -> str:
    """``exc_line`` (``"RuntimeError: ..."``, a traceback's last line), prefixed with the config
    field behind it when it is a known start failure."""
    for needle, field in _KNOWN_START_ERRORS:
        if needle in exc_line:
            return f"{field}: {exc_line}"
    return exc_line


def spawn_instance(cfg, role: str, name: str, cfg_file: Path, log_path: Path) -> tuple[subprocess.Popen, threading.Event]:
    """Start instance ``name`` of ``role`` as ``pdd launch --role ROLE --name NAME --config
    CFG_FILE`` in a session of its own, its torch threads from its engine block, stopping
    itself if this process dies (``PARENT_ENV``). Its stdout and stderr go to ``log_path``;
    the returned event is set when it prints its READY line (the caller waits on it)."""
    logf = open(log_path, "w")
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

    threading.Thread(target=pump, daemon=True).start()
    return p, ready


def start_failure_cause(log_path: Path) -> str:
    """One line for why an instance did not start: the exception its log ends with (a known one
    translated to the config field behind it), else the log's last lines; then where the whole
    log is."""
    try:
        tail = "".join(Path(log_path).read_text().splitlines(True)[-400:])
    except OSError:
        tail = ""
    if "Traceback (most recent call last):" in tail:
        last = [ln for ln in tail.splitlines() if ln.strip() and not ln.startswith((" ", "\t"))]
        exc = last[-1].strip() if last else ""
        return f"{_explain(exc)} (whole log: {log_path})"
    tail = "".join(tail.splitlines(True)[-30:])
    return f"\n{tail}(whole log: {log_path})" if tail else f"no output (log: {log_path})"
