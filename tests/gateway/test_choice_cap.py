"""The choices-per-request cap (HTTP 400, docs/OVERLOAD.md "Choices per request") at its exact
boundary, through the real API and orchestrator over fake tiers whose queues are bounded as an
engine's are (tests/gateway/bounded_tiers.py): the largest request the cap admits is served on an
idle gateway, one more choice is refused 400, and that one, let through, would indeed be refused
by a tier (429) on every try.

Found in review of the cap's first version: it was one instance's queue (the smallest of P and
the decoder), so with several instances in a tier a request the tier could hold was refused,
and P was counted as holding every choice at once although a prompt's first choice is prefilled
before the others start (one more fits). The choices of a request are routed one by one, and
routing alone did not keep them within the instances' queues: cache affinity (a prompt's cached
prefix on P, the gateway's index of MD) piled them onto one instance."""

from __future__ import annotations

import asyncio
import dataclasses

import httpx
import pytest

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator
from pdd.topology import ROLE_PREFILL, layout
from tests.gateway.bounded_tiers import MD, P, Tiers

PAGE = 16
PROMPT = list(range(100, 140))  # 40 tokens: 2 whole pages (80% of it cached once prefilled)


@pytest.fixture
async def gateway(tiny_model):
    """make(mode, places per P, Ps, places per MD, MDs) -> (httpx client, orchestrator, {name:
    fake tier}, admission); every engine's queue is ``max_running`` places (tier_max_waiting 0)."""
    from tokenizers import Tokenizer

    from pdd.gateway.api import create_app

    clients = []

    def make(mode: str, p_places: int, n_p: int, md_places: int, n_md: int, wan_gbps: float = 0.05):
        cfg = ClusterConfig.model_validate({
            "mode": mode, "model_path": tiny_model, "served_model_name": "pdd-tiny",
            "engine": {"max_model_len": 512, "max_input_len": 400, "page_size": PAGE},
            "instances": {"prefill": n_p, "main_decode": n_md},
            "tiers": {"prefill": {"engine": {"max_running": p_places}},
                      "main_decode": {"engine": {"max_running": md_places}}},
            "limits": {"tier_max_waiting": 0}, "link": {"wan_gbps": wan_gbps}})
        lay = layout(cfg)
        orch = Orchestrator(cfg, lay)
        tiers = Tiers(orch, PAGE)
        fake = {sp.name: (P if sp.role == ROLE_PREFILL else MD)(tiers, sp.name, cfg.engine_for(sp.name).max_running)
                for sp in lay.engines}
        orch.peers = dict(fake)
        app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
        client = httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://t", timeout=60)
        clients.append(client)
        return client, orch, fake, app.state.admission

    yield make
    for c in clients:
        await c.aclose()


async def _post(client, n: int, prompts: int = 1):
    prompt = PROMPT if prompts == 1 else [[t + 40 * i for t in PROMPT] for i in range(prompts)]
    return await client.post("/v1/completions", json={"prompt": prompt, "n": n, "max_tokens": 2,
                                                       "ignore_eos": True, "seed": 1})


def _served(r, choices: int) -> None:
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(choices))
    assert all(c["finish_reason"] == "length" for c in r.json()["choices"])


def _refused(r, param: str, message: str) -> None:
    assert r.status_code == 400, r.text
    assert "retry-after" not in r.headers
    assert r.json()["error"] == {"message": message, "type": "invalid_request_error", "param": param, "code": None}


async def _tier_refuses(client, orch, adm, n: int, prompts: int = 1) -> None:
    """Without the cap, the same request is refused by a tier (429), on a retry too."""
    capped = adm.limits
    adm.limits = dataclasses.replace(capped, max_choices=None, max_prefills=None)
    try:
        for _ in range(2):
            r = await _post(client, n, prompts)
            assert r.status_code == 429, r.text
            assert "TierBusy" in r.json()["error"]["message"]
    finally:
        adm.limits = capped
    for _ in range(1000):  # the refused request's started choices end in background tasks
        if not orch.reqs and not any(orch.holding.values()):
            break
        await asyncio.sleep(0)
    assert not orch.reqs and not any(orch.holding.values()), (orch.holding, orch.inflight)  # no place is left held


