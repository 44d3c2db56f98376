"""The simulated gateway counts a request against its MD's load when it routes it, until the
request ends, as the runtime's routing (``gateway.routing._assign`` / ``_unassign``: the MD's
``InstanceLoad.running`` is the gateway's in-flight count there), not once MD's reservation,
admission or sequence exists there (a one-way delay and more later)."""

from __future__ import annotations

import pdd.policy.routing as pol_routing
from pdd.sim.cluster import ClusterSim, SimConfig
from tests.sim.sim_checks import check_settled

# two MDs, no cache hit anywhere: cache-aware routing falls back to the least loaded MD, ties to
# the first listed
CFG = SimConfig(mode="pdd", n_p=2, n_rld=1, n_md=2, wan_gbps=10.0, warmup_frac=0.0)


def rec(t_ms: float, first_block: int, prompt: int = 4096, out: int = 8) -> dict:
    return {"timestamp": t_ms, "input_length": prompt, "output_length": out,
            "hash_ids": list(range(first_block, first_block + prompt // 512))}


def md_loads(monkeypatch) -> list:
    """Each MD choice's candidates as the policy saw them: [(name, running, queued)]."""
    seen = []
    real = pol_routing.choose_instance

    def spy(cands, *a, **k):
        if cands[0].name.startswith("MD"):
            seen.append([(c.name, c.running, c.queued) for c in cands])
        return real(cands, *a, **k)

    monkeypatch.setattr(pol_routing, "choose_instance", spy)
    return seen


def test_two_requests_routed_within_the_one_way_delay_go_to_different_mds(monkeypatch):
    """The second arrives 1 ms after the first, 9 ms before the first's reservation reaches MD0
    (a 20 ms line): MD0 already counts the first, so the second goes to MD1. (Counted once MD
    held it, both went to MD0.)"""
    seen = md_loads(monkeypatch)
    sim = ClusterSim(CFG).run([rec(0, 0), rec(1, 100)])
    a, b = sim.reqs
    assert [c for c in seen] == [[("MD0", 0, 0), ("MD1", 0, 0)], [("MD0", 1, 0), ("MD1", 0, 0)]]
    assert (a.md.name, b.md.name) == ("MD0", "MD1")
    check_settled(sim)


def test_a_request_counts_while_its_kv_crosses_and_leaves_when_it_ends(monkeypatch):
    """A relayed request (200 output tokens, RLD until 1.44 s) whose KV (537 MB) crosses a 1
    Gbit/s line until 8.2 s is admitted at MD0 with no sequence there when the next arrives at
    0.5 s: it counts against MD0, so the next goes to MD1 (counted once MD held a sequence of it,
    the next went to MD0 too). Once it has ended it counts no more: a third, at 10 s, finds both
    MDs idle and goes to MD0."""
    seen = md_loads(monkeypatch)
    sim = ClusterSim(CFG.replace(wan_gbps=1.0, cutoff=False)).run([rec(0, 0, out=200), rec(500, 100),
                                                                   rec(10_000, 200)])
    a, b, c = sim.reqs
    assert a.pipeline.value == "p_rld_md" and a.t_md_kv > 8.0 and 0.5 < a.t_done < 10.0
    assert seen == [[("MD0", 0, 0), ("MD1", 0, 0)], [("MD0", 1, 0), ("MD1", 0, 0)],
                    [("MD0", 0, 0), ("MD1", 0, 0)]]
    assert (a.md.name, b.md.name, c.md.name) == ("MD0", "MD1", "MD0")
    check_settled(sim)
