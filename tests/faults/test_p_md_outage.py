"""WAN outage for a request planned P->MD (a TTFT budget the WAN meets): the outage is found by
heartbeats and the request is recovered through a relay (prompt + streamed tokens re-prefilled on
P, RLD decodes; no MD reachable: degraded, counted). Output equals a single-engine greedy run."""

from __future__ import annotations

import random
import time
from pathlib import Path

import pytest

from pdd.faults import FaultInjector, StreamClient
from pdd.launch import Topology
from tests.e2e.conftest import TEST_DEVICE, make_cfg

pytestmark = [pytest.mark.faults, pytest.mark.slow]

MAX_TOKENS = 40


def test_wan_outage_on_p_md_recovers_through_relay(tmp_path, small_model):
    import torch

    from pdd.engine.engine import Engine
    from pdd.types import SamplingParams

    prompt = [random.Random(77).randrange(5, 4000) for _ in range(64)]
    torch.set_num_threads(1)
    eng = Engine.from_pretrained(small_model, num_pages=256, page_size=16, device=TEST_DEVICE)
    s = eng.new_sequence("ref", prompt, SamplingParams(max_tokens=MAX_TOKENS, ignore_eos=True), use_cache=False)
    eng.add(s)
    while eng.has_work():
        eng.step()
    ref = list(s.output_ids)

    # MD's step held to >= 50 ms: its 39 decode steps then last >= 1.9 s, so the outage, started
    # once the gateway reports md_decode, lands while MD still streams (unheld they took ~0.2 s, and
    # a busy machine could let MD send its last token before the outage began)
    cfg = make_cfg(small_model, "pdd", link={"wan_gbps": 1.0, "wan_rtt_ms": 2.0, "wan_jitter_ms": 0.0},
                   policy={"pipeline_ttft_budget_ms": 1000.0},
                   tiers={"main_decode": {"engine": {"min_step_ms": 50.0}}},
                   liveness={"heartbeat_interval_s": 0.25, "dead_after_s": 1.5}, request_timeout_s=60.0)
    topo = Topology(cfg, log_dir=tmp_path / "logs")
    topo.start()
    inj = FaultInjector(topo)
    try:
        c = StreamClient(topo.url, {"prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0,
                                    "ignore_eos": True}).start()
        rid, view = inj.wait_phase("md_decode", timeout_s=30)
        assert view["pipeline"] == "p_md"
        rec = inj.wan_outage(2.5, rid)
        assert rec.phase == "md_decode"
        assert c.wait(60), "stream hung"
        assert c.error is None and c.tokens == ref, (c.error, c.tokens, ref)
        assert c.tiers[0] == "md" and c.tiers[-1] == "rld"  # MD first, the relay after the outage
        assert c.summary["pipeline"] == "p_rld"  # recovered attempt: degraded (no MD reachable)
        time.sleep(1.5)  # the outage ends; the gateway reconnects MD on flush
        inj.restore_wan()
        assert topo.wait_idle(timeout_s=30), topo.last_busy
        fl = topo.flush()
        assert not [n for n, v in fl["instances"].items() if "error" in v] and fl["leaked_pages"] == 0, fl
        totals = topo.stats()["totals"]
        assert totals["recovered"] == 1 and totals["degraded"] == 1, totals
    finally:
        inj.close()
        topo.stop()
