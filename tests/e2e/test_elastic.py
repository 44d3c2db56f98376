"""Elastic topology on a live pdd topology: a second MD joins while requests stream, the first is
drained with requests in flight and then removed; nothing fails, new requests go to the new MD,
no page leaks anywhere. Then an instance joins with ``pdd launch --join``."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest

from tests.e2e.conftest import make_cfg

pytestmark = pytest.mark.slow

MAX_TOKENS = 48
LONG_TOKENS = 160  # phase 1 of the drain test
KEY = "k-elastic"  # the operator endpoints are behind the API keys like every other
H = {"Authorization": f"Bearer {KEY}"}


def _stream(url: str, prompt: list[int], started: threading.Event | None = None,
            max_tokens: int = MAX_TOKENS) -> int:
    """Stream one completion; return the number of tokens received (raises on any failure)."""
    n = 0
    with httpx.stream("POST", url + "/v1/completions", timeout=300, headers=H,
                      json={"prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "ignore_eos": True,
                            "stream": True, "stream_options": {"include_usage": True}}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            d = json.loads(line[6:])
            assert "error" not in d, d
            if d.get("usage"):
                n = d["usage"]["completion_tokens"]
            elif started is not None and d["choices"]:
                started.set()
    return n


def _stats(url: str) -> dict:
    r = httpx.get(url + "/pdd/stats", timeout=30, headers=H)
    assert r.status_code == 200, r.text
    return r.json()


def _members(url: str) -> dict:
    r = httpx.get(url + "/pdd/instances", timeout=30, headers=H)
    assert r.status_code == 200, r.text
    return {m["name"]: m for m in r.json()["data"]}


def _wait(cond, what: str, timeout_s: float = 120.0, url: str | None = None):
    """Wait for ``cond()`` (polled on the gateway's state, 20 ms apart) or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        v = cond()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"timed out waiting for {what}")


def test_add_md_drain_first_under_load_then_remove(small_model, topology_factory):
    cfg = make_cfg(small_model, "pdd", instances={"prefill": 1, "relay_decode": 1, "main_decode": 2},
                   standby=["md1"], engine={"device": "cpu", "min_step_ms": 30}, security={"api_keys": [KEY]})
    topo = topology_factory(cfg)
    url = topo.url
    m = _members(url)
    assert {n: v["state"] for n, v in m.items()} == {"p0": "active", "rld0": "active", "md0": "active",
                                                      "md1": "standby"}
    assert "md1" not in topo.procs
    for call in (httpx.get(url + "/pdd/instances", timeout=10), httpx.post(url + "/pdd/instances", timeout=10,
                                                                          json={"role": "main_decode"}),
                 httpx.delete(url + "/pdd/instances/md0", timeout=10)):
        assert call.status_code == 401, call.text  # no key
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"  # a standby slot is not "down"

    topo.restart("md1")  # start md1's process (pdd launch); it serves nothing until added
    pool = ThreadPoolExecutor(8)
    # phase 1: requests on md0 (the only MD member), long enough (>= 4.8 s of 30 ms steps) to be
    # still in flight there when md0 is drained, however long adding md1 takes on a busy machine
    first = [pool.submit(_stream, url, [100 + i] * 60, None, LONG_TOKENS) for i in range(3)]
    _wait(lambda: _members(url)["md0"]["routed"] == 3, "phase 1 routed to md0")
    # add md1 by address while they stream
    t0 = time.perf_counter()
    r = httpx.post(url + "/pdd/instances", json={"role": "main_decode", "address": f"127.0.0.1:{cfg.base_port + 71}"},
                   timeout=60, headers=H)
    assert r.status_code == 200, r.text
    assert (r.json()["name"], r.json()["state"], r.json()["source"]) == ("md1", "active", "joined")
    t_add = time.perf_counter() - t0
    # drain md0 while its requests are in flight
    t0 = time.perf_counter()
    r = httpx.post(url + "/pdd/instances/md0/drain", json={}, timeout=60, headers=H)
    assert r.status_code == 200, r.text
    assert r.json()["state"] == "draining" and r.json()["in_flight"] >= 1, r.json()
    # removing it now is refused: requests are in flight there
    r = httpx.delete(url + "/pdd/instances/md0", timeout=60, headers=H)
    assert r.status_code == 409 and r.json()["error"]["code"] == "in_flight", r.text
    at_drain = _members(url)
    # phase 2: every new request goes to md1
    second = [pool.submit(_stream, url, [200 + i] * 60) for i in range(4)]
    tokens = [f.result(timeout=600) for f in first + second]
    assert tokens == [LONG_TOKENS] * 3 + [MAX_TOKENS] * 4  # every request finished with all its tokens
    after = _members(url)
    assert after["md0"]["routed"] == at_drain["md0"]["routed"] == 3
    assert after["md1"]["routed"] - at_drain["md1"]["routed"] == 4
    _wait(lambda: _members(url)["md0"]["in_flight"] == 0, "md0 idle")
    t_idle = time.perf_counter() - t0
    t0 = time.perf_counter()
    r = httpx.delete(url + "/pdd/instances/md0", timeout=60, headers=H)
    assert r.status_code == 200, r.text
    print(f"ELASTIC add_s={t_add:.3f} drain_to_idle_s={t_idle:.3f} remove_s={time.perf_counter() - t0:.3f} "
          f"in_flight_at_drain={at_drain['md0']['in_flight']} dropped_pages={r.json()['prefix_cache']['pages_dropped']}")
    rm = r.json()
    assert rm["state"] == "removed" and rm["leaked_pages"] == 0 and rm["forced"] is False
    assert rm["prefix_cache"]["pages_dropped"] >= 3 * 60 // cfg.engine.page_size  # phase 1's prompts were cached
    st = _stats(url)
    assert "md0" not in st["instances"]
    assert st["totals"]["failed"] == 0 and st["totals"]["completed"] == 7
    assert httpx.get(url + "/health", timeout=10).json() == {"status": "ok", "mode": "pdd", "down": [], "missing": []}
    fl = httpx.post(url + "/pdd/flush", timeout=60, headers=H).json()
    assert fl["leaked_pages"] == 0 and sorted(fl["instances"]) == ["md1", "p0", "rld0"], fl
    metrics = httpx.get(url + "/metrics", timeout=10, headers=H).text
    assert 'pdd_gateway_routed_total{instance="md1",role="main_decode"} 4.0' in metrics
    assert 'pdd_gateway_instance_state{instance="md0",role="main_decode",state="removed"} 1.0' in metrics

    # md0 rejoins as a new process with `pdd launch --join` (its slot is free again)
    topo.kill("md0")
    env = dict(os.environ, PDD_PARENT_PID=str(os.getpid()))
    p = subprocess.Popen([sys.executable, "-m", "pdd.cli", "launch", "--role", "main_decode", "--name", "md0",
                          "--config", str(topo.log_dir / "cluster.json"), "--join", url],
                         stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, start_new_session=True)
    try:
        lines = []
        for line in p.stdout:
            lines.append(line)
            if line.startswith("JOINED") or p.poll() is not None:
                break
        assert lines[-1].strip() == "JOINED md0 active", lines
        assert _members(url)["md0"]["source"] == "joined"
        assert _stream(url, [300] * 60) == MAX_TOKENS
        assert _stats(url)["totals"]["failed"] == 0

        # md1 drained and removed by itself once idle, then started again by the gateway itself
        # (pdd serve's path: its engine block from the config)
        r = httpx.post(url + "/pdd/instances/md1/drain", json={"remove_when_idle": True}, timeout=60, headers=H)
        assert r.status_code == 200 and r.json()["remove_when_idle"] is True, r.text
        _wait(lambda: _members(url)["md1"]["state"] == "removed", "md1 removed when idle")
        topo.kill("md1")
        r = httpx.post(url + "/pdd/instances", json={"role": "main_decode", "name": "md1", "start": True},
                       timeout=300, headers=H)
        assert r.status_code == 200, r.text
        assert (r.json()["state"], r.json()["source"], r.json()["connected"]) == ("active", "started", True)
        r = httpx.post(url + "/pdd/instances/md0/drain", json={}, timeout=60, headers=H)
        assert r.status_code == 200, r.text
        before = _members(url)["md1"]["routed"]
        assert _stream(url, [400] * 60) == MAX_TOKENS
        assert _members(url)["md1"]["routed"] == before + 1
        _wait(lambda: _members(url)["md1"]["in_flight"] == 0, "md1 idle")
        # md0 is draining, so md1 is the last active MD: its removal needs force
        r = httpx.delete(url + "/pdd/instances/md1?force=true", timeout=60, headers=H)
        assert r.status_code == 200 and r.json()["leaked_pages"] == 0, r.text
        import socket

        with pytest.raises(OSError):  # the gateway stopped the process it started
            socket.create_connection(("127.0.0.1", cfg.base_port + 71), timeout=2).close()
        assert _stats(url)["totals"]["failed"] == 0
    finally:
        os.killpg(p.pid, 15)
        p.wait(timeout=30)
    pool.shutdown()
