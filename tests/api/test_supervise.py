"""`pdd serve`'s supervisor: an instance that dies again while it restarts is one more exit,
retried, not a traceback that takes the topology down (a new user's kill -9 of a restarting
md0); a crash loop still stops it. Fake processes: no topology."""

from __future__ import annotations

import re

import pytest

from pdd import cli
from pdd.launch import LaunchError


class Proc:
    def __init__(self, rc):
        self.rc = rc

    def poll(self):
        return self.rc


class Topo:
    log_dir = "logs"

    def __init__(self, fail_restarts: int):
        self.procs = {"md0": Proc(-9), "p0": Proc(None)}
        self.fail_restarts = fail_restarts
        self.restarts = 0

    def restart(self, name):
        self.restarts += 1
        if self.restarts <= self.fail_restarts:
            self.procs[name] = Proc(-9)  # died before it was ready
            raise LaunchError(f"{name} (main_decode) exited with -9 before it was ready:\n...")
        self.procs[name] = Proc(None)
        raise KeyboardInterrupt  # up again: end the test's supervision loop here


def test_a_restart_that_dies_before_ready_is_retried(capsys):
    topo = Topo(fail_restarts=2)
    with pytest.raises(KeyboardInterrupt):
        cli._supervise(topo, poll_s=0)
    assert topo.restarts == 3
    err = capsys.readouterr().err
    assert err.count("md0 did not come back (md0 (main_decode) exited with -9 before it was ready:); trying again") == 2
    # where the crashed run's output is (a restart keeps it: tests/api/test_instance_logs.py)
    assert err.count("pdd: md0 exited (code -9); restarting it, the rest keep serving (its log: logs/md0.log)") == 3


def test_a_crash_loop_still_stops_the_topology(capsys, tmp_path):
    topo = Topo(fail_restarts=100)
    topo.log_dir = str(tmp_path)
    (tmp_path / "md0.log").write_text("READY md0\nTraceback (most recent call last):\n  boom")  # killed mid-line
    assert cli._supervise(topo, poll_s=0) == 1
    assert topo.restarts == cli.SUPERVISE_MAX_RESTARTS
    assert "md0 exited 6 times in 60 s" in capsys.readouterr().err
    # the instance's log says why it was not restarted, after the last run's output
    lines = (tmp_path / "md0.log").read_text().splitlines()
    assert lines[:3] == ["READY md0", "Traceback (most recent call last):", "  boom"]
    assert re.fullmatch(r"--- not restarted at \d{4}-\d\d-\d\dT\d\d:\d\d:\d\d\+00:00: exited 6 times in 60 s "
                        r"\(the last run exited with code -9\); the topology stopped ---", lines[3]), lines[3]
    assert len(lines) == 4


def test_a_stop_note_with_no_log_directory_is_skipped(tmp_path):
    from pdd.spawn import note_stop

    note_stop(tmp_path / "gone" / "md0.log", 6, 60.0, -9)  # its directory is gone: nothing to write, no error
    assert not (tmp_path / "gone").exists()
