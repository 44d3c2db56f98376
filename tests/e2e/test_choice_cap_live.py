"""The choices-per-request cap (docs/OVERLOAD.md "Choices per request") at its exact boundary on a
live pdd topology: one P of 3 places, two relay decoders and two MDs of 2 (engine.max_running 2,
limits.tier_max_waiting 0), the default pipeline budget (the tiny model's short prompt goes
P->MD, planned on MD's reservation: MD's refusal fails it, so MD counts). The largest request
admitted, n 4, holds 2 places of each relay decoder and of each MD and runs 3 prefills at once on
P (the first choice alone, then the other three): served whole, no tier refusing a choice, none
degraded; n 5 is 400. The first version of the cap (one instance's queue, the smallest: 2)
refused n 3 already; with the sum but without routing by the places held, the siblings followed
the first choice's prefix to one MD and n 4 was 429 on every try. Exact counts, no timing."""

from __future__ import annotations

import httpx
import pytest

pytestmark = pytest.mark.slow


def test_largest_admitted_request_is_served_and_one_more_choice_is_400(tiny_model, topology_factory):
    from tests.e2e.conftest import make_cfg

    cfg = make_cfg(tiny_model, "pdd", model_preset="tiny", served_model_name="tiny",
                   instances={"prefill": 1, "relay_decode": 2, "main_decode": 2},
                   engine={"num_pages": 256, "max_model_len": 512, "max_input_len": 256, "max_running": 2},
                   tiers={"prefill": {"engine": {"max_running": 3}}},
                   limits={"tier_max_waiting": 0}, policy={"pipeline_ttft_budget_ms": 50})
    topo = topology_factory(cfg)
    lim = topo.stats()["admission"]["limits"]
    assert (lim["max_choices_per_request"], lim["max_prefills_per_request"]) == (4, 3)
    body = {"model": "tiny", "prompt": list(range(20, 60)), "max_tokens": 48, "ignore_eos": True, "seed": 3}

    def post(**over):
        return httpx.post(topo.url + "/v1/completions", json={**body, **over}, timeout=120, trust_env=False)

    for _ in range(2):  # the boundary is served, again once the topology is idle
        r = post(n=4)
        assert r.status_code == 200, r.text
        assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2, 3]
        assert r.json()["usage"]["completion_tokens"] == 4 * 48
        assert topo.wait_idle(60), topo.last_busy
    r = post(prompt=[list(range(20, 60)), list(range(60, 100))], n=2)  # 4 choices, 2 prefills at once
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 4 * 48, r.text
    assert topo.wait_idle(60), topo.last_busy
    r = post(n=5)
    assert r.status_code == 400 and "retry-after" not in r.headers, r.text
    assert r.json()["error"] == {
        "message": "n (5): 5 choices requested; at most 4 choices per request are served (each choice holds a place "
                   "of an instance's queue on every tier it passes until it leaves that tier; the active relay_decode "
                   "instances hold 4: rld0, rld1 (engine.max_running 2 + limits.tier_max_waiting 0 each)); lower n",
        "type": "invalid_request_error", "param": "n", "code": None}
    stats = topo.stats()
    assert stats["admission"]["rejected"] == {} and stats["totals"]["degraded"] == 0
    assert stats["totals"]["completed"] == 3 * 4 and stats["totals"]["rejected"] == 0
    assert topo.flush()["leaked_pages"] == 0
