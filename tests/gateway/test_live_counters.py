"""``pdd.gateway.live_counters``: handoff rounds and mode switches per RLD from the decisions RLD
returns, and the P/MD prefix-hit alignment window, fed by the routing hook at an attempt's end."""

from prometheus_client import generate_latest

from pdd.config import ClusterConfig
from pdd.gateway.live_counters import HitAlignment, LiveCounters
from pdd.gateway.orchestrator import Orchestrator
from pdd.gateway.state import ReqState
from pdd.topology import layout
from pdd.types import SamplingParams


def _orch():
    cfg = ClusterConfig.model_validate({"mode": "pdd"})
    o = Orchestrator(cfg, layout(cfg))
    return o, LiveCounters(o)


def _handoff(current: str, mode: str, final: bool = True) -> dict:
    return {"policy": "handoff", "inputs": {"mode_config": "auto", "current_mode": current, "tokens_pending": 3},
            "result": {"mode": mode, "final": final}}


def _req(rid, prompt_len, p_hit, md_hit, decisions=(), rld="rld0", events=("md_reserved", "prefilled")):
    st = ReqState(rid, prompt_len, SamplingParams(max_tokens=4))
    st.names = {"prefill": "p0", "relay_decode": rld, "main_decode": "md0"}
    st.p_cached_tokens, st.md_cached_tokens = p_hit, md_hit
    st.decisions = [{"policy": "pipeline", "inputs": {}, "result": "P_RLD_MD"}, *decisions]
    st.events = {k: 1.0 for k in events}
    return st


def test_alignment_window_definition():
    a = HitAlignment(window=2)
    assert a.rates() == {"n": 0, "prompt_tokens": 0, "p_hit_rate": None, "md_hit_rate": None, "alignment": None}
    a.record(100, 0, 0)
    assert a.rates()["alignment"] is None and a.rates()["p_hit_rate"] == 0.0
    a.record(100, 80, 40)
    a.record(200, 160, 160)  # the first leaves the window of 2
    assert a.rates() == {"n": 2, "prompt_tokens": 300, "p_hit_rate": 0.8, "md_hit_rate": 200 / 300,
                         "alignment": 200 / 240}


def test_attempt_end_counts_rounds_switches_and_hits_once():
    o, lc = _orch()
    st = _req("r1", 128, 96, 64, [_handoff("catch_up", "one_shot")])
    st.assigned = {"p0", "rld0", "md0"}
    o._unassign(st)
    o._unassign(st)  # a second call for the same attempt counts nothing
    st2 = _req("r2", 64, 32, 32, [_handoff("one_shot", "one_shot"), _handoff("one_shot", "catch_up", False),
                                  _handoff("catch_up", "catch_up")], rld="rld1")
    st2.assigned = {"rld1"}
    o._unassign(st2)
    st3 = _req("r3", 64, 64, 0, events=("prefilled",))  # MD's reservation never answered: no hit sample
    st3.assigned = {"p0"}
    o._unassign(st3)
    assert lc.view() == {
        "handoff_rounds": {"rld0/one_shot": 1, "rld1/catch_up": 2, "rld1/one_shot": 1},
        "handoff_mode_switches": {"rld0": 1, "rld1": 1},
        "handoff_mode_now": {"rld0": "one_shot", "rld1": "catch_up"},
        "prefix_hit": {"n": 2, "prompt_tokens": 192, "p_hit_rate": 128 / 192, "md_hit_rate": 96 / 192,
                       "alignment": 96 / 128}}
    text = generate_latest(o.metrics.registry).decode()
    assert 'pdd_gateway_handoff_mode_switches_total{instance="rld1"} 1.0' in text
    assert 'pdd_gateway_handoff_rounds_total{instance="rld1",mode="catch_up"} 2.0' in text
    assert 'pdd_gateway_handoff_mode{instance="rld0",mode="one_shot"} 1.0' in text
    assert 'pdd_gateway_prefix_hit_alignment 0.75' in text
    assert 'pdd_gateway_prefix_hit_rate{tier="main_decode"} 0.5' in text


def test_recovery_attempt_counts_only_its_new_decisions_and_its_longer_prompt():
    o, lc = _orch()
    st = _req("r1", 100, 0, 0, [_handoff("catch_up", "catch_up", False)])
    st.assigned = {"rld0"}
    o._unassign(st)  # attempt 0 lost mid-handoff
    st.decisions.append(_handoff("catch_up", "one_shot"))
    st.base, st.p_cached_tokens, st.md_cached_tokens = 20, 96, 80  # attempt 1: prompt + 20 streamed tokens
    st.assigned = {"rld0"}
    o._unassign(st)
    v = lc.view()
    assert v["handoff_rounds"] == {"rld0/catch_up": 1, "rld0/one_shot": 1}
    assert v["handoff_mode_switches"] == {"rld0": 1}
    assert v["prefix_hit"]["prompt_tokens"] == 100 + 120 and v["prefix_hit"]["alignment"] == 80 / 96
