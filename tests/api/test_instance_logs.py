"""An instance's log (``<log_dir>/<name>.log``) survives its restart: the restarted run's output
follows a ``--- restart N at <time> (the previous run exited with code C) ---`` line, and the
start-failure message reads only the last run. Found by a new user: ``pdd.spawn`` opened the log
with mode "w" on every start, so the supervisor's restart of a crashed instance erased the
traceback that said why it crashed."""

from __future__ import annotations

import re
from datetime import datetime, timezone

import pytest

from pdd.config import ClusterConfig
from pdd.launch import LaunchError, Topology
from pdd.spawn import restart_marker, start_failure_cause

MISSING_CERTS = "pdd launch: error: security.cert_dir is not set"
MISSING_MODEL = "pdd launch: error: model_path {}: no checkpoint there (config.json missing)"


def test_a_restart_keeps_the_previous_runs_log_after_a_marker_line(tmp_path):
    """Two real ``pdd launch`` runs of c0 that exit at once with a usage error (exit 2), each a
    different one: the first run's error is still in c0.log after the restart."""
    model = tmp_path / "no-model"
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": str(model)})
    topo = Topology(cfg, log_dir=tmp_path)
    topo._cfg_file = tmp_path / "cluster.json"
    topo._cfg_file.write_text(cfg.model_dump_json())  # no cert_dir: refused
    with pytest.raises(LaunchError, match="c0 \\(colocated\\) exited with 2 before it was ready"):
        topo._spawn(topo.layout.get("c0"))
    first = (tmp_path / "c0.log").read_text()
    assert MISSING_CERTS in first and "--- restart" not in first

    plain = cfg.model_copy(update={"security": cfg.security.model_copy(update={"tls": False, "fast_path": "plain"})})
    topo._cfg_file.write_text(plain.model_dump_json())  # past the certificates, to the missing model
    before = datetime.now(timezone.utc).replace(microsecond=0)
    with pytest.raises(LaunchError) as e:
        topo.restart("c0")
    log = (tmp_path / "c0.log").read_text()
    assert log.startswith(first)  # the first run's output is kept as it was
    marker, rest = log[len(first):].split("\n", 1)
    m = re.fullmatch(r"--- restart 1 at (\S+) \(the previous run exited with code 2\) ---", marker)
    assert m, marker
    assert before <= datetime.fromisoformat(m.group(1)) <= datetime.now(timezone.utc)
    assert MISSING_MODEL.format(model) in rest and MISSING_CERTS not in rest
    # the start-failure message names the second run's error only
    assert MISSING_MODEL.format(model) in str(e.value) and MISSING_CERTS not in str(e.value)
    assert topo.restarts == {"c0": 1}

    with pytest.raises(LaunchError):
        topo.restart("c0")
    log2 = (tmp_path / "c0.log").read_text()
    assert log2.startswith(log) and log2[len(log):].startswith("--- restart 2 at ")
    assert log2.count(MISSING_CERTS) == 1 and log2.count(MISSING_MODEL.format(model)) == 2


def test_the_start_failure_cause_is_the_last_runs_not_an_earlier_traceback(tmp_path):
    """An earlier run's traceback (the crash the supervisor restarted it after) is not why the
    restart did not start."""
    log = tmp_path / "md0.log"
    when = datetime(2026, 12, 5, 0, 31, 7, tzinfo=timezone.utc)
    assert restart_marker(2, -9, when) == \
        "--- restart 2 at 2026-12-05T00:31:07+00:00 (the previous run exited with code -9) ---\n"
    assert restart_marker(1, None, when) == "--- restart 1 at 2026-12-05T00:31:07+00:00 ---\n"
    log.write_text("Traceback (most recent call last):\n  File \"x.py\", line 1\nRuntimeError: crashed\n"
                   + restart_marker(1, 1, when) + "loading\nstill loading\n")
    assert start_failure_cause(log) == f"\nloading\nstill loading\n(whole log: {log})"
    log.write_text(log.read_text() + restart_marker(2, -9, when) + "Traceback (most recent call last):\n"
                   "ValueError: second\n")
    assert start_failure_cause(log) == f"ValueError: second (whole log: {log})"
    log.write_text(log.read_text() + restart_marker(3, 1, when))
    assert start_failure_cause(log) == f"no output (log: {log})"
