"""The runtime's two relay-timing features in the simulator: the predicted MD send
(``md_predicted_send``) and the early handoff (``early_handoff``), each against its ablation on
plain inputs (one relayed request on an idle cluster, event times in simulated seconds)."""

import pytest

from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.sim.workloads import generate_agentic
from pdd.types import Pipeline

KVB = 131072  # llama-3.1-8b KV bytes per token
# one 4,096-token prompt (8 blocks) relayed at once over a 10 Gbit/s, 400 ms RTT line: P's prefill
# (~0.1 s) ends well inside the reservation's round trip
ONE = [{"timestamp": 0, "input_length": 4096, "output_length": 200, "hash_ids": list(range(8))}]
RELAY = SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, wan_gbps=10.0, wan_rtt_ms=400.0, ttft_budget_ms=0.0,
                  warmup_frac=0.0)


def run(cfg, recs=ONE):
    sim = ClusterSim(cfg).run(recs)
    for insts in sim.tiers.values():
        for inst in insts:  # every page, lock and decode slot returned exactly once
            assert inst.private == 0 and inst.slots == 0 and not inst.seqs and not inst.waiting, inst.name
            assert inst.cache is None or not inst.cache.locks, inst.name
    assert all(r.finished and r.n_emitted == r.out_len for r in sim.reqs)
    return sim


def test_predicted_send_starts_md_s_kv_when_prefill_is_done():
    owd = 0.2
    xfer = 4096 * KVB * 8 / 10e9
    old = run(RELAY.replace(md_predicted_send=False))
    new = run(RELAY.replace(md_predicted_send=True))
    ro, rn = old.reqs[0], new.reqs[0]
    assert ro.pipeline == rn.pipeline == Pipeline.P_RLD_MD
    assert ro.t_prefill_done == rn.t_prefill_done < 2 * owd
    # ablation: P's send waits for MD's reservation reply (a round trip after arrival)
    assert ro.wan_flow.t_start == pytest.approx(2 * owd)
    assert ro.t_md_kv == pytest.approx(2 * owd + xfer + owd)
    # predicted: the send starts as P's prefill ends, the same bytes (MD's cache is empty)
    assert rn.wan_flow.t_start == rn.t_prefill_done
    assert rn.t_md_kv == pytest.approx(rn.t_prefill_done + xfer + owd)
    assert rn.wan_bytes == ro.wan_bytes == 4096 * KVB
    assert ro.t_md_kv - rn.t_md_kv == pytest.approx(2 * owd - rn.t_prefill_done)
    assert (old.md_predicted_sends, new.md_predicted_sends, new.md_predicted_short) == (0, 1, 0)
    # MD's kv_ready (so the handoff) comes earlier: RLD decodes fewer of the tokens
    assert rn.rld_tokens < ro.rld_tokens and rn.rld_tokens + rn.md_tokens == ro.rld_tokens + ro.md_tokens
    assert rn.t_first == ro.t_first  # the first token comes from RLD either way


def test_predicted_send_sends_only_what_md_lacks():
    """A second turn whose prefix MD cached from the first: the predicted send ships only the
    missing blocks, the same bytes as after the reservation."""
    second = {"timestamp": 5000, "input_length": 6000, "output_length": 20, "hash_ids": list(range(12))}
    recs = ONE + [second]
    old = run(RELAY.replace(md_predicted_send=False), recs)
    new = run(RELAY.replace(md_predicted_send=True), recs)
    ro, rn = old.reqs[1], new.reqs[1]
    assert rn.md_hit == ro.md_hit == 4096 and rn.md_predicted and not ro.md_predicted
    assert rn.wan_bytes == ro.wan_bytes == (6000 - 4096) * KVB
    assert rn.wan_flow.t_start == rn.t_prefill_done < ro.wan_flow.t_start


def test_predicted_send_only_for_requests_relayed_at_once():
    sim = run(RELAY.replace(ttft_budget_ms=250.0))  # planned from MD's reply: the send waits for it
    assert sim.md_predicted_sends == 0 and not sim.reqs[0].md_predicted
    assert sim.reqs[0].wan_flow is None or sim.reqs[0].wan_flow.t_start >= 0.4


def test_predicted_send_under_md_pressure_keeps_every_invariant():
    """MD short of KV room and decode slots: predicted sends land before MD admits their
    requests (MD holds the frames), cut-offs and finished-early requests included."""
    recs = generate_agentic(300, seed=4, rate=2.0)
    cfg = SimConfig(mode="pdd", n_p=2, n_rld=1, n_md=1, wan_gbps=50.0, ttft_budget_ms=0.0, warmup_frac=0.0,
                    md_cache_frac=0.05, max_running_md=1)
    sim = run(cfg, recs)
    assert sim.md_predicted_sends == len(recs) and sim.cutoffs > 0
    early = [r for r in sim.reqs if r.wan_flow is not None and r.t_md_kv is not None
             and r.wan_flow.t_end + sim.owd < r.t_md_kv - 1e-9]
    assert early, "no KV landed before MD admitted its request: the case is not exercised"