async def test_one_p_holds_one_choice_more_than_its_queue(gateway):
    """One P of 2 places, one MD of 16: a prompt's first choice is prefilled alone, then the
    other n - 1 together, so n 3 runs 2 prefills at once and is served; n 4 is 400 naming P's
    queue (the first version's cap, the smallest queue, refused n 3)."""
    client, orch, fake, adm = gateway("cross_dc_pd", 2, 1, 16, 1)
    _served(await _post(client, 3), 3)
    assert (fake["p0"].peak, fake["p0"].refused, fake["md0"].peak) == (2, 0, 3)
    assert (adm.limits.max_prefills, adm.limits.max_choices) == (2, 16)
    _refused(await _post(client, 4), "n", (
        "n (4): 4 choices requested, 3 of them prefilled at once (each prompt's first choice is prefilled first, "
        "then its other n - 1 together); at most 2 prefills per request run at once (each holds a place of a "
        "prefill instance's queue until it returns; the active prefill instances hold 2: p0 (engine.max_running 2 "
        "+ limits.tier_max_waiting 0)); lower n"))
    await _tier_refuses(client, orch, adm, 4)
    _served(await _post(client, 3), 3)  # and the boundary is served again after the refusals


async def test_two_ps_hold_the_sum_of_their_queues(gateway):
    """Two Ps of 2 places: the siblings, which all prefer the P that cached their prompt, spread
    over both once it is full: n 5 (4 prefills at once) is served, n 6 is 400."""
    client, orch, fake, adm = gateway("cross_dc_pd", 2, 2, 16, 1)
    _served(await _post(client, 5), 5)
    assert sorted(fake[p].peak for p in ("p0", "p1")) == [2, 2]
    assert fake["p0"].refused == fake["p1"].refused == 0
    r = await _post(client, 6)
    assert r.status_code == 400 and "at most 4 prefills per request" in r.json()["error"]["message"], r.text
    await _tier_refuses(client, orch, adm, 6)


@pytest.mark.parametrize("mode,md,wan_gbps", [("cross_dc_pd", "md", 0.05), ("cross_dc_pd", "md", 0.001),
                                              ("same_dc_pd", "d", 0.05)],
                         ids=["md_index", "md_siblings_follow", "d_cache"])
async def test_two_decoders_hold_the_sum_of_their_queues(gateway, mode, md, wan_gbps):
    """Two MDs (D in same_dc_pd) of 2 places, P large: n 4 is served with 2 choices on each; what
    draws them all to the first one until it is full: the gateway's index of MD, D's cache, or on
    a slow line the siblings reserving on the first choice's MD after its KV (policy.sibling_kv_once).
    n 5 is 400 naming both queues."""
    client, orch, fake, adm = gateway(mode, 16, 1, 2, 2, wan_gbps)
    _served(await _post(client, 4), 4)
    follow = [h for h in fake[f"{md}0"].sent + fake[f"{md}1"].sent if h["t"] == "reserve" and "after" in h]
    assert len(follow) == (1 if wan_gbps < 0.01 else 0)  # the one sibling the first MD still had room for
    assert (fake[f"{md}0"].peak, fake[f"{md}1"].peak, fake[f"{md}0"].refused, fake[f"{md}1"].refused) == (2, 2, 0, 0)
    _refused(await _post(client, 5), "n", (
        "n (5): 5 choices requested; at most 4 choices per request are served (each choice holds a place of an "
        "instance's queue on every tier it passes until it leaves that tier; the active main_decode instances hold "
        f"4: {md}0, {md}1 (engine.max_running 2 + limits.tier_max_waiting 0 each)); lower n"))
    await _tier_refuses(client, orch, adm, 5)


async def test_a_batch_counts_each_prompts_prefills(gateway):
    """One P of 2 places: 2 prompts x n 2 run 2 prefills at once (the first choices together,
    then the second ones) and are served; 2 prompts x n 3 run 4 and are 400."""
    client, orch, fake, adm = gateway("cross_dc_pd", 2, 1, 16, 1)
    _served(await _post(client, 2, prompts=2), 4)
    assert fake["p0"].peak == 2 and fake["p0"].refused == 0
    r = await _post(client, 3, prompts=2)
    assert r.status_code == 400 and r.json()["error"]["message"].startswith(
        "2 prompts x n (3): 6 choices requested, 4 of them prefilled at once"), r.text
    await _tier_refuses(client, orch, adm, 3, prompts=2)

