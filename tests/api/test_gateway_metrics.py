"""The gateway's /metrics against what its clients saw, exactly: prompt and generated tokens equal
the ``usage`` the responses carried (a cancelled stream's tokens counted too), one TTFT per choice
that got a first token, one end-to-end latency per completed choice, admission's own 429s outside
the outcomes; plus the fault counters of /pdd/stats totals and ITL buckets wide enough for a
recovery's wait. The real orchestrator and HTTP app over scripted tiers (``ScriptedOrch``)."""

from __future__ import annotations

import asyncio
import json

import pytest
from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from pdd.config import ClusterConfig
from pdd.gateway.metrics import prefill_start, request_intervals
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.phase import Phase
from pdd.topology import layout
from pdd.types import SamplingParams
from tests.api.test_gateway_outcomes import (BODY, FinishedBeforeRefusalOrch, colocated_client, ScriptedOrch, _settled,  # noqa: F401
                                             gateway, leave_mid_stream)


def _values(text: str) -> dict:
    """``{"name{label=value,...}": value}`` of a Prometheus exposition, histograms' _count and
    _bucket included (no _created)."""
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if not s.name.endswith("_created"):
                labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
                out[f"{s.name}{{{labels}}}" if labels else s.name] = s.value
    return out


async def _scrape(client) -> dict:
    return _values((await client.get("/metrics")).text)


def _delta(before: dict, after: dict, *names: str) -> dict:
    return {n: after.get(n, 0.0) - before.get(n, 0.0) for n in names}


COUNTED = ("pdd_gateway_prompt_tokens_total", "pdd_gateway_generation_tokens_total",
           "pdd_gateway_ttft_seconds_count{pipeline=colocated}",
           "pdd_gateway_e2e_request_latency_seconds_count{pipeline=colocated}",
           "pdd_gateway_itl_seconds_count{pipeline=colocated,tier=c}")


async def test_token_counters_and_histogram_counts_equal_what_the_clients_saw(gateway):
    client, orch, _ = gateway
    m0 = await _scrape(client)
    # non-streamed, to max_tokens
    r = await client.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 5})
    u1 = r.json()["usage"]
    await _settled(orch, 1)
    m1 = await _scrape(client)
    assert _delta(m0, m1, *COUNTED) == dict(zip(COUNTED, (u1["prompt_tokens"], 5, 1, 1, 4)))
    # streamed, n=2, with the usage chunk
    r = await client.post("/v1/completions", json={**BODY, "n": 2, "max_tokens": 4,
                                                   "stream_options": {"include_usage": True}})
    u2 = [json.loads(x[6:]) for x in r.text.splitlines() if x.startswith("data: {")][-1]["usage"]
    assert u2["completion_tokens"] == 8
    await _settled(orch, 3)
    m2 = await _scrape(client)
    assert _delta(m1, m2, *COUNTED) == dict(zip(COUNTED, (u2["prompt_tokens"], 8, 2, 2, 6)))
    # chat, non-streamed
    r = await client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}],
                                                        "max_tokens": 3, "ignore_eos": True})
    assert r.status_code == 200, r.text
    u3 = r.json()["usage"]
    await _settled(orch, 4)
    m3 = await _scrape(client)
    assert _delta(m2, m3, *COUNTED) == dict(zip(COUNTED, (u3["prompt_tokens"], 3, 1, 1, 2)))
    # a stop string ends it at the gateway: the tokens its choice got (the tier may have sent more
    # before its abort landed: not the client's, not counted, nor timed)
    r = await client.post("/v1/completions", json={**BODY, "stream": False, "stop": ["lazy dog"]})
    u4 = r.json()["usage"]
    assert r.json()["choices"][0]["finish_reason"] == "stop" and 1 < u4["completion_tokens"] < 400
    await _settled(orch, 5)
    m4 = await _scrape(client)
    assert _delta(m3, m4, *COUNTED) == dict(zip(COUNTED, (u4["prompt_tokens"], u4["completion_tokens"], 1, 1,
                                                          u4["completion_tokens"] - 1)))
    # a refused body counts nothing
    assert (await client.post("/v1/completions", json={**BODY, "max_tokens": -1})).status_code == 400
    assert _delta(m4, await _scrape(client), *COUNTED) == dict.fromkeys(COUNTED, 0.0)
    # a client gone mid-stream after 3 tokens (the tier holds the 4th): its prompt and 3 tokens
    # count, its first token too, no end-to-end latency (it did not complete)
    orch.hold_at = 3
    await leave_mid_stream(client, {**BODY, "max_tokens": 50}, chunks=3)
    await _settled(orch, 6)
    m6 = await _scrape(client)
    assert _delta(m4, m6, *COUNTED) == dict(zip(COUNTED, (u1["prompt_tokens"], 3, 1, 0, 2)))
    assert m6["pdd_gateway_outcomes_total{outcome=completed}"] == 5
    assert m6["pdd_gateway_outcomes_total{outcome=cancelled}"] == 1


