"""A re-roled relay decoder killed and restarted (as its supervisor does: in its launch role,
relay_decode) on a live topology: the gateway's reconnect switches the new process to the role it
records (main_decode) before routing to it, so requests routed there are served P->MD with the
one-engine greedy output. Before, /pdd/instances listed rld0 as main_decode while its process ran
relay_decode, and every request routed there failed 503 ``LookupError: no handler for message
type 'reserve'`` with /health ok."""

from __future__ import annotations

import time

import httpx
import pytest

from pdd.faults import StreamClient
from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

N = 8  # output tokens per request


def _members(url: str) -> dict:
    r = httpx.get(url + "/pdd/instances", timeout=30)
    assert r.status_code == 200, r.text
    return r.json()


def _until(cond, what: str, timeout_s: float = 60.0) -> None:
    """Wait for ``cond()`` (polled 20 ms apart) or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def test_a_rerolled_rld_killed_and_restarted_serves_in_its_recorded_role(small_model, topology_factory):
    cfg = make_cfg(small_model, "pdd", instances={"prefill": 1, "relay_decode": 2, "main_decode": 1},
                   rerole=["rld0"], engine={"device": "cpu"}, policy={"routing": "round_robin"})
    topo = topology_factory(cfg)
    url = topo.url
    prompts = [[9 + i, 11, 13] * 8 for i in range(4)]
    ref, _ = greedy_oracle(small_model, prompts, N)

    r = httpx.post(f"{url}/pdd/instances/rld0/role", json={"role": "main_decode"}, timeout=300)
    assert r.status_code == 200 and r.json()["role"] == "main_decode", r.text

    topo.kill("rld0")
    _until(lambda: httpx.get(url + "/health", timeout=10).json().get("down") == ["rld0"], "rld0 down")
    topo.restart("rld0")  # as its supervisor would: relay_decode, its launch role
    _until(lambda: (lambda m: m["connected"])({x["name"]: x for x in _members(url)["data"]}["rld0"]),
           "rld0 reconnected")

    listing = _members(url)
    rld0 = {x["name"]: x for x in listing["data"]}["rld0"]
    assert (rld0["role"], rld0["state"], "role_error" in rld0) == ("main_decode", "active", False)
    ev = [e for e in listing["events"] if e["op"] == "role_restored"]
    assert [(e["instance"], e["role"], e["role_from"], e["after"]) for e in ev] == \
        [("rld0", "main_decode", "relay_decode", "reconnect")]
    assert topo.stats()["instances"]["rld0"]["role"] == "main_decode"  # what the process says it runs

    before = rld0["routed"]
    for p, want in zip(prompts, ref):  # round robin over the MDs (md0, rld0): two go to rld0
        c = StreamClient(url, {"model": cfg.served_model_name, "prompt": p, "max_tokens": N, "temperature": 0,
                               "ignore_eos": True}).start()
        assert c.wait(120) and c.error is None, c.error
        assert c.tokens == want
    after = {x["name"]: x for x in _members(url)["data"]}["rld0"]["routed"]
    assert after - before >= 1
    assert topo.flush()["leaked_pages"] == 0
