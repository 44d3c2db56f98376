"""A relayed request's MD send starts before MD's reservation returns (``policy.md_predicted_send``).

pdd with a zero TTFT budget relays every request, so its plan does not wait for MD. With the
predicted send, P also starts MD's WAN transfer at once, from the page the gateway's prefix index
says MD's cache ends at, instead of a WAN round trip later (200 ms here):

- a request whose prefix MD holds: with MD stopped (SIGSTOP), so that its reservation cannot be
  answered, the pages MD lacks still enter the WAN (the link's admitted A->B bytes grow by at
  least their payload); once MD resumes the request completes and exactly those pages crossed.
  The prefix includes the previous turn's output (MD caches the tokens it decoded; the
  gateway's index records them when the request ends on MD);
- a request whose predicted prefix MD does not hold yet (another request's KV still on the line):
  MD's reservation finds fewer pages, and they follow as a fill transfer.

Relayed handoffs start early (``policy.early_handoff``): once P has written MD's KV, at its
predicted landing, not after MD's kv_ready crossed back. B's comes at the latest at its kv_ready:
RLD is held stopped until MD holds B's KV, so B cannot end on RLD first. Every output equals a
single engine's greedy output, WAN bytes sent equal the bytes planned, and every page is free
afterwards.
"""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time

import httpx
import pytest

from pdd.faults import StreamClient
from pdd.transfer.link import query_stats, set_link
from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

SLOT = 2048  # small preset: 4 layers x (K, V) x 2 KV heads x 32 dims x fp32 bytes per token
PAGE_TOKENS = 16
RTT_MS = 200.0


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