def test_request_intervals_split_a_choices_life_as_vllm_does():
    """arrival 10.0, sent to the tiers 10.25, first token 10.75, last 13.0: queue 0.25 + prefill
    0.5 = TTFT 0.75, decode 2.25, inference 2.75; sent at arrival: queue 0; a send time outside
    [arrival, first token] (clock order lost) counts nothing negative."""
    assert request_intervals(10.0, 10.25, 10.75) == {"queue": 0.25, "prefill": 0.5}
    assert request_intervals(10.0, 10.25, 10.75, 13.0) == {"queue": 0.25, "prefill": 0.5, "decode": 2.25,
                                                           "inference": 2.75}
    assert request_intervals(10.0, 10.0, 10.5, 11.0) == {"queue": 0.0, "prefill": 0.5, "decode": 0.5,
                                                         "inference": 1.0}
    assert request_intervals(10.0, 12.0, 11.0) == {"queue": 1.0, "prefill": 0.0}
    assert request_intervals(10.0, 9.0, 11.0) == {"queue": 0.0, "prefill": 1.0}


async def test_the_queue_time_ends_when_the_prompt_is_sent_to_its_instance():
    """The real orchestrator's colocated start: its prompt's send to the instance is recorded once
    (``prefill_sent``), before the instance gets it, and is where the prefill time begins; the
    first attempt's, not a recovery's. Without it: the first move to prefill, else the arrival."""
    from tests.gateway.fake_peer import FakePeer

    cfg = ClusterConfig.model_validate({"mode": "colocated"})
    orch = Orchestrator(cfg, layout(cfg))
    seen = {}

    class Instance(FakePeer):
        async def call(self, h, payload=b"", timeout=None):
            self._record(h)
            if h.get("t") == "generate":
                seen[h["rid"]] = dict(orch.reqs[h["rid"]].events)
                return {"t": "generate_ok", "rid": h["rid"], "p_cached_tokens": 0}, b""
            return {"t": "ok"}, b""

    orch.peers = {s.name: Instance() for s in orch.layout.engines}
    st = await orch.start_request([1, 2, 3], SamplingParams(max_tokens=4))
    assert "prefill_sent" in seen[st.rid]  # recorded before the instance got the prompt
    sent = st.events["prefill_sent"]
    moved = next(t for ph, t in st.life.history if ph is Phase.PREFILL)
    assert st.t_arrival <= moved <= sent and prefill_start(st) == sent
    orch._prefill_sent(st)  # a later attempt's send keeps the first
    assert st.events["prefill_sent"] == sent
    del st.events["prefill_sent"]
    assert prefill_start(st) == moved
    await orch.abort(st, "client_disconnect")


PHASES = ("pdd_gateway_request_queue_time_seconds_count{pipeline=colocated}",
          "pdd_gateway_request_prefill_time_seconds_count{pipeline=colocated}",
          "pdd_gateway_request_decode_time_seconds_count{pipeline=colocated}",
          "pdd_gateway_request_inference_time_seconds_count{pipeline=colocated}",
          "pdd_gateway_request_prompt_tokens_count", "pdd_gateway_request_prompt_tokens_sum",
          "pdd_gateway_request_generation_tokens_count", "pdd_gateway_request_generation_tokens_sum",
          "pdd_gateway_request_success_total{finished_reason=stop}",
          "pdd_gateway_request_success_total{finished_reason=length}",
          "pdd_gateway_request_success_total{finished_reason=abort}")


