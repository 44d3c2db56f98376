"""No orphans: when the owner of instances (``pdd serve``, a :class:`~pdd.launch.Topology`) is
killed with SIGKILL, which runs none of its clean-up, its instances stop by themselves
(``pdd.launch.watch_parent``). The bound is polled, not a timing assertion."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

GONE_WITHIN_S = 60.0  # generous: the machine is shared; the watch polls every 0.25 s


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper that never comes counts as gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return False
        return True
    return state not in ("Z", "X")


def _wait_gone(pids: list[int], bound_s: float = GONE_WITHIN_S) -> list[int]:
    deadline = time.monotonic() + bound_s
    while time.monotonic() < deadline:
        left = [p for p in pids if _alive(p)]
        if not left:
            return []
        time.sleep(0.2)
    return [p for p in pids if _alive(p)]


def _kill_all(pids) -> None:
    for p in pids:
        try:
            os.kill(p, signal.SIGKILL)
        except ProcessLookupError:
            pass


OWNER = r"""
import os, subprocess, sys, time
child = subprocess.Popen(
    [sys.executable, "-c", "from pdd.launch import watch_parent; import time; watch_parent(); "
     "print('ready', flush=True); time.sleep(300)"],
    env=dict(os.environ, PDD_PARENT_PID=str(os.getpid())), stdout=subprocess.PIPE, text=True,
    start_new_session=True)
assert child.stdout.readline().strip() == "ready"
print(child.pid, flush=True)
time.sleep(300)
"""


def test_watched_child_stops_when_its_owner_is_sigkilled():
    owner = subprocess.Popen([sys.executable, "-c", OWNER], stdout=subprocess.PIPE, text=True)
    child = None
    try:
        child = int(owner.stdout.readline())
        assert _alive(child)
        owner.kill()  # SIGKILL: no clean-up runs in the owner
        owner.wait(timeout=30)
        assert _wait_gone([child]) == [], "the child outlived its SIGKILLed owner"
    finally:
        owner.kill()
        if child is not None:
            _kill_all([child])


def test_watch_parent_exits_at_once_when_the_parent_is_already_gone():
    from pdd.launch import watch_parent

    exits = []
    assert watch_parent(parent=os.getppid() + 123456, _exit=exits.append) is None
    assert exits == [1]
    # the real parent: a watching thread, no exit
    t = watch_parent(parent=os.getppid(), poll_s=0.05, _exit=exits.append)
    assert t is not None and t.is_alive() and exits == [1]
    # no owner given and none in the environment: no watch (``pdd launch`` typed by hand)
    env = os.environ.pop("PDD_PARENT_PID", None)
    try:
        assert watch_parent() is None
    finally:
        if env is not None:
            os.environ["PDD_PARENT_PID"] = env


SERVE = r"""
import sys, time
from pdd.config import ClusterConfig
from pdd.launch import Topology
cfg = ClusterConfig.model_validate_json(sys.argv[1])
topo = Topology(cfg, log_dir=sys.argv[2])
topo.start()
print(" ".join(str(p.pid) for p in topo.procs.values()), flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_topology_instances_die_with_their_sigkilled_owner(tiny_model, tmp_path):
    from tests.e2e.conftest import make_cfg

    cfg = make_cfg(tiny_model, "cross_dc_pd", model_preset="tiny", served_model_name="tiny",
                   engine={"num_pages": 64, "max_model_len": 96, "max_input_len": 64})
    owner = subprocess.Popen([sys.executable, "-c", SERVE, cfg.model_dump_json(), str(tmp_path / "logs")],
                             stdout=subprocess.PIPE, text=True)
    pids: list[int] = []
    try:
        line = owner.stdout.readline()
        pids = [int(x) for x in line.split()]
        assert len(pids) == 4, line  # link, md0, p0, gateway
        assert all(_alive(p) for p in pids)
        owner.kill()
        owner.wait(timeout=30)
        assert _wait_gone(pids) == [], "instances outlived their SIGKILLed owner"
    finally:
        owner.kill()
        _kill_all(pids)
