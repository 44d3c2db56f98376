"""The simulator's exact output on small runs, pinned: a change meant to make the simulator
faster (not different) must leave every request's times, routing and decisions, and every
summary figure, bit for bit as they were. Regenerate the fixture only for an intended change of
results: ``python tests/sim/test_sim_golden.py --write`` (and say why in the commit)."""

from __future__ import annotations

import hashlib
import json
import sys
from pathlib import Path

import pytest

from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.sim.report import summarize
from pdd.workload.records import MOONCAKE_TRACE, cap_input, generate_agentic, load_trace

FIXTURE = Path(__file__).parent / "data" / "sim_golden.json"

REQ_FIELDS = ("rid", "arrival", "prompt", "out_len", "p_hit", "md_hit", "t_first", "t_last", "n_emitted",
              "max_gap", "t_done", "generated", "finished", "cut_off", "wan_bytes", "md_missing",
              "handoff_round", "handed", "rld_tokens", "md_tokens", "stall", "t_prefill_done", "t_md_kv",
              "handoff_mode", "md_predicted", "t_handoff_start", "t_md_replied", "t_handoff")


def _measured_case():
    """The live-validation mirror: the measured CPU profile, shared host cores, role overheads."""
    from pdd import step_profile as P
    from pdd.sim import validate as V
    from pdd.sim.sim_config import with_live_fit

    path = Path(__file__).parents[2] / "data" / "profiles" / "this-machine.json"
    prof = P.load(path)
    cfg = with_live_fit(V.sim_config(V.validate_config(None, 40.0), path, prof, 64, host_cores=2.0), prof)
    return cfg, cap_input(generate_agentic(200, seed=3, rate=0.8), 1500, 64)


def _cases() -> dict:
    agentic = generate_agentic(300, seed=4, rate=2.0)
    trace = load_trace(MOONCAKE_TRACE, limit=600)
    small = dict(n_p=2, n_rld=1, n_md=2, n_d=2, n_c=3, wan_gbps=10.0)
    return {
        "colocated-agentic": (SimConfig(mode="colocated", **small), agentic),
        "same_dc_pd-agentic": (SimConfig(mode="same_dc_pd", **small), agentic),
        "cross_dc_pd-agentic": (SimConfig(mode="cross_dc_pd", **small), agentic),
        "pdd-agentic": (SimConfig(mode="pdd", **small), agentic),
        "pdd-agentic-catchup-srf-budget0": (
            SimConfig(mode="pdd", handoff_mode="catch_up", catchup_threshold=4, wan_order="srf",
                      ttft_budget_ms=0.0, **small), agentic),
        "cross_dc_pd-agentic-round_robin-fifo": (
            SimConfig(mode="cross_dc_pd", routing="round_robin", wan_order="fifo", **small), agentic),
        "pdd-mooncake600": (SimConfig(mode="pdd", n_p=4, n_rld=2, n_md=4), trace),
        "pdd-mooncake600-no-early-no-predicted": (
            SimConfig(mode="pdd", n_p=4, n_rld=2, n_md=4, early_handoff=False, md_predicted_send=False,
                      ttft_budget_ms=0.0), trace),
        "pdd-measured-profile-host-cores": _measured_case(),
    }


def _r(v):
    if isinstance(v, float):
        return repr(v)
    if hasattr(v, "value"):
        return v.value
    return v


def fingerprint(sim: ClusterSim) -> dict:
    reqs = []
    for r in sim.reqs:
        row = [_r(getattr(r, f)) for f in REQ_FIELDS]
        row += [_r(r.pipeline), *(getattr(x, "name", None) for x in (r.p, r.rld, r.md, r.d))]
        reqs.append(row)
    s = summarize(sim)
    counters = {
        "pipelines": sim.pipelines, "handoffs": sim.handoffs, "cutoffs": sim.cutoffs,
        "wan_saved_bytes": repr(sim.wan_saved_bytes), "decode_tokens": sim.decode_tokens,
        "md_predicted_sends": sim.md_predicted_sends, "early_handoffs": sim.early_handoffs,
        "wan_bytes": repr(sim.wan.bytes_sent) if sim.wan is not None else None,
        "now": repr(sim.env.now), "itl": [repr(x) for x in sim.itl_v[:50]], "n_itl": len(sim.itl_v),
        "steps": {n: [i.steps for i in insts] for n, insts in sim.tiers.items()},
        "busy": {n: [repr(i.busy_s) for i in insts] for n, insts in sim.tiers.items()},
    }
    blob = json.dumps({"reqs": reqs, "summary": s, "counters": counters}, sort_keys=True, default=repr)
    return {"sha256": hashlib.sha256(blob.encode()).hexdigest(),
            "median_ttft_ms": s["median_ttft_ms"], "p90_ttft_ms": s["p90_ttft_ms"],
            "median_tpot_ms": s["median_tpot_ms"], "completed": s["completed"],
            "steps": sum(i.steps for insts in sim.tiers.values() for i in insts)}


def run_case(name: str) -> dict:
    cfg, recs = _cases()[name]
    return fingerprint(ClusterSim(cfg).run(recs))


@pytest.mark.parametrize("name", list(json.loads(FIXTURE.read_text())) if FIXTURE.exists() else [])
def test_simulator_output_is_pinned(name):
    want = json.loads(FIXTURE.read_text())[name]
    got = run_case(name)
    assert got == want, f"{name}: the simulator's output changed (headline {got} != {want})"


def test_fast_instance_load_equals_the_policys():
    import pdd.policy.routing as pol_routing
    from pdd.sim.instance import load_maker

    make = load_maker()
    got, want = make("p0", 1, 2, 300, 400, 512), pol_routing.InstanceLoad("p0", 1, 2, 300, 400, 512)
    assert type(got) is pol_routing.InstanceLoad and got == want and repr(got) == repr(want)
    assert hash(got) == hash(want)


def test_every_case_is_pinned():
    assert set(json.loads(FIXTURE.read_text())) == set(_cases())


if __name__ == "__main__":
    if "--write" not in sys.argv:
        sys.exit("usage: python tests/sim/test_sim_golden.py --write")
    FIXTURE.write_text(json.dumps({n: run_case(n) for n in _cases()}, indent=1, sort_keys=True) + "\n")
    print(f"wrote {FIXTURE}")