def test_predicted_send_and_its_fill(small_model, topology_factory):
    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu", "page_size": PAGE_TOKENS},
                   policy={"pipeline_ttft_budget_ms": 0.0, "handoff_mode": "one_shot", "cutoff": False},
                   link={"wan_gbps": 0.05, "wan_rtt_ms": RTT_MS, "wan_jitter_ms": 0.0},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0,
                   liveness={"dead_after_s": 60.0},  # MD is stopped a while below: not declared dead
                   # RLD steps of >= 5 ms (a GPU-like step): B's 600 tokens then take >= 3 s on RLD, so
                   # its KV (< 0.5 s on the restored line) lands and it is handed over first, even when
                   # A's KV, received on the slowed line, has dragged the live WAN estimate down and
                   # so put B's early handoff off until MD's kv_ready
                   tiers={"relay_decode": {"engine": {"min_step_ms": 5}}})
    topo = topology_factory(cfg)

    def run(prompt: list[int], max_tokens: int, start_only: bool = False) -> StreamClient:
        c = StreamClient(topo.url, {"model": cfg.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True}).start()
        if not start_only:
            assert c.wait(60) and c.error is None, c.error
        return c

    warm = _ids(1, 40)  # the gateway learns MD's page size from a first reservation
    run(warm, 4)
    assert topo.wait_idle(timeout_s=30), topo.last_busy

    # D: a fresh prompt, decoded long enough to be handed over to MD; E: D's next turn
    d = _ids(2, 100)
    cd = run(d, 600)
    assert cd.summary["handoff_pos"] is not None, json.dumps(cd.summary)  # MD decoded D's end (and cached it)
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    e = d + cd.tokens + _ids(3, 20)
    held = (len(d) + len(cd.tokens) - 1) // PAGE_TOKENS * PAGE_TOKENS  # MD caches all but the last token's KV
    kv_payload = (len(e) - held) * SLOT

    def admitted_a_to_b() -> int:
        return int(asyncio.run(query_stats(cfg.host, topo.layout.link_control_port))["admitted_a_to_b"])

    # MD stopped: its reservation reply cannot come back, so any KV entering the WAN now was sent
    # from the prediction (no clock involved: the wait below is on the link's byte counter)
    base = admitted_a_to_b()
    md = topo.procs["md0"]
    os.kill(md.pid, signal.SIGSTOP)
    try:
        ce = run(e, 300, start_only=True)
        deadline = time.monotonic() + 60  # a bound on the wait, not a timing assert
        while admitted_a_to_b() - base < kv_payload and ce.error is None and time.monotonic() < deadline:
            time.sleep(0.005)
        crossed_while_md_stopped = admitted_a_to_b() - base
    finally:
        os.kill(md.pid, signal.SIGCONT)
    assert crossed_while_md_stopped >= kv_payload, (crossed_while_md_stopped, kv_payload, ce.error)
    assert ce.wait(60) and ce.error is None, ce.error
    assert ce.summary["md_cached_tokens"] == held, ce.summary
    assert ce.summary["wan_bytes_expected"] == ce.summary["wan_bytes"] == kv_payload, ce.summary
    ev = ce.summary["events_ms"]
    assert "md_reserved" in ev and "md_kv_ready" in ev, ev
    # early handoff: RLD's ids left at the KV's predicted landing, before MD's kv_ready came back
    assert ev["handoff_call"] < ev["md_kv_ready"], ev
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    fills_before = topo.stats()["totals"].get("md_predicted_fills", 0)

    # A (400 tokens) and B (A + 50): B's predicted prefix is A's prompt, which MD must not hold
    # yet when B's reservation lands. The line is slowed to 0.5 Mbit/s before A starts, so A's
    # 800 kB of KV need ~13 s on it: MD cannot have A's KV until the rate is restored, and the rate
    # is restored only once B's reservation reply is in (it said MD lacks pages: the fill). RLD is
    # stopped (SIGSTOP) from B's first RLD token until MD holds B's KV, so B cannot end on RLD
    # first however slowly the busy machine moves the reservation, the fill and MD's kv_ready:
    # the order is forced by the line and the stop, not by how fast anything runs.
    a = _ids(4, 400)
    b = a + _ids(5, 50)

    def set_gbps(gbps: float) -> None:
        asyncio.run(set_link(cfg.host, topo.layout.link_control_port, gbps=gbps))

    def live(rid: str) -> dict:
        return httpx.get(topo.url + "/pdd/requests", timeout=30).json().get(rid, {})

    rld = topo.procs["rld0"]
    set_gbps(0.0005)
    stopped = False
    try:
        ca = run(a, 300, start_only=True)
        deadline = time.monotonic() + 60  # bounds on the waits, not timing asserts
        while not ca.tokens and ca.error is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert ca.tokens, ca.error
        cb = run(b, 600, start_only=True)
        while "rld" not in cb.tiers and cb.error is None and time.monotonic() < deadline:
            time.sleep(0.002)
        assert "rld" in cb.tiers, (cb.tiers, cb.error)
        os.kill(rld.pid, signal.SIGSTOP)
        stopped = True
        while not live(cb.rid).get("md_reserved") and cb.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live(cb.rid).get("md_reserved"), (live(cb.rid), cb.error)
        set_gbps(0.05)
        deadline = time.monotonic() + 60
        while not live(cb.rid).get("kv_ready") and cb.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert live(cb.rid).get("kv_ready"), (live(cb.rid), cb.error)
    finally:
        if stopped:
            os.kill(rld.pid, signal.SIGCONT)
        set_gbps(0.05)
    assert cb.wait(60) and cb.error is None, cb.error
    assert ca.wait(60) and ca.error is None, ca.error
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    st = topo.stats()
    assert st["totals"]["md_predicted_fills"] == fills_before + 1, st["totals"]
    assert cb.summary["md_cached_tokens"] < 400 // PAGE_TOKENS * PAGE_TOKENS, cb.summary
    # B was handed over to MD (early, or at MD's kv_ready if the live estimate put it off)
    assert cb.summary["handoff_pos"] is not None, json.dumps(cb.summary)
    assert st["totals"]["early_handoffs"] >= 3, st["totals"]

    outs, _ = greedy_oracle(small_model, [d, b], 600)
    assert [cd.tokens, cb.tokens] == outs
    outs, _ = greedy_oracle(small_model, [e, a], 300)
    assert [ce.tokens, ca.tokens] == outs
    assert st["totals"]["md_predicted_sends"] >= 4, st["totals"]
    assert st["wan_bytes"] == st["wan_bytes_expected"], st
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl
