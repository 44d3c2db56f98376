"""An engine instance (or the WAN link) started by hand (``pdd launch``) whose terminal closes
(SIGHUP) stops as on SIGTERM: its clean stop, then exit 129 (as ``pdd serve`` after SIGHUP).
Before, Python's default for SIGHUP ended it at once (status -1). Under ``nohup`` (SIGHUP ignored
at start) it stays running: only SIGTERM stops it."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


def _launch(tiny_model: str, tmp_path: Path, hup, role: str = "colocated") -> subprocess.Popen:
    """``pdd launch --role ROLE`` (colocated: c0; link) with SIGHUP at ``hup`` (SIG_DFL or
    SIG_IGN, whatever this run inherited), once it printed READY."""
    cfg = tmp_path / "c.json"
    mode = "colocated" if role == "colocated" else "pdd"
    cfg.write_text(json.dumps({"mode": mode, "model_path": tiny_model, "base_port": 9262, "gateway_port": 9399,
                               "security": {"tls": False, "fast_path": "plain"}}))
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    env.pop("PDD_PARENT_PID", None)  # typed by hand: no owner to watch
    p = subprocess.Popen([sys.executable, "-m", "pdd.cli", "launch", "--role", role, "--config", str(cfg)],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                         preexec_fn=lambda: signal.signal(signal.SIGHUP, hup))
    line = p.stdout.readline()
    if line != ("READY c0\n" if role == "colocated" else "LINK READY\n"):
        p.kill()
        raise AssertionError((line, p.communicate(timeout=30)))
    return p


@pytest.mark.parametrize("hup,signals,status", [
    (signal.SIG_DFL, [signal.SIGHUP], 128 + signal.SIGHUP),
    (signal.SIG_DFL, [signal.SIGTERM], 0),
    # nohup: the SIGHUP is dropped, the SIGTERM after it stops the instance (SIGHUP handled would be 129)
    (signal.SIG_IGN, [signal.SIGHUP, signal.SIGTERM], 0),
], ids=["sighup", "sigterm", "nohup"])
def test_a_launched_instance_stops_cleanly_on_sighup_unless_it_is_ignored(tiny_model, tmp_path, hup, signals,
                                                                           status):
    p = _launch(tiny_model, tmp_path, hup)
    try:
        for sig in signals:
            p.send_signal(sig)
        assert p.wait(timeout=60) == status, p.communicate(timeout=10)
        assert "Traceback" not in p.stderr.read()
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()


@pytest.mark.parametrize("hup,signals,status", [
    (signal.SIG_DFL, [signal.SIGHUP], 128 + signal.SIGHUP),
    (signal.SIG_IGN, [signal.SIGHUP, signal.SIGTERM], 0),
], ids=["sighup", "nohup"])
def test_a_launched_link_stops_cleanly_on_sighup_unless_it_is_ignored(tiny_model, tmp_path, hup, signals, status):
    p = _launch(tiny_model, tmp_path, hup, role="link")
    try:
        for sig in signals:
            p.send_signal(sig)
        assert p.wait(timeout=60) == status, p.communicate(timeout=10)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
