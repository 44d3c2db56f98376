"""Overload on a live topology: a tier whose bounded queue is full (engine.max_running 1,
limits.tier_max_waiting 0) refuses new work with TierBusy and the gateway answers 429 with
Retry-After; once the load is gone the same requests are served. No timing assertions."""

from __future__ import annotations

import asyncio

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_full_tier_queue_gives_429_then_normal_service(tiny_model, tmp_path):
    from pdd.launch import Topology
    from tests.e2e.conftest import make_cfg

    cfg = make_cfg(tiny_model, "pdd", model_preset="tiny", served_model_name="tiny",
                   engine={"num_pages": 256, "max_model_len": 512, "max_input_len": 256, "max_running": 1},
                   limits={"tier_max_waiting": 0, "max_inflight_requests": 0, "max_queue_wait_s": 0,
                           "max_queued_prompt_tokens": 0})
    body = {"prompt": list(range(20, 60)), "max_tokens": 300, "ignore_eos": True, "temperature": 0}
    with Topology(cfg, log_dir=tmp_path / "logs") as topo:

        async def burst(n: int):
            async with httpx.AsyncClient(trust_env=False, timeout=120) as c:
                return await asyncio.gather(*(c.post(topo.url + "/v1/completions", json=body) for _ in range(n)))

        rs = asyncio.run(burst(6))
        codes = sorted(r.status_code for r in rs)
        assert 200 in codes and 429 in codes and set(codes) <= {200, 429}, codes
        for r in rs:
            if r.status_code == 429:
                assert int(r.headers["retry-after"]) >= 1
                err = r.json()["error"]
                assert err["type"] == "rate_limit_error" and "TierBusy" in err["message"]
            else:
                assert r.json()["usage"]["completion_tokens"] == 300
        adm = topo.stats()["admission"]
        assert adm["rejected"].get("tier_busy", 0) == codes.count(429) and adm["inflight"] == 0
        # the load is gone: served as usual, and no page leaked by the refusals
        r = httpx.post(topo.url + "/v1/completions", json={**body, "max_tokens": 4}, timeout=120, trust_env=False)
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4
        assert topo.wait_idle(60), topo.last_busy
        assert topo.flush()["leaked_pages"] == 0
