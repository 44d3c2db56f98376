"""`pdd serve`'s supervisor: an instance that dies again while it restarts is one more exit,
retried, not a traceback that takes the topology down (a new user's kill -9 of a restarting
md0); a crash loop still stops it. Fake processes: no topology."""

from __future__ import annotations

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


def test_a_crash_loop_still_stops_the_topology(capsys):
    topo = Topo(fail_restarts=100)
    assert cli._supervise(topo, poll_s=0) == 1
    assert topo.restarts == cli.SUPERVISE_MAX_RESTARTS
    assert "md0 exited 6 times in 60 s" in capsys.readouterr().err