async def test_phase_histograms_lengths_and_finish_reasons_follow_known_traffic(gateway):
    """One choice to max_tokens (length), n=2 to max_tokens (2 x length), one ended by a stop string
    (stop), one whose client left after 3 tokens (abort = cancelled), a refused body (nothing):
    queue and prefill times one per choice that got a first token (5, as TTFT) and add up to its
    TTFT; decode and inference times, prompt and output lengths one per choice that finished
    stop / length (4), the lengths' sums the prompts' and the tokens the clients got."""
    client, orch, _ = gateway
    m0 = await _scrape(client)
    r = await client.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 5})
    n_prompt = r.json()["usage"]["prompt_tokens"]
    r = await client.post("/v1/completions", json={**BODY, "stream": False, "n": 2, "max_tokens": 4})
    assert [c["finish_reason"] for c in r.json()["choices"]] == ["length", "length"]
    r = await client.post("/v1/completions", json={**BODY, "stream": False, "stop": ["lazy dog"]})
    assert r.json()["choices"][0]["finish_reason"] == "stop"
    n_stop = r.json()["usage"]["completion_tokens"]
    assert (await client.post("/v1/completions", json={**BODY, "max_tokens": -1})).status_code == 400
    orch.hold_at = 3
    await leave_mid_stream(client, {**BODY, "max_tokens": 50}, chunks=3)
    await _settled(orch, 5)
    m = await _scrape(client)
    assert _delta(m0, m, *PHASES) == dict(zip(PHASES, (5, 5, 4, 4, 4, 4 * n_prompt, 4, 5 + 4 + 4 + n_stop, 1, 3, 1)))
    ttft = _delta(m0, m, "pdd_gateway_ttft_seconds_sum{pipeline=colocated}",
                  "pdd_gateway_request_queue_time_seconds_sum{pipeline=colocated}",
                  "pdd_gateway_request_prefill_time_seconds_sum{pipeline=colocated}")
    assert list(ttft.values())[0] == pytest.approx(sum(list(ttft.values())[1:]))
    # lengths land in their buckets: outputs 5, 4, 4 and n_stop (> 5) tokens, prompts of n_prompt
    assert _delta(m0, m, "pdd_gateway_request_generation_tokens_bucket{le=5.0}")[
        "pdd_gateway_request_generation_tokens_bucket{le=5.0}"] == 3 + (n_stop <= 5)
    assert m["pdd_gateway_request_success_total{finished_reason=abort}"] == m[
        "pdd_gateway_outcomes_total{outcome=cancelled}"]


