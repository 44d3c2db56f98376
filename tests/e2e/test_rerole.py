"""Re-role on a live pdd topology: relay decoder rld0 (listed in the config's ``rerole``) takes
main-decode duty in datacenter A while relayed requests are in flight on it, serves new requests
P->MD over the fast path with the one-engine greedy output, and goes back to relaying. Nothing
fails, no page leaks anywhere."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from pdd.faults import StreamClient
from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

N = 24  # output tokens per request


def _members(url: str) -> dict:
    r = httpx.get(url + "/pdd/instances", timeout=30)
    assert r.status_code == 200, r.text
    return {m["name"]: m for m in r.json()["data"]}


def _until(cond, what: str, timeout_s: float = 300.0) -> None:
    """Wait for ``cond()`` (polled 20 ms apart) or fail naming ``what``."""
    deadline = time.monotonic() + timeout_s
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


def _role(url: str, name: str, role: str) -> httpx.Response:
    return httpx.post(f"{url}/pdd/instances/{name}/role", json={"role": role}, timeout=300)


def test_rerole_rld_to_md_in_a_and_back(small_model, topology_factory):
    # round-robin routing: with two candidates each role alternates, so where a request goes
    # is known (RLD: phase 1 spreads over both; MD: phase 3 sends one to each)
    # the relays stay on their RLD for >= 1.2 s after their first token (12 tokens before a
    # handoff, RLD steps >= 100 ms), so rld0's two are still there when its re-role starts
    cfg = make_cfg(small_model, "pdd", instances={"prefill": 1, "relay_decode": 2, "main_decode": 1},
                   rerole=["rld0"], engine={"device": "cpu", "min_step_ms": 20},
                   tiers={"relay_decode": {"engine": {"min_step_ms": 100}}},
                   policy={"routing": "round_robin", "pipeline_ttft_budget_ms": 0, "handoff_min_tokens": 12})
    topo = topology_factory(cfg)
    url = topo.url
    prompts = [[7 + i, 11, 13] * 12 for i in range(8)]
    ref, _ = greedy_oracle(small_model, prompts, N)

    def body(p):
        return {"model": cfg.served_model_name, "prompt": p, "max_tokens": N, "temperature": 0, "ignore_eos": True}

    # a slot the config does not list cannot change role; a bad role is a 400 naming it
    r = _role(url, "rld1", "main_decode")
    assert r.status_code == 403 and r.json()["error"]["code"] == "rerole_not_allowed", r.text
    r = _role(url, "rld0", "prefill")
    assert r.status_code == 400 and r.json()["error"]["param"] == "role", r.text

    # phase 1: four relayed requests, two on each RLD, all streaming
    first = [StreamClient(url, body(p)).start() for p in prompts[:4]]
    # each has its first token: rld0's two are mid-decode there
    _until(lambda: all(len(c.tokens) >= 1 or c.done.is_set() for c in first), "phase 1 streaming")
    # re-role rld0 while its relays are in flight; a request arriving meanwhile relays on rld1
    out: dict = {}
    t = threading.Thread(target=lambda: out.setdefault("r", _role(url, "rld0", "main_decode")))
    t.start()
    _until(lambda: (lambda m: m["state"] == "draining" or m["role"] == "main_decode")(_members(url)["rld0"]),
           "rld0 draining")  # rld0 takes no new relay from here on
    mid = StreamClient(url, body(prompts[4])).start()
    t.join(300)
    r = out["r"]
    assert r.status_code == 200, r.text
    rr = r.json()
    assert (rr["role"], rr["slot_role"], rr["state"], rr["role_from"], rr["changed"]) == \
        ("main_decode", "relay_decode", "active", "relay_decode", True)
    assert rr["leaked_pages"] == 0 and rr["prefix_cache"]["pages_dropped"] == 0  # an RLD caches nothing
    assert rr["drained_in_flight"] >= 1
    for c, want in zip(first + [mid], ref[:5]):
        assert c.wait(300) and c.error is None, c.error
        assert c.tokens == want
        assert c.summary["pipeline"] == "p_rld_md"
    assert _members(url)["rld0"]["routed"] == 2 and _members(url)["rld1"]["routed"] == 3

    # phase 3: rld0 is an MD in A: of two requests one goes there, P->MD over the fast path
    got = []
    for p in prompts[5:7]:
        c = StreamClient(url, body(p)).start()
        assert c.wait(300) and c.error is None, c.error
        got.append(c)
    pipes = sorted(c.summary["pipeline"] for c in got)
    assert pipes == ["p_d", "p_rld_md"], pipes
    for c, want in zip(got, ref[5:7]):
        assert c.tokens == want
    on_a = next(c for c in got if c.summary["pipeline"] == "p_d")
    assert set(on_a.tiers[1:]) == {"d"}  # decoded by rld0 on main-decode duty (tier d: an MD in A)
    assert _members(url)["rld0"]["routed"] == 3
    st = topo.stats()
    assert st["instances"]["rld0"]["role"] == "main_decode"
    assert httpx.get(url + "/health", timeout=10).json()["status"] == "ok"

    # and back: its MD cache (phase 3's prompt) is flushed and reported
    assert topo.wait_idle(timeout_s=60), topo.last_busy
    r = _role(url, "rld0", "relay_decode")
    assert r.status_code == 200, r.text
    back = r.json()
    assert (back["role"], back["state"], back["leaked_pages"]) == ("relay_decode", "active", 0)
    # an MD caches the prompt and the outputs whose KV it computed (all but the last): whole pages
    assert back["prefix_cache"]["pages_dropped"] == (len(prompts[6]) + N - 1) // cfg.engine.page_size
    c = StreamClient(url, body(prompts[7])).start()
    assert c.wait(300) and c.error is None and c.tokens == ref[7], c.error
    assert c.summary["pipeline"] == "p_rld_md"
    st = topo.stats()
    assert st["totals"]["failed"] == 0 and st["totals"]["completed"] == 8
    assert st["instances"]["rld0"]["role"] == "relay_decode"
    metrics = httpx.get(url + "/metrics", timeout=10).text
    assert 'pdd_gateway_membership_changes_total{op="rerole"} 2.0' in metrics
    assert topo.wait_idle(timeout_s=60), topo.last_busy
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl
