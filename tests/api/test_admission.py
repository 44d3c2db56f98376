"""Admission control: the pure decision, the prefill-rate estimate, the derived limits, and the
HTTP behaviour (429 + Retry-After + OpenAI-style rate-limit body when a limit is hit, normal
service after), also when a tier's bounded queue refuses (TierBusy). No timing assertions."""

from __future__ import annotations

import pytest

from pdd.config import ClusterConfig
from pdd.gateway.admission import (Admission, AdmissionLimits, AdmissionState, PrefillRate, decide,
                                   is_tier_busy, resolve_limits)
from pdd.topology import layout

LIM = AdmissionLimits(max_inflight=4, max_queued_tokens=1000, max_wait_s=2.0, retry_after_max_s=30)


def test_decide_admits_within_every_limit():
    assert decide(AdmissionState(3, 400, 500.0, 4.0), LIM, 1, 100).admit


def test_decide_inflight_limit_and_retry_after_from_service_time():
    d = decide(AdmissionState(4, 0, None, 6.0), LIM, 1, 10)
    assert (d.admit, d.reason) == (False, "inflight")
    assert d.retry_after_s == 2  # one slot over 4: 6 s x 1 / 4 = 1.5 s -> 2
    assert "1 choice requested, 4 of 4 in-flight slots in use" in d.message
    # n choices take n slots, and the message counts choices and slots (not requests)
    d = decide(AdmissionState(2, 0, None, None), LIM, 3, 10)
    assert d.reason == "inflight" and d.retry_after_s == 1  # unmeasured: 1 s
    assert "3 choices requested, 2 of 4 in-flight slots in use" in d.message
    d = decide(AdmissionState(62, 0, None, None), AdmissionLimits(64, None, None), 3, 10)
    assert "3 choices requested, 62 of 64 in-flight slots in use" in d.message
    assert "requests in flight" not in d.message


def test_decide_queued_tokens_cap_applies_before_the_rate_is_known():
    d = decide(AdmissionState(1, 900, None, None), LIM, 1, 200)
    assert (d.admit, d.reason, d.retry_after_s) == (False, "queued_tokens", 1)
    d = decide(AdmissionState(1, 900, 50.0, None), LIM, 1, 200)
    assert d.retry_after_s == 2  # (1100 - 1000) / 50 = 2 s


def test_decide_queue_wait_at_the_measured_rate():
    d = decide(AdmissionState(1, 500, 200.0, None), LIM, 1, 100)  # 600 / 200 = 3 s > 2 s
    assert (d.admit, d.reason, d.retry_after_s) == (False, "queue_wait", 1)
    assert decide(AdmissionState(1, 300, 200.0, None), LIM, 1, 100).admit  # 2.0 s: not over


def test_decide_always_admits_into_an_empty_system():
    big = AdmissionLimits(1, 10, 0.001)
    assert decide(AdmissionState(0, 0, 1.0, None), big, 1, 10_000).admit
    assert decide(AdmissionState(0, 0, None, None), big, 5, 10_000).admit


def test_decide_limits_off_and_retry_cap():
    off = AdmissionLimits(None, None, None)
    assert decide(AdmissionState(10_000, 10**9, 1.0, 1.0), off, 1, 1).admit
    capped = AdmissionLimits(1, None, None, retry_after_max_s=5)
    assert decide(AdmissionState(1, 0, None, 1000.0), capped, 1, 1).retry_after_s == 5
    with pytest.raises(ValueError):
        decide(AdmissionState(), LIM, 0, 1)


def test_prefill_rate_counts_busy_time_only():
    r = PrefillRate(window=64)
    # ten prefills of 100 tokens, 0.1 s apart, each admitted long before (P busy throughout)
    for i in range(10):
        r.completed(1.0 + 0.1 * i, 100, admitted_t=0.0)
    # the first sample spans 0..1.0 (its own admission), the rest 0.1 s each: 1000 / 1.9
    assert r.tokens_per_s == pytest.approx(1000 / 1.9)
    # an idle gap does not dilute it: admitted at 100 s, done at 100.5 s
    r2 = PrefillRate(window=64)
    for i in range(8):
        r2.completed(10.0 * i + 0.5, 100, admitted_t=10.0 * i)
    assert r2.tokens_per_s == pytest.approx(200.0)
    assert PrefillRate().tokens_per_s is None


def test_resolve_limits_defaults_derive_from_the_engines():
    cfg = ClusterConfig.model_validate({"mode": "pdd", "engine": {"max_running": 8, "num_pages": 100, "page_size": 16},
                                        "instances": {"prefill": 2, "main_decode": 3}})
    lim = resolve_limits(cfg, layout(cfg))
    assert lim.max_inflight == (8 + 8) * 3 and lim.max_queued_tokens == 100 * 16 * 2
    assert lim.max_wait_s is None  # latency targets are opt-in
    cfg = cfg.model_copy(update={"limits": cfg.limits.model_copy(update={
        "max_inflight_requests": 0, "max_queued_prompt_tokens": 77, "max_queue_wait_s": 1.5, "tier_max_waiting": 2})})
    lim = resolve_limits(cfg, layout(cfg))
    assert (lim.max_inflight, lim.max_queued_tokens, lim.max_wait_s) == (None, 77, 1.5)
    assert cfg.limits.waiting(8) == 2


def test_admission_tickets_release_once():
    adm = Admission(AdmissionLimits(2, None, None))
    t1, _ = adm.try_admit(1, 50)
    t2, _ = adm.try_admit(1, 50)
    assert adm.inflight == 2 and adm.queued_tokens == 100
    none, d = adm.try_admit(1, 50)
    assert none is None and d.reason == "inflight" and adm.rejected == {"inflight": 1}
    adm.prefilled(t1)
    adm.prefilled(t1)
    assert adm.queued_tokens == 50
    adm.release(t1, completed=True)
    adm.release(t1, completed=True)
    adm.release(t2)
    assert adm.inflight == 0 and adm.queued_tokens == 0 and adm.admitted == 2
    assert adm.service_s is not None


def _start_failure(remote_text: str):
    """The exception the orchestrator raises when a tier's call failed while starting: a
    RequestFailed raised from the RemoteError carrying the tier's error text."""
    from pdd.gateway.orchestrator import RequestFailed
    from pdd.transfer.peer import RemoteError

    try:
        try:
            raise RemoteError(remote_text, {})
        except RemoteError as e:
            raise RequestFailed("request r1 failed while starting: " + str(e)) from e
    except RequestFailed as ex:
        return ex


def test_is_tier_busy_follows_the_cause_chain():
    from pdd.engine.scheduler import TierBusy
    from pdd.gateway.orchestrator import RequestFailed

    assert is_tier_busy(_start_failure("TierBusy: queue full: 16 sequences need compute, the limit is 16"))
    assert is_tier_busy(TierBusy(3, 3))
    assert not is_tier_busy(RequestFailed("request r1 failed: instance p0 is unreachable"))


def test_refusal_names_a_full_queue_or_a_full_kv_pool_at_start():
    """A KV pool that cannot hold a starting request is a refusal to retry (429), as a full
    queue is; other failures are not (a new user got 503s for OutOfPages at modest load)."""
    from pdd.engine.kv_pool import OutOfPages
    from pdd.gateway.admission import refusal
    from pdd.gateway.orchestrator import RequestFailed
    from pdd.transfer.peer import RemoteError

    ex = _start_failure("OutOfPages: out of KV pages: need 207, 101 free (seq r70)")
    assert refusal(ex) == "out_of_pages" and not is_tier_busy(ex)
    assert refusal(OutOfPages(207, 101)) == "out_of_pages"
    assert refusal(RemoteError("TierBusy: queue full", {})) == "tier_busy"
    assert refusal(RequestFailed("request r1 failed: instance p0 is unreachable")) is None


# ------------------------------------------------------------------------------------------ HTTP
@pytest.fixture
def limited(tiny_model):
    """(TestClient, EngineOrch, Admission) with at most 2 requests in flight."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app

    from .conftest import EngineOrch

    eng = Engine.from_pretrained(tiny_model, num_pages=256, page_size=8)
    orch = EngineOrch(eng)
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model,
                                        "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400},
                                        "limits": {"max_inflight_requests": 2}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    with TestClient(app) as client:
        yield client, orch, app.state.admission


BODY = {"prompt": "hello there", "max_tokens": 3, "ignore_eos": True}


def _assert_429(r):
    assert r.status_code == 429, r.text
    assert int(r.headers["retry-after"]) >= 1
    err = r.json()["error"]
    assert err["type"] == "rate_limit_error" and err["code"] == "rate_limit_exceeded" and err["message"]
    assert set(err) == {"message", "type", "param", "code"}


def test_limit_hit_gets_429_with_retry_after_then_normal_service(limited):
    client, orch, adm = limited
    assert client.post("/v1/completions", json=BODY).status_code == 200
    held = [adm.try_admit(1, 10)[0] for _ in range(2)]  # two requests in flight elsewhere
    n_started = len(orch.started)
    r = client.post("/v1/completions", json=BODY)
    _assert_429(r)
    # refused before the body was read (EarlyReject): the slots in use, no choice count
    assert "2 of 2 in-flight slots in use, none free" in r.json()["error"]["message"]
    r = client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2})
    _assert_429(r)
    assert len(orch.started) == n_started  # refused before any tier did work
    assert adm.rejected == {"inflight": 2}
    stats = client.get("/pdd/stats").json()["admission"]
    assert stats["rejected"] == {"inflight": 2} and stats["inflight"] == 2
    for t in held:
        adm.release(t)
    r = client.post("/v1/completions", json=BODY)  # normal service once the load is gone
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3
    r = client.post("/v1/completions", json={**BODY, "stream": True})
    assert r.status_code == 200 and r.text.rstrip().endswith("data: [DONE]")
    assert adm.inflight == 0 and adm.queued_tokens == 0  # every ticket released, streamed ones too


def test_n_choices_count_against_the_limit(limited):
    client, orch, adm = limited
    held, _ = adm.try_admit(1, 10)
    r = client.post("/v1/completions", json={**BODY, "n": 2})  # 1 + 2 choices > 2
    _assert_429(r)
    assert "2 choices requested, 1 of 2 in-flight slots in use" in r.json()["error"]["message"]
    adm.release(held)
    # an empty system admits any request, even one with more choices than the limit
    r = client.post("/v1/completions", json={**BODY, "n": 3})
    assert r.status_code == 200 and len(r.json()["choices"]) == 3
    assert adm.inflight == 0 and adm.rejected == {"inflight": 1}


def test_a_batch_of_prompts_is_admitted_as_one_request(limited):
    """A batch (``prompt`` a list) counts all its choices at once. It used to be admitted prompt by
    prompt: on an idle server the prompts that fit started (prefill, KV sent), the next one was
    refused, and the started ones were stopped and counted failed, on every retry."""
    client, orch, adm = limited
    batch = {**BODY, "prompt": ["a b", "c d", "e f"], "n": 2}  # 6 choices > the limit of 2
    r = client.post("/v1/completions", json=batch)  # an idle server admits any request whole
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == list(range(6))
    assert adm.inflight == 0 and adm.queued_tokens == 0 and adm.admitted == 1  # one ticket for the batch
    held, _ = adm.try_admit(1, 10)
    n_started = len(orch.started)
    _assert_429(client.post("/v1/completions", json=batch))  # refused whole: no prompt started
    assert len(orch.started) == n_started and adm.inflight == 1
    adm.release(held)
    assert adm.inflight == 0


def test_tier_with_a_full_queue_refuses_and_the_gateway_answers_429(limited):
    client, orch, adm = limited
    eng = orch.engine
    eng.max_waiting = 0
    eng.sched_cfg.max_running_seqs = 1
    hold = eng.new_sequence("hold", [5, 6, 7])  # one sequence needing compute fills the tier
    r = client.post("/v1/completions", json=BODY)
    _assert_429(r)
    assert "TierBusy" in r.json()["error"]["message"] and adm.rejected == {"tier_busy": 1}
    assert adm.inflight == 0  # the refused request's ticket is released
    eng.release(hold, cache=False)
    r = client.post("/v1/completions", json=BODY)
    assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] == 3


# ------------------------------------------------------------------------------ adaptive limit
def test_next_limit_aimd():
    from pdd.gateway.admission import DECREASE, LimitState, next_limit

    s = LimitState(2.0)
    s = next_limit(s, True, 0, True, 2, 100)  # slow start: +1 per fast request at the limit
    assert s == LimitState(3.0, 0, True)
    assert next_limit(s, True, 0, False, 2, 100) == s  # the limit did not matter: no growth
    s = next_limit(s, False, 0, True, 2, 100)  # slow: x DECREASE, next epoch, slow start over
    assert s == LimitState(max(2.0, 3.0 * DECREASE), 1, False)
    s = LimitState(40.0, 1, False)
    assert next_limit(s, False, 0, True, 2, 100) == s  # admitted before the last decrease: ignored
    assert next_limit(s, False, 1, True, 2, 100) == LimitState(40.0 * DECREASE, 2, False)
    assert next_limit(s, True, 1, True, 2, 100) == LimitState(40.0 + 1 / 40, 1, False)  # +1 per limit's worth
    assert next_limit(LimitState(100.0, 0, True), True, 0, True, 2, 100).limit == 100.0  # upper bound
    assert next_limit(LimitState(2.0, 0, False), False, 0, True, 2, None).limit == 2.0  # lower bound


def test_adaptive_limit_shrinks_on_slow_first_tokens_and_refuses_beyond_it():
    adm = Admission(AdmissionLimits(64, None, None), ttft_target_s=1e-9, min_inflight=2)
    assert adm.adaptive is not None and adm.effective_limits().max_inflight == 2
    a, _ = adm.try_admit(1, 5)
    b, _ = adm.try_admit(1, 5)
    none, d = adm.try_admit(1, 5)
    assert none is None and d.reason == "inflight"  # 2 in flight: the adaptive limit, not the 64
    adm.first_token(a)  # slower than the (tiny) target
    assert adm.adaptive.limit == 2.0 and adm.adaptive.epoch == 1
    fast = Admission(AdmissionLimits(64, None, None), ttft_target_s=3600.0, min_inflight=2)
    t1, _ = fast.try_admit(1, 5)
    t2, _ = fast.try_admit(1, 5)
    fast.first_token(t1)
    fast.first_token(t1)  # once per request
    assert fast.adaptive.limit == 3.0 and fast.effective_limits().max_inflight == 3
    assert Admission(AdmissionLimits(64, None, None)).adaptive is None  # no target: fixed limits only


def test_at_the_inflight_limit_429_comes_before_the_body_is_parsed(limited):
    client, orch, adm = limited
    held = [adm.try_admit(1, 10)[0] for _ in range(2)]
    r = client.post("/v1/completions", content=b"{not json", headers={"content-type": "application/json"})
    _assert_429(r)  # not a 400: the body was never read
    assert adm.rejected == {"inflight": 1}
    for t in held:
        adm.release(t)
    assert client.post("/v1/completions", content=b"{not json",
                       headers={"content-type": "application/json"}).status_code == 400


def test_ttft_counts_from_the_request_reaching_the_gateway(limited):
    client, orch, adm = limited
    seen = []
    real = adm.try_admit

    def spy(n, tokens, arrived_t=None):
        seen.append(arrived_t)
        return real(n, tokens, arrived_t)

    adm.try_admit = spy
    assert client.post("/v1/completions", json=BODY).status_code == 200
    import time

    assert len(seen) == 1 and seen[0] is not None and seen[0] <= time.monotonic()


def test_wan_backlog_limit():
    lim = AdmissionLimits(None, None, None, max_wan_backlog_s=2.0)
    d = decide(AdmissionState(3, 0, None, None, wan_backlog_s=5.5), lim, 1, 10)
    assert (d.admit, d.reason, d.retry_after_s) == (False, "wan_backlog", 4)  # 5.5 - 2 = 3.5 -> 4 s
    assert decide(AdmissionState(3, 0, None, None, wan_backlog_s=2.0), lim, 1, 10).admit
    assert decide(AdmissionState(0, 0, None, None, wan_backlog_s=99.0), lim, 1, 10).admit  # empty system
    adm = Admission(lim)
    adm.wan_backlog = lambda: 9.0
    t, _ = adm.try_admit(1, 10)  # nothing in flight: admitted
    assert t is not None and adm.full().reason == "wan_backlog"
    adm.wan_backlog = lambda: 0.5
    assert adm.full() is None


def test_choices_of_one_prompt_queue_the_prompt_once():
    """Found by a new user: n=16 choices of a 1,100-token prompt were counted as 17,600 queued
    prompt tokens, though choices 1..15 reuse choice 0's KV from P's prefix cache; and the 429
    quoted a queue below the limit without the request's own share."""
    from pdd.gateway.admission import prefill_tokens

    assert prefill_tokens(16, 1100) == 1100 + 15 and prefill_tokens(1, 1100) == 1100 and prefill_tokens(3, 0) == 0
    adm = Admission(AdmissionLimits(None, 32768, None))
    t1, d = adm.try_admit(16, 1100)
    assert d.admit and adm.queued_tokens == 1115 and t1.tokens == 1115
    t2, d = adm.try_admit(16, 1100)
    assert d.admit and adm.queued_tokens == 2230  # two such requests fit where they did not
    d = decide(AdmissionState(1, 30000, None, None), AdmissionLimits(None, 32768, None), 1, 3000)
    assert not d.admit and d.reason == "queued_tokens"
    assert "30000 prompt tokens queued for prefill and this request's 3000 would exceed the limit of 32768" \
        in d.message
    adm.prefilled(t1)
    adm.release(t2)
    assert adm.queued_tokens == 0


# ------------------------------------------------------------------ choices per request (hard cap)
@pytest.fixture
def small_queues(tiny_model):
    """(TestClient, EngineOrch, Admission): one colocated instance whose bounded queue holds 3
    sequences (engine.max_running 2 + limits.tier_max_waiting 1), as ``pdd serve`` builds it."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.engine.engine import Engine
    from pdd.gateway.api import create_app

    from .conftest import EngineOrch

    eng = Engine.from_pretrained(tiny_model, num_pages=256, page_size=8, max_running=2, max_waiting=1)
    orch = EngineOrch(eng)
    cfg = ClusterConfig.model_validate({"mode": "colocated", "model_path": tiny_model,
                                        "served_model_name": "pdd-tiny",
                                        "engine": {"max_model_len": 512, "max_input_len": 400, "max_running": 2},
                                        "limits": {"tier_max_waiting": 1}})
    app = create_app(cfg, orch, Tokenizer.from_file(f"{tiny_model}/tokenizer.json"))
    with TestClient(app) as client:
        yield client, orch, app.state.admission


def _assert_choices_400(r, param: str, asked: int, what: str):
    assert r.status_code == 400, r.text
    assert "retry-after" not in r.headers
    err = r.json()["error"]
    assert err == {"message": err["message"], "type": "invalid_request_error", "param": param, "code": None}
    hint = "lower n" if "prompts" not in what else "send fewer prompts" if what.endswith("n (1)") else \
        "lower n or send fewer prompts"
    assert err["message"] == (
        f"{what}: {asked} choices requested; at most 3 choices per request are served (each choice holds a place "
        f"of an instance's queue on every tier it passes until it leaves that tier; the active colocated instances "
        f"hold 3: c0 (engine.max_running 2 + limits.tier_max_waiting 1)); {hint}")


@pytest.mark.parametrize("path,body,param,asked,what", [
    ("/v1/completions", {**BODY, "n": 4}, "n", 4, "n (4)"),
    ("/v1/completions", {**BODY, "prompt": ["a", "b"], "n": 2}, "n", 4, "2 prompts x n (2)"),
    ("/v1/completions", {**BODY, "prompt": ["a", "b", "c", "d"]}, "prompt", 4, "4 prompts x n (1)"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "n": 5}, "n", 5,
     "n (5)"),
])
def test_more_choices_than_a_tier_queue_holds_is_400_not_a_429_forever(small_queues, path, body, param, asked, what):
    """Found by a new user: a request whose choices exceed what one instance's bounded queue holds
    (max_running + tier_max_waiting: 128 by default) was refused 429 on every try, on an idle
    gateway too (the tier's TierBusy), though no retry could help. It is a 400 naming the field,
    before any tier does work; one at the cap is served."""
    client, orch, adm = small_queues
    for _ in range(2):  # the same answer on a retry
        _assert_choices_400(client.post(path, json=body), param, asked, what)
    assert not orch.started and adm.rejected == {} and adm.admitted == 0 and adm.limits.max_choices == 3
    r = client.post("/v1/completions", json={**BODY, "prompt": ["a", "b", "c"]})  # 3 choices: served
    assert r.status_code == 200, r.text
    assert sorted(c["index"] for c in r.json()["choices"]) == [0, 1, 2]
    r = client.post(path, json={**body, "n": 3} if "messages" in body else {**body, "prompt": "a", "n": 3})
    assert r.status_code == 200, r.text
    assert len(r.json()["choices"]) == 3


def test_max_choices_is_what_the_decoding_tier_holds_together():
    """Every choice is routed on its own and holds a place of its decoder's queue until it ends,
    so a tier holds the sum of its instances' queues (each its own engine block): RLD in pdd mode,
    and MD there too unless every request is relayed at once (a plan made on MD's reservation
    fails when MD refuses; a relayed one only degrades to RLD); MD or D in the other modes. P is
    counted apart: the prefills a request runs at once (``max_prefills``)."""
    cfg = ClusterConfig.model_validate({"mode": "pdd", "engine": {"max_running": 8},
                                        "instances": {"prefill": 2, "relay_decode": 2, "main_decode": 3},
                                        "tiers": {"main_decode": {"engine": {"max_running": 1}},
                                                  "relay_decode": {"engine": {"max_running": 6}}}})
    lim = resolve_limits(cfg, layout(cfg))
    assert (lim.max_choices, lim.max_prefills) == (6, 32)  # MD's 3 x (1 + 1) < RLD's 2 x (6 + 6); P's 2 x (8 + 8)
    assert lim.max_choices_why == ("the active main_decode instances hold 6: md0, md1, md2 (engine.max_running 1 + "
                                   "limits.tier_max_waiting 1 each)")
    assert lim.max_prefills_why == ("the active prefill instances hold 32: p0, p1 (engine.max_running 8 + "
                                    "limits.tier_max_waiting 8 each)")
    relayed = cfg.model_copy(update={"policy": cfg.policy.model_copy(update={"pipeline_ttft_budget_ms": 0})})
    assert resolve_limits(relayed, layout(relayed)).max_choices == 24  # MD's refusal only degrades: RLD's
    cfg = cfg.model_copy(update={"mode": "cross_dc_pd"})
    assert resolve_limits(cfg, layout(cfg)).max_choices == 6  # MD: 3 x (1 + 1)
    cfg = cfg.model_copy(update={"limits": cfg.limits.model_copy(update={"tier_max_waiting": 0})})
    lim = resolve_limits(cfg, layout(cfg))
    assert (lim.max_choices, lim.max_prefills) == (3, 16)
    cfg = ClusterConfig.model_validate({"mode": "colocated", "engine": {"max_running": 64},
                                        "instances": {"prefill": 2},  # colocated instances c0, c1
                                        "tiers": {"c1": {"engine": {"max_running": 32}}}})
    lim = resolve_limits(cfg, layout(cfg))
    assert (lim.max_choices, lim.max_prefills) == (192, None)
    assert lim.max_choices_why == ("the active colocated instances hold 192: c0 (engine.max_running 64 + "
                                   "limits.tier_max_waiting 64) + c1 (engine.max_running 32 + limits.tier_max_waiting 32)")


@pytest.mark.parametrize("prompts,n,why", [
    (1, 5, None), (1, 6, "prefills"), (1, 7, "choices"),  # n 5: 5 choices, 4 prefills at once (the first alone)
    (1, 1, None), (4, 1, None), (5, 1, "prefills"),  # single choices: one prefill per prompt, together
    (2, 3, None), (3, 2, None),  # 6 choices, 2 x (3 - 1) and 3 x (2 - 1) prefills at once
])
def test_choice_refusal_counts_choices_and_prefills_at_once(prompts, n, why):
    """A prompt's first choice is prefilled before its other n - 1 start: P runs prompts x
    max(1, n - 1) of a request's prefills at once, the decoder holds all prompts x n choices."""
    from pdd.gateway.admission import choice_refusal

    lim = AdmissionLimits(None, None, None, max_choices=6, max_choices_why="D", max_prefills=4, max_prefills_why="P")
    msg = choice_refusal(lim, prompts, n)
    if why is None:
        assert msg is None
    elif why == "choices":
        assert msg == ("n (7): 7 choices requested; at most 6 choices per request are served (each choice holds a place "
                       "of an instance's queue on every tier it passes until it leaves that tier; D); lower n")
    else:
        # n 1: lowering it cannot help, only fewer prompts can
        what, hint = (f"n ({n})", "lower n") if prompts == 1 else (f"{prompts} prompts x n ({n})",
                                                                  "lower n or send fewer prompts" if n > 1
                                                                  else "send fewer prompts")
        order = ("each prompt's first choice is prefilled first, then its other n - 1 together" if n > 1
                 else "the prompts are prefilled together")
        assert msg == (f"{what}: {prompts * n} choices requested, {prompts * max(1, n - 1)} of them prefilled at once "
                       f"({order}); at most 4 prefills per request run at once (each holds a place of a prefill "
                       f"instance's queue until it returns; P); {hint}")
    assert choice_refusal(AdmissionLimits(None, None, None), 64, 16) is None  # no instance: no cap


def _pool_refusal(prompts: list[tuple[int, int]], n: int, **cfg) -> str | None:
    from pdd.gateway.admission import kv_refusal

    c = ClusterConfig.model_validate({"mode": "pdd", **cfg})
    return kv_refusal(resolve_limits(c, layout(c)), prompts, n, "max_tokens")


def test_a_batch_is_counted_against_each_tiers_pool_at_once():
    """A new user's 12 prompts of ~3,660 tokens x max_tokens 50 (each fits alone) got 429
    'OutOfPages: need 232, 218 free' on an idle server, on every try. The whole request is now
    counted on each tier it passes (P, RLD, MD; 2,048 pages of 16 tokens by default)."""
    assert _pool_refusal([(3664, 48)] * 12, 1) == (
        "12 prompts x n (1): 12 choices need 2748 KV pages of 16 tokens at once on the prefill tier (each "
        "prompt's tokens while it is prefilled, page-rounded), more than its active instances' pools hold "
        "together (2048: p0 (engine.num_pages 2048 of 16 tokens)); send fewer prompts")  # P holds no output
    assert _pool_refusal([(3664, 48)] * 8, 1) is None  # 8 x 232 = 1,856
    # at the boundary: 12 x 232 pages (3,664 + 48 = 232 x 16) fit 2,784; one more token each does not
    assert _pool_refusal([(3664, 48)] * 12, 1, engine={"num_pages": 2784}) is None
    assert "2796 KV pages of 16 tokens at once on the main_decode tier (each choice's prompt + max_tokens, the " \
        "prompt's whole pages shared, page-rounded), more than its active instances' pools hold together (2784: " \
        "md0" in _pool_refusal([(3664, 49)] * 12, 1, engine={"num_pages": 2784})
    # lower max_tokens is advised only where one output token a choice would fit: 12 x 230 = 2,760
    # pages at one token (found by a user: "or max_tokens" where no max_tokens could help)
    big = {"engine": {"num_pages": 4000}}
    assert _pool_refusal([(3664, 48)] * 12, 1, **big, tiers={"main_decode": {"engine": {"num_pages": 2770}}}) \
        .endswith("; send fewer prompts or lower max_tokens")
    assert _pool_refusal([(3664, 48)] * 12, 1, **big, tiers={"main_decode": {"engine": {"num_pages": 2759}}}) \
        .endswith("(engine.num_pages 2759 of 16 tokens)); send fewer prompts")
    # 2 prompts x n 6: RLD holds a copy per choice, 12 x 230 = 2,760 > 2,759; MD shares the prompt
    why = _pool_refusal([(3664, 48)] * 2, 6, engine={"num_pages": 2759})
    assert why.startswith("2 prompts x n (6): 12 choices need 2760 KV pages of 16 tokens at once on the "
                          "relay_decode tier (a copy of each choice's prompt + its first token, page-rounded)")
    assert _pool_refusal([(3664, 48)] * 2, 6, engine={"num_pages": 2760}) is None
    # P holds each prompt while it is prefilled: 3 x 229 = 687 (its own pool, tiers.prefill)
    assert "687 KV pages" in _pool_refusal([(3664, 48)] * 3, 1, tiers={"prefill": {"engine": {"num_pages": 686}}})
    assert _pool_refusal([(3664, 48)] * 3, 1, tiers={"prefill": {"engine": {"num_pages": 687}}}) is None
    # a tier's active instances hold it together, each with its own engine block
    two = {"main_decode": 2, "relay_decode": 2, "prefill": 2}
    assert _pool_refusal([(3664, 48)] * 12, 1, instances=two) is None
    assert _pool_refusal([(3664, 48)] * 12, 1, instances=two, tiers={"md1": {"engine": {"num_pages": 736}}}) is None
    why = _pool_refusal([(3664, 48)] * 12, 1, instances=two, tiers={"md1": {"engine": {"num_pages": 735}}})
    assert "(2783: md0 (engine.num_pages 2048 of 16 tokens), md1 (engine.num_pages 735 of 16 tokens))" in why