async def test_admissions_own_429_is_in_rejected_total_not_in_the_outcomes(tiny_model):
    """max_inflight_requests 1 and one request in flight: the next gets admission's 429, counted
    in pdd_gateway_rejected_total{reason="inflight"} (API requests), not in the outcomes (which
    count the choices admission let in) nor in the prompt tokens."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    async with colocated_client(tiny_model, ScriptedOrch, limits={"max_inflight_requests": 1}) as (orch, client):
        orch.hold_at = 1  # the first request stays in flight until its client leaves
        held = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "stream": False}))
        while not orch.fed:  # its first token was fed: admitted and running
            await asyncio.sleep(0.01)
        r = await client.post("/v1/completions", json={**BODY, "stream": False, "n": 3})
        assert r.status_code == 429, r.text
        m = await _scrape(client)
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
    assert m["pdd_gateway_rejected_total{reason=inflight}"] == 1
    assert m["pdd_gateway_admitted_total"] == 1
    assert m["pdd_gateway_outcomes_total{outcome=rejected}"] == 0
    assert m["pdd_gateway_prompt_tokens_total"] == len(tok.encode("hello there").ids)


async def test_a_request_refused_while_its_choices_start_has_no_ttft(tiny_model):
    """n=3 whose choice 0 ran to its last token (2 tokens) before choices 1 and 2 were refused for
    now (429): the client got no token, so no TTFT, ITL or generated token is counted (a live run
    counted 5 TTFTs for 3 requests served, its 2 others refused so)."""
    async with colocated_client(tiny_model, FinishedBeforeRefusalOrch) as (orch, client):
        r = await client.post("/v1/completions", json={**BODY, "n": 3, "max_tokens": 2, "stream": False})
        assert r.status_code == 429, r.text
        await _settled(orch, 3)
        assert orch.fed[orch.first] == 2  # the tier did make choice 0's tokens
        m = await _scrape(client)
    assert m["pdd_gateway_outcomes_total{outcome=rejected}"] == 3
    assert _delta({}, m, *COUNTED) == dict.fromkeys(COUNTED, 0.0)


async def test_http_requests_by_route_method_and_status_follow_known_traffic(tiny_model):
    """Every HTTP answer counted once its response ended, by route template, method and status:
    a completion (200), a refused body (400), admission's 429 before routing (its route found by
    path), the model cards (the {model} route by its template), an unknown path (handler none),
    HEAD /health, a wrong method (405) and an unknown one (method other), and the scrape itself."""
    async with colocated_client(tiny_model, ScriptedOrch, limits={"max_inflight_requests": 1}) as (orch, client):
        m0 = await _scrape(client)
        r = await client.post("/v1/completions", json={**BODY, "stream": False, "max_tokens": 2})
        assert r.status_code == 200
        assert (await client.post("/v1/completions", json={**BODY, "max_tokens": -1})).status_code == 400
        assert (await client.get("/v1/models")).status_code == 200
        assert (await client.get("/v1/models/pdd-tiny")).status_code == 200
        assert (await client.get("/nope")).status_code == 404
        assert (await client.head("/health")).status_code == 200
        assert (await client.get("/v1/completions")).status_code == 405
        assert (await client.request("BREW", "/health")).status_code == 405
        orch.hold_at = 1  # a request in flight until its client leaves: the next is admission's 429
        held = asyncio.ensure_future(client.post("/v1/completions", json={**BODY, "stream": False}))
        while len(orch.fed) < 2:  # its first token was fed: admitted and running
            await asyncio.sleep(0.01)
        assert (await client.post("/v1/completions", json={**BODY, "stream": False})).status_code == 429
        m = await _scrape(client)
        held.cancel()
        await asyncio.gather(held, return_exceptions=True)
    got = {k: v - m0.get(k, 0.0) for k, v in m.items()
           if k.startswith("pdd_gateway_http_requests_total") and v != m0.get(k, 0.0)}
    req = "pdd_gateway_http_requests_total{{handler={},method={},status={}}}".format
    assert got == {req("/v1/completions", "POST", 200): 1, req("/v1/completions", "POST", 400): 1,
                   req("/v1/completions", "POST", 429): 1, req("/v1/models", "GET", 200): 1,
                   req("/v1/models/{model:path}", "GET", 200): 1, req("none", "GET", 404): 1,
                   req("/health", "HEAD", 200): 1, req("/v1/completions", "GET", 405): 1,
                   req("/health", "other", 405): 1, req("/metrics", "GET", 200): 1}
    dur = "pdd_gateway_http_request_duration_seconds_count{handler=/v1/completions,method=POST}"
    assert m[dur] - m0.get(dur, 0.0) == 3


def test_fault_counters_itl_buckets_and_process_metrics():
    """/pdd/stats totals' fault counters are on /metrics too, the live WAN estimate in bytes/s; a
    4 s gap between two tokens (a request waiting for a lost instance's recovery) lands in a bucket
    of its own, not +Inf."""
    orch = Orchestrator(ClusterConfig.model_validate({"mode": "pdd"}), layout(ClusterConfig.model_validate({"mode": "pdd"})))
    orch.totals.update(recoveries=5, recovered=3, degraded=2, instances_lost=4, kv_awaited_expired=1)
    orch.metrics.itl.labels("p_rld_md", "rld").observe(4.0)
    orch.wan_gbps_live = 0.8  # the live WAN estimate, kept in Gbit/s: exported in bytes/s
    m = _values(generate_latest(orch.metrics.registry).decode())
    assert m["pdd_wan_goodput_bytes_per_second"] == 1e8
    assert {k: m[k] for k in ("pdd_gateway_recoveries_total", "pdd_gateway_recovered_total",
                              "pdd_gateway_degraded_total", "pdd_gateway_instances_lost_total",
                              "pdd_gateway_kv_awaited_expired_total")} == {
        "pdd_gateway_recoveries_total": 5, "pdd_gateway_recovered_total": 3, "pdd_gateway_degraded_total": 2,
        "pdd_gateway_instances_lost_total": 4, "pdd_gateway_kv_awaited_expired_total": 1}
    assert m["pdd_gateway_itl_seconds_bucket{le=2.5,pipeline=p_rld_md,tier=rld}"] == 0
    assert m["pdd_gateway_itl_seconds_bucket{le=5.0,pipeline=p_rld_md,tier=rld}"] == 1
    assert m["process_cpu_seconds_total"] > 0


async def test_counters_with_known_labels_are_exported_at_zero_before_anything_counts(gateway):
    """A Prometheus counter is there from the start (at 0), so ``rate()`` and alerts see its first
    increment: the reasons of a 429, the handoff modes and the pipelines were missing until used."""
    client, _, _ = gateway
    m = await _scrape(client)
    assert {k: v for k, v in m.items() if k.startswith("pdd_gateway_rejected_total")} == {
        f"pdd_gateway_rejected_total{{reason={r}}}": 0.0 for r in
        ("concurrency", "inflight", "out_of_pages", "queue_wait", "queued_tokens", "tier_busy", "wan_backlog")}
    assert {k: v for k, v in m.items() if k.startswith("pdd_handoffs_total")} == {
        "pdd_handoffs_total{mode=catch_up}": 0.0, "pdd_handoffs_total{mode=one_shot}": 0.0}
    assert {k: v for k, v in m.items() if k.startswith("pdd_gateway_requests_total")} == {
        f"pdd_gateway_requests_total{{pipeline={p}}}": 0.0 for p in
        ("colocated", "p_d", "p_md", "p_rld", "p_rld_md")}
