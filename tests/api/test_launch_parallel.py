"""Topology.start launches the engine instances of a topology side by side (none connects to
another while it starts: a prefill's KV senders and the link's lanes connect on first use) and
the gateway, which connects to every engine at start, once they are all ready."""

from __future__ import annotations

import threading

import pytest

from pdd import launch
from pdd.config import ClusterConfig
from pdd.launch import LaunchError, Topology


class FakeProc:
    def __init__(self, name: str, rc: int | None = None):
        self.name, self.returncode, self.pid = name, rc, -1

    def poll(self):
        return self.returncode


def _cfg(tmp_path) -> ClusterConfig:
    return ClusterConfig.model_validate({"mode": "pdd", "model_path": str(tmp_path / "m"), "base_port": 19000,
                                         "gateway_port": 19095})


def test_engines_start_side_by_side_and_the_gateway_once_they_are_ready(tmp_path, monkeypatch):
    """Each engine's READY comes only once every engine has been launched: a start that waited
    for each before launching the next would time out on the first."""
    spawned: list[str] = []
    ready_when_all: dict[str, threading.Event] = {}
    engines = {"link", "md0", "rld0", "p0"}

    def fake_spawn(cfg, role, name, cfg_file, log_path, restart=0, previous_exit=None):
        assert not (name == "gateway" and not all(ready_when_all[n].is_set() for n in engines)), spawned
        spawned.append(name)
        ev = ready_when_all[name] = threading.Event()
        if name == "gateway" or engines <= set(spawned):
            for e in ready_when_all.values():
                e.set()
        return FakeProc(name), ev

    monkeypatch.setattr(launch, "spawn_instance", fake_spawn)
    monkeypatch.setattr(Topology, "stop", lambda self, grace_s=5.0: None)  # fake processes: nothing to stop
    topo = Topology(_cfg(tmp_path), log_dir=tmp_path, start_timeout_s=2.0)
    topo.start()
    assert spawned == ["link", "md0", "rld0", "p0", "gateway"]  # the dependency order, as before
    assert list(topo.procs) == spawned


def test_the_first_instance_in_start_order_that_fails_is_named_and_the_rest_stopped(tmp_path, monkeypatch):
    """md0 exits before it is ready while rld0 and p0 are still starting: the error names md0
    (what a one-by-one start reported), no gateway is started and every launched one is stopped."""
    spawned: list[str] = []

    def fake_spawn(cfg, role, name, cfg_file, log_path, restart=0, previous_exit=None):
        spawned.append(name)
        ev = threading.Event()
        if name == "link":
            ev.set()
        return FakeProc(name, rc=3 if name == "md0" else None), ev

    stopped: list[list[str]] = []
    monkeypatch.setattr(launch, "spawn_instance", fake_spawn)
    monkeypatch.setattr(Topology, "stop", lambda self, grace_s=5.0: stopped.append(list(self.procs)))
    topo = Topology(_cfg(tmp_path), log_dir=tmp_path, start_timeout_s=2.0)
    with pytest.raises(LaunchError, match=r"^md0 \(main_decode\) exited with 3 before it was ready"):
        topo.start()
    assert spawned == ["link", "md0", "rld0", "p0"]
    assert stopped == [["link", "md0", "rld0", "p0"]]
