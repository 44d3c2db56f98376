"""A process the gateway started and now stops (a removal, the gateway's exit), or one of a
``Topology`` it stops (``pdd serve``'s exit), that is frozen (SIGSTOP: a hung instance) runs its
clean stop at once: SIGTERM is followed by SIGCONT. Before, a stopped process could not take
SIGTERM: the gateway waited its whole 10 s grace (the topology 5 s), then SIGKILLed it (no clean
stop)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from pdd.gateway.membership import Membership
from pdd.launch import Topology

CHILD = ("import signal, sys, time\n"
         "signal.signal(signal.SIGTERM, lambda *_: sys.exit(7))\n"  # its clean stop: exit 7
         "print('ready', flush=True)\n"
         "while True:\n"
         "    time.sleep(1)\n")


def _frozen() -> subprocess.Popen:
    """A child in a session of its own, stopped (SIGSTOP) once it is ready."""
    p = subprocess.Popen([sys.executable, "-c", CHILD], stdout=subprocess.PIPE, text=True, start_new_session=True)
    assert p.stdout.readline() == "ready\n"
    os.kill(p.pid, signal.SIGSTOP)
    _, status = os.waitpid(p.pid, os.WUNTRACED)  # returns once it is stopped (not reaped)
    assert os.WIFSTOPPED(status)
    return p


def _reap(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.kill()
        p.wait()


def test_a_frozen_member_is_resumed_to_run_its_clean_stop():
    p = _frozen()
    try:
        Membership._kill(p)
        assert p.returncode == 7  # its SIGTERM handler ran (before: still running after the 10 s, then killed)
    finally:
        _reap(p)


def test_a_frozen_instance_of_a_topology_is_resumed_to_run_its_clean_stop():
    p = _frozen()
    try:
        topo = Topology.__new__(Topology)  # its processes only: _terminate reads procs
        topo.procs = {"md0": p}
        topo._terminate(["md0"], 30.0)
        assert p.returncode == 7  # before: -9 after the timeout
    finally:
        _reap(p)
