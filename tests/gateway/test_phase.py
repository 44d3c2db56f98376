"""The gateway's request phase table (pdd.gateway.phase) and what reads the held phase."""

from pdd.config import ClusterConfig
from pdd.gateway.orchestrator import Orchestrator, ReqState
from pdd.gateway.phase import TRANSITIONS, Phase
from pdd.gateway.state import PHASES
from pdd.topology import layout
from pdd.types import SamplingParams


def test_table_every_phase_can_end_and_done_is_final():
    assert set(TRANSITIONS) == set(Phase)
    assert all(Phase.DONE in TRANSITIONS[p] for p in Phase if p is not Phase.DONE)
    assert TRANSITIONS[Phase.DONE] == frozenset()
    # a new attempt always starts at prefill; recovery is reachable from every running phase
    assert TRANSITIONS[Phase.RECOVERY] == {Phase.PREFILL, Phase.DONE}
    for p in (Phase.PREFILL, Phase.TRANSFER, Phase.RLD_DECODE, Phase.HANDOFF, Phase.MD_DECODE, Phase.DECODE):
        assert Phase.RECOVERY in TRANSITIONS[p]
    assert PHASES == ("prefill", "transfer", "rld_decode", "handoff", "md_decode")


def test_metrics_count_live_requests_by_held_phase():
    cfg = ClusterConfig.model_validate({"mode": "pdd"})
    o = Orchestrator(cfg, layout(cfg))
    for rid, moves in (("a", [Phase.PREFILL]), ("b", [Phase.PREFILL, Phase.TRANSFER]),
                       ("c", [Phase.PREFILL, Phase.TRANSFER])):
        st = ReqState(rid, 4, SamplingParams(max_tokens=2), trid=rid)
        for m in moves:
            assert st.to(m)
        o.reqs[rid] = st
    o.reqs["c.1"] = o.reqs["c"]  # one request under two tier rids is counted once
    fams = {f.name: f for f in o.metrics.registry.collect()}
    got = {s.labels["phase"]: s.value for s in fams["pdd_gateway_requests_phase"].samples}
    assert got == {"prefill": 1.0, "transfer": 2.0}
