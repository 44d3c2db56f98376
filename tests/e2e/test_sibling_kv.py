"""The n choices of one prompt ship its KV across the WAN once (pdd.policy.siblings).

A cold 100-token prompt with ``n`` = 3: choice 0 sends 100 tokens' KV to MD; the other two
reserve on the same MD after that KV is in its radix cache and send only the prompt's partial
last page (4 tokens), so the WAN carries (100 + 2 x 4) tokens' KV instead of 3 x 100. In
``cross_dc_pd`` all three are P->MD; in ``pdd`` (50 ms budget) the cold prompt is relayed, and
so are its siblings (their MD reservations wait, their first tokens do not). Greedy outputs of
every choice equal a single engine's; every page is free afterwards.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

SLOT = 2048  # small preset: KV bytes per token


@pytest.mark.parametrize("mode, once", [("cross_dc_pd", True), ("pdd", True), ("cross_dc_pd", False)])
def test_choices_ship_the_prompt_kv_once(small_model, topology_factory, mode, once):
    """... and with the ablation ``sibling_kv_once: false`` every choice ships its own copy (with
    ``md_wait_claims: false`` too: else a choice routed once an earlier one's KV is being sent
    waits for it, as any request whose prefix is on its way to MD)."""
    cfg = make_cfg(small_model, mode, engine={"device": "cpu", "page_size": 16},
                   policy={"pipeline_ttft_budget_ms": 50, "sibling_kv_once": once, "md_wait_claims": once},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    topo = topology_factory(cfg)
    prompt = [random.Random(5).randrange(5, 4000) for _ in range(100)]
    (want,), _ = greedy_oracle(small_model, [prompt], 8)
    body = {"model": cfg.served_model_name, "prompt": prompt, "max_tokens": 8, "temperature": 0,
            "ignore_eos": True, "n": 3, "stream": True}
    toks: dict[int, list[int]] = {0: [], 1: [], 2: []}
    with httpx.stream("POST", f"{topo.url}/v1/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                chunk = json.loads(line[6:])
                if "pdd" in chunk:  # one token of one choice: its id in the pdd extension
                    toks[chunk["choices"][0]["index"]].append(chunk["pdd"]["token_id"])
    assert toks == {0: want, 1: want, 2: want}
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    g = topo.stats()["totals"]
    assert g["wan_bytes_expected"] == ((100 + 2 * 4) if once else 3 * 100) * SLOT, g
    assert g["wan_bytes_sent"] == g["wan_bytes_expected"]
    pipelines = {"cross_dc_pd": "p_md", "pdd": "p_rld_md"}[mode]
    assert topo.stats()["pipelines"] == {pipelines: 3}
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl


def test_siblings_of_a_cut_off_choice_do_not_hang(small_model, topology_factory):
    """``pdd``, 2 output tokens: RLD finishes every choice long before the cold prompt's KV
    crosses, so choice 0's transfer is cut off while its siblings' reservations wait on it; they
    go on (MD frees choice 0's pages and wakes them), every choice completes, the WAN byte balance
    holds and no page leaks."""
    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu", "page_size": 16},
                   policy={"pipeline_ttft_budget_ms": 50, "cutoff_min_remaining_s": 0},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0)
    topo = topology_factory(cfg)
    prompt = [random.Random(6).randrange(5, 4000) for _ in range(600)]
    r = httpx.post(f"{topo.url}/v1/completions", json={"model": cfg.served_model_name, "prompt": prompt,
                                                         "max_tokens": 2, "temperature": 0, "ignore_eos": True,
                                                         "n": 3, "logprobs": 0}, timeout=60)
    assert r.status_code == 200, r.text
    body = r.json()
    assert [c["finish_reason"] for c in body["choices"]] == ["length"] * 3
    texts = {c["text"] for c in body["choices"]}
    assert len(texts) == 1
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    g = topo.stats()["totals"]
    assert g["wan_bytes_sent"] == g["wan_bytes_expected"], g
    assert g["cut_offs"] >= 1, g
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl
