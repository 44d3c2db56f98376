"""Several instances per tier: routing spreads requests, and one instance can be killed and
started again on its own (``pdd launch`` style) while the rest keep serving."""

from __future__ import annotations

import time

import httpx
import pytest

from tests.e2e.conftest import make_cfg

pytestmark = pytest.mark.slow


def _complete(url: str, prompt: list[int], n: int = 8) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                   "ignore_eos": True}, timeout=60)
    assert r.status_code == 200, r.text
    return r.json()


def _requests_on(topo, name: str) -> int:
    return int(topo.stats()["instances"][name]["counters"]["requests"])


def test_two_of_each_tier_kill_and_restart_one_prefill(small_model, topology_factory):
    cfg = make_cfg(small_model, "pdd", instances={"prefill": 2, "relay_decode": 2, "main_decode": 2},
                   policy={"routing": "round_robin"})
    topo = topology_factory(cfg)
    names = [s.name for s in topo.layout.instances]
    assert names == ["p0", "p1", "rld0", "rld1", "md0", "md1", "link", "gateway"]
    for i in range(6):
        _complete(topo.url, [100 + i] * 40)
    for name in ("p0", "p1", "rld0", "rld1", "md0", "md1"):
        assert _requests_on(topo, name) >= 2, name  # round robin used every instance

    topo.kill("p1")
    # the gateway sees p1's connection close on its own loop: poll /health for it (bounded), not
    # a guessed sleep
    deadline = time.monotonic() + 30
    h = httpx.get(topo.url + "/health", timeout=10)
    while h.json().get("down") != ["p1"] and time.monotonic() < deadline:
        time.sleep(0.05)
        h = httpx.get(topo.url + "/health", timeout=10)
    # still serving (p0 is up): 200 "degraded" naming p1, so a load balancer keeps the gateway
    assert h.status_code == 200 and h.json()["status"] == "degraded" and h.json()["down"] == ["p1"]
    for i in range(4):  # p1 is down: the router skips it
        _complete(topo.url, [200 + i] * 40)
    assert "p1" in topo.stats()["instances"] and "error" in topo.stats()["instances"]["p1"]

    topo.restart("p1")  # rejoins without restarting the rest
    deadline = time.monotonic() + 30
    used = 0
    while time.monotonic() < deadline and used == 0:
        _complete(topo.url, [300] * 40)
        st = topo.stats()["instances"]["p1"]
        used = int(st.get("counters", {}).get("requests", 0)) if "error" not in st else 0
    assert used >= 1
    assert httpx.get(topo.url + "/health", timeout=10).status_code == 200
    assert topo.flush()["leaked_pages"] == 0
