"""Live policy counters on a running pdd topology (issue #22 item 3): the auto handoff mode switches
to one-shot when RLD's batch is full and back to catch-up when it is not, and the gateway's
``/metrics`` counts it exactly as RLD does; the P/MD prefix-hit alignment gauge follows its
definition (docs/SERVE.md "Live policy counters")."""

from __future__ import annotations

import asyncio
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pdd.transfer.link import set_link
from tests.e2e.conftest import make_cfg

pytestmark = pytest.mark.slow


def _complete(url: str, prompt: list[int], n: int = 40) -> dict:
    r = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": n, "temperature": 0,
                                                   "ignore_eos": True}, timeout=300)
    assert r.status_code == 200, r.text
    return r.json()


def _metrics(url: str) -> dict:
    text = httpx.get(url + "/metrics", timeout=30).text
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_auto_handoff_switches_and_hit_alignment(small_model, topology_factory):
    cfg = make_cfg(small_model, "pdd", policy={"handoff_mode": "auto", "early_handoff": False},
                   engine={"device": "cpu", "min_step_ms": 30},
                   tiers={"relay_decode": {"engine": {"max_running": 2}}},
                   liveness={"dead_after_s": 120.0})  # the WAN is slowed a while below: MD is not dead
    topo = topology_factory(cfg)
    url = topo.url
    # quiet: one request at a time, RLD's load 1/2 <= 0.60: auto stays in catch-up
    _complete(url, [7] * 64)
    # a burst filling RLD's batch (2/2 >= 0.85): auto switches to one-shot. The WAN is slowed to
    # 0.5 Mbit/s while the burst starts (a request's 128 kB of KV then need ~2 s on it), so no
    # request can hand over before RLD holds two of them: the load each handoff reads is set by
    # the line, not by how fast the four requests happen to arrive
    gbps = cfg.link.wan_gbps

    def slow(on: bool) -> None:
        asyncio.run(set_link(cfg.host, topo.layout.link_control_port, gbps=0.0005 if on else gbps))

    slow(True)
    try:
        with ThreadPoolExecutor(4) as pool:
            futs = [pool.submit(_complete, url, [20 + i] * 64, 200) for i in range(4)]
            deadline = time.monotonic() + 120  # a bound on the wait, not a timing assert
            while (topo.stats()["instances"]["rld0"]["running"] < 2 and not any(f.done() for f in futs)
                   and time.monotonic() < deadline):
                time.sleep(0.02)
            full = topo.stats()["instances"]["rld0"]["running"]
            slow(False)
            for f in futs:
                f.result()
    finally:
        slow(False)
    assert full >= 2, full
    # quiet again: back to catch-up
    _complete(url, [7] * 64)  # the same prompt: P and MD both hold its whole pages now
    m = _metrics(url)
    rld = topo.stats()["instances"]["rld0"]["counters"]
    rounds = {mode: m.get(("pdd_gateway_handoff_rounds_total", (("instance", "rld0"), ("mode", mode))), 0)
              for mode in ("one_shot", "catch_up")}
    assert rounds["one_shot"] >= 1 and rounds["catch_up"] >= 2, rounds  # both modes used
    switches = m[("pdd_gateway_handoff_mode_switches_total", (("instance", "rld0"),))]
    assert switches >= 2 and switches == rld["mode_switches"], (switches, rld)
    assert rounds["one_shot"] == rld.get("handoffs_one_shot", 0)
    assert m[("pdd_gateway_handoff_mode", (("instance", "rld0"), ("mode", "catch_up")))] == 1
    # the alignment gauge is MD's windowed hit rate over P's
    p_rate = m[("pdd_gateway_prefix_hit_rate", (("tier", "prefill"),))]
    md_rate = m[("pdd_gateway_prefix_hit_rate", (("tier", "main_decode"),))]
    assert p_rate > 0 and md_rate > 0, (p_rate, md_rate)
    assert m[("pdd_gateway_prefix_hit_alignment", ())] == pytest.approx(md_rate / p_rate, rel=1e-9)
    assert topo.stats()["totals"]["failed"] == 0
