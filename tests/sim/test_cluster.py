import pytest

from pdd.sim.cluster import BLOCK, ClusterSim, Line, PrefixCache, SimConfig
from pdd.sim.report import summarize
from pdd.workload.records import generate_agentic, generate_fixed

RECS = generate_agentic(300, seed=4, rate=2.0)


@pytest.mark.parametrize("mode", ["colocated", "same_dc_pd", "cross_dc_pd", "pdd"])
def test_modes_complete_and_free_every_page(mode):
    cfg = SimConfig(mode=mode, n_p=2, n_rld=1, n_md=2, n_d=2, n_c=3, wan_gbps=10.0, warmup_frac=0.0)
    sim = ClusterSim(cfg).run(RECS)
    assert all(r.finished for r in sim.reqs)
    assert all(r.n_emitted == r.out_len or r.generated >= r.out_len for r in sim.reqs)
    for insts in sim.tiers.values():
        for inst in insts:
            assert inst.private == 0, inst.name  # every reservation returned exactly once
            if inst.cache is not None:
                assert not inst.cache.locks, inst.name
            assert not inst.seqs and not inst.waiting
            assert inst.slots == 0, inst.name  # every decode slot given back exactly once
            assert inst.assigned == 0, inst.name  # every request left its MD's routing load
    s = summarize(sim)
    assert s["completed"] == len(RECS)
    assert s["median_ttft_ms"] > 0 and s["median_tpot_ms"] > 0


def test_emitted_tokens_equal_output_length():
    cfg = SimConfig(mode="pdd", n_p=2, n_rld=1, n_md=2, wan_gbps=10.0, warmup_frac=0.0, handoff_mode="catch_up",
                    catchup_threshold=4)
    sim = ClusterSim(cfg).run(RECS)
    for r in sim.reqs:
        assert r.n_emitted == r.out_len, (r.rid, r.n_emitted, r.out_len, r.pipeline)


def test_prefix_cache_lru_evicts_children_first_and_skips_locked():
    c = PrefixCache(10)
    c.insert([1, 2, 3])
    c.insert([7, 8])
    c.lock([7])
    assert c.match([1, 2, 3, 4]) == 3
    assert c.evict(2) == 2  # the chain 1-2-3: children (3, 2) go before the parent
    assert c.match([1, 2, 3]) == 1
    assert 7 in c.lru


def test_line_processor_sharing_and_srf():
    sim = ClusterSim(SimConfig(mode="cross_dc_pd", n_p=1, n_md=1))
    done = {}
    line = Line(sim, "x", 8.0, 0.0, "ps")  # 1 GB/s
    line.send("a", 1e9, lambda: done.setdefault("a", sim.env.now))
    line.send("b", 1e9, lambda: done.setdefault("b", sim.env.now))
    sim.env.run()
    assert done["a"] == pytest.approx(2.0) and done["b"] == pytest.approx(2.0)
    sim = ClusterSim(SimConfig(mode="cross_dc_pd", n_p=1, n_md=1))
    done = {}
    line = Line(sim, "y", 8.0, 0.01, "srf")
    line.send("big", 3e9, lambda: done.setdefault("big", sim.env.now))
    line.send("small", 1e9, lambda: done.setdefault("small", sim.env.now))
    sim.env.run()
    assert done["small"] == pytest.approx(1.01) and done["big"] == pytest.approx(4.01)


def test_drc_cuts_wan_bytes():
    recs = generate_fixed(120, 2.0, 8192, 16, 0.9, n_prefixes=4, seed=1)
    cfg = SimConfig(mode="cross_dc_pd", n_p=1, n_md=1, wan_gbps=100.0, warmup_frac=0.0)
    with_drc = ClusterSim(cfg).run(recs).wan.bytes_sent
    without = ClusterSim(cfg.replace(drc=False)).run(recs).wan.bytes_sent
    assert without == pytest.approx(120 * 8192 * 131072)
    assert with_drc < 0.2 * without


def test_cutoff_cancels_wan_for_long_input_short_output():
    rec = [{"timestamp": 0, "input_length": 60000, "output_length": 4, "hash_ids": list(range(118))}]
    cfg = SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, wan_gbps=1.0, warmup_frac=0.0)
    on = ClusterSim(cfg).run(rec)
    off = ClusterSim(cfg.replace(cutoff=False)).run(rec)
    assert on.cutoffs == 1 and off.cutoffs == 0
    assert on.wan.bytes_sent < 0.1 * off.wan.bytes_sent
    assert off.wan.bytes_sent == pytest.approx(60000 * 131072)
    assert on.reqs[0].pipeline.value == "p_rld_md" and on.reqs[0].finished


def test_cost_and_gpu_counts():
    cfg = SimConfig(mode="pdd", n_p=30, n_rld=13, n_md=32, price_a=2.0, price_b=2.5, wan_usd_per_hour=10.0)
    assert cfg.gpus() == {"a": 43, "b": 32}
    assert cfg.cost_per_hour() == pytest.approx(43 * 2.0 + 32 * 2.5 + 10.0)
    assert SimConfig(mode="same_dc_pd", n_p=30, n_d=58, price_a=2.0).cost_per_hour() == pytest.approx(176.0)


def test_cutoff_only_for_long_remainders(monkeypatch):
    """The sim asks should_cut_off with the gateway's inputs: the planned WAN bytes at the
    estimated rate less the time since prefill; a remainder under cutoff_min_remaining_s runs on."""
    import pdd.policy.cutoff as pol_cutoff

    rec = [{"timestamp": 0, "input_length": 60000, "output_length": 4, "hash_ids": list(range(118))}]
    cfg = SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, wan_gbps=100.0, warmup_frac=0.0)
    seen = []
    real = pol_cutoff.should_cut_off

    def spy(*a, **k):
        seen.append(a)
        return real(*a, **k)

    monkeypatch.setattr(pol_cutoff, "should_cut_off", spy)
    keep = ClusterSim(cfg.replace(cutoff_min_remaining_s=0.5)).run(rec)
    (rld_fin, kv_done, remaining, min_s, frac, max_frac), again = seen
    req = keep.reqs[0]
    planned_s = 60000 * 131072 * 8 / 100e9
    assert rld_fin and not kv_done and min_s == 0.5
    assert frac == 0.0 and max_frac == 0.25  # no progress report yet: nothing counted as received
    assert 0 < remaining < 0.5
    assert remaining == pytest.approx(planned_s - (req.t_done - req.t_prefill_done), abs=1e-3)
    # let through, then checked again on MD's first progress report (0.5 s of the line's 12.5 GB/s in)
    assert again[2] == pytest.approx(planned_s - 0.5, rel=1e-9) and again[2] < 0.5
    assert keep.cutoffs == 0 and keep.wan.bytes_sent == pytest.approx(60000 * 131072)
    assert all(not i.private for t in keep.tiers.values() for i in t)
    cut = ClusterSim(cfg.replace(cutoff_min_remaining_s=0.0)).run(rec)
    assert cut.cutoffs == 1 and cut.wan.bytes_sent < 0.9 * 60000 * 131072


@pytest.mark.parametrize("mode", ["same_dc_pd", "pdd"])
def test_decode_slot_caps_bound_admission(mode):
    cfg = SimConfig(mode=mode, n_p=2, n_rld=1, n_md=2, n_d=2, wan_gbps=10.0, warmup_frac=0.0,
                    max_running_d=3, max_running_rld=2, max_running_md=4, handoff_mode="catch_up",
                    catchup_threshold=4)
    free = ClusterSim(cfg.replace(max_running_d=0, max_running_rld=0, max_running_md=0)).run(RECS)
    sim = ClusterSim(cfg).run(RECS)
    assert all(r.finished and r.n_emitted == r.out_len for r in sim.reqs)
    caps = {"D": 3, "RLD": 2, "MD": 4}
    for role, insts in sim.tiers.items():
        for inst in insts:
            assert inst.slots == 0 and inst.private == 0
            if role in caps:
                assert 0 < inst.peak_slots <= caps[role], (inst.name, inst.peak_slots)
    peak_free = max(i.peak_slots for r in caps if r in free.tiers for i in free.tiers[r])
    assert peak_free > max(caps.values())  # without caps the same load holds more at once


def test_live_wan_estimate_counts_from_the_first_byte():
    """MD's receive-rate sample runs from a flow's first byte to its last (queueing behind other
    flows on a FIFO line is invisible to MD), folded into the gateway's median estimate."""
    sim = ClusterSim(SimConfig(mode="cross_dc_pd", n_p=1, n_md=1, wan_gbps=8.0))
    line = Line(sim, "w", 8.0, 0.0, "fifo")  # 1 GB/s
    a = line.send("a", 1e9, lambda: None)
    b = line.send("b", 1e9, lambda: None)
    sim.env.run()
    assert (a.t_served, a.t_end, b.t_served, b.t_end) == pytest.approx((0.0, 1.0, 1.0, 2.0))
    assert sim.wan_gbps_estimate() == 8.0  # no sample yet: the configured rate
    sim._wan_sample(b)
    assert sim.wan_gbps_live == pytest.approx(8.0)
    c = Line(sim, "p", 8.0, 0.0, "ps")
    x = c.send("x", 1e9, lambda: None)
    c.send("y", 1e9, lambda: None)
    sim.env.run()
    sim._wan_sample(x)  # shared the line the whole time: 4 Gbit/s
    assert sim.wan_gbps_live == pytest.approx((8.0 + 4.0) / 2)  # median of two samples
    small = c.send("s", 1000, lambda: None)
    sim.env.run()
    sim._wan_sample(small)  # under 256 KiB: measures the RTT, ignored
    assert sim.wan_gbps_live == pytest.approx(6.0)


def test_request_larger_than_a_kv_pool_is_refused_up_front():
    cfg = SimConfig(mode="pdd", n_p=1, n_rld=1, n_md=1, warmup_frac=0.0)
    pool = ClusterSim(cfg).tiers["RLD"][0].pool
    rec = [{"timestamp": 0, "input_length": pool, "output_length": 8, "hash_ids": list(range(pool // 512 + 1))}]
    with pytest.raises(ValueError, match=r"request 0: .* KV pool of one RLD instance"):
        ClusterSim(cfg).run(rec)


def test_tail_chunks_run_alone_unless_packed():
    """The bathtub's mechanism, from the engine scheduler's batches: 8K prompts at 18.75% hit
    leave 6,656 tokens = 3 chunks of 2,048 + a 512-token tail. One prefill at a time: exactly 4
    steps per request; packing fills the tail's step with the next request's chunk."""
    from pdd.workload.records import warm_start

    n = 24
    recs = generate_fixed(n, 50.0, 8192, 4, 0.1875, n_prefixes=2, seed=13, warm_s=2.0)
    base = SimConfig(mode="pdd", model="qwen3-30b-a3b-fp8kv", n_p=1, n_rld=1, n_md=1, wan_gbps=400.0,
                     prefill_chunk_tokens=2048, max_batch_tokens=2048, warmup_frac=0.0,
                     measure_from_s=warm_start(recs))
    alone = ClusterSim(base.replace(max_prefill_inflight=1)).run(recs)
    packed = ClusterSim(base).run(recs)
    meas = [r for r in alone.reqs if r.arrival >= base.measure_from_s]
    assert all(r.p_hit == 1536 for r in meas)  # 3 cached blocks of 512
    warm_steps = sum(-(-r.prompt // 2048) for r in alone.reqs if r.arrival < base.measure_from_s)
    assert alone.tiers["P"][0].steps == warm_steps + 4 * n
    p = packed.tiers["P"][0]
    assert p.steps < alone.tiers["P"][0].steps
    assert p.busy_s < alone.tiers["P"][0].busy_s


def test_line_on_sent_when_the_rest_fits_the_socket_buffers():
    """``on_sent`` (P's xfer_done) comes once at most ``sent_lead`` bytes are still to go on the
    line: processor sharing with two 1 GB flows at 1 GB/s, a 0.2 GB lead: each has 0.2 GB left at
    t = 1.6 s (0.5 GB/s each), and its last byte leaves at 2.0 s. With a send order the flows
    share one connection: a flow is written once the queue ahead of it and its own rest fit the
    lead (one that fits it alone is written at once only on the express lane); a cut-off one
    never is; without a lead it is the last byte's departure."""
    sim = ClusterSim(SimConfig(mode="cross_dc_pd", n_p=1, n_md=1))
    sent, done = {}, {}
    line = Line(sim, "x", 8.0, 0.0, "ps")
    for n in ("a", "b"):
        line.send(n, 1e9, lambda n=n: done.setdefault(n, sim.env.now),
                  lambda n=n: sent.setdefault(n, sim.env.now), sent_lead=0.2e9)
    sim.env.run()
    assert sent == pytest.approx({"a": 1.6, "b": 1.6}) and done == pytest.approx({"a": 2.0, "b": 2.0})

    sim = ClusterSim(SimConfig(mode="cross_dc_pd", n_p=1, n_md=1))
    sent, done = {}, {}
    line = Line(sim, "y", 8.0, 0.0, "fifo")
    line.send("a", 1e9, lambda: done.setdefault("a", sim.env.now), lambda: sent.setdefault("a", sim.env.now),
              sent_lead=0.25e9)
    line.send("b", 0.1e9, lambda: done.setdefault("b", sim.env.now), lambda: sent.setdefault("b", sim.env.now),
              sent_lead=0.25e9)  # fits the lead, but waits behind a on one connection: written once
    # a's rest and b together fit it (a has 0.15 GB left, at 0.85 s)
    c = line.send("c", 1e9, lambda: done.setdefault("c", sim.env.now), lambda: sent.setdefault("c", sim.env.now),
                  sent_lead=0.25e9)
    d = line.send("d", 1e9, lambda: done.setdefault("d", sim.env.now), lambda: sent.setdefault("d", sim.env.now))
    sim.after(0.5, line.cancel, c)
    sim.env.run()
    assert sent == pytest.approx({"a": 0.75, "b": 0.85, "d": 2.1}) and "c" not in sent and "c" not in done
    assert done == pytest.approx({"a": 1.0, "b": 1.1, "d": 2.1})
    assert d.t_end == pytest.approx(2.1)

    # the express lane (a transfer of at most express_bytes has a connection of its own, which
    # shares the line with the bulk one): b is written at once and goes beside a at half the
    # line each (0.1 GB by 0.2 s); e (0.2 GB, bulk) waits behind a on the bulk connection
    sim = ClusterSim(SimConfig(mode="cross_dc_pd", n_p=1, n_md=1))
    sent, done = {}, {}
    line = Line(sim, "z", 8.0, 0.0, "fifo", express_bytes=0.1e9)
    for n, size in (("a", 1e9), ("b", 0.1e9), ("e", 0.2e9)):
        line.send(n, size, lambda n=n: done.setdefault(n, sim.env.now), lambda n=n: sent.setdefault(n, sim.env.now),
                  sent_lead=0.25e9)
    sim.env.run()
    # a: 0.9 GB left at 0.2 s, alone from then on: written when 0.25 GB are left (0.85 s), done at
    # 1.1 s; e: written once a's rest and e fit 0.25 GB (a 0.05 GB left, at 1.05 s), done at 1.3 s
    assert sent == pytest.approx({"a": 0.85, "b": 0.0, "e": 1.05})
    assert done == pytest.approx({"a": 1.1, "b": 0.2, "e": 1.3})

    # two senders' connections share the line; each serves its own flows in turn
    sim = ClusterSim(SimConfig(mode="cross_dc_pd", n_p=1, n_md=1))
    done = {}
    line = Line(sim, "c", 8.0, 0.0, "fifo")
    for n, size, conn in (("a", 1e9, "p0"), ("b", 0.5e9, "p0"), ("c", 0.5e9, "p1")):
        line.send(n, size, lambda n=n: done.setdefault(n, sim.env.now), conn=conn)
    sim.env.run()
    # a and c at 0.5 GB/s each until c ends (1.0 s, a 0.5 GB left), a alone to 1.5 s, then b
    assert done == pytest.approx({"c": 1.0, "a": 1.5, "b": 2.0})


def test_a_prompt_held_whole_computes_its_last_page_not_its_last_block():
    """The engine matches whole pages and computes at least one token, so a prompt P holds whole
    computes its last page (16 tokens of a 3,968-token prompt); without ``page_tokens`` the
    simulator's granule is the block (64 tokens). A prompt held in part hits its whole blocks."""
    prompt = {"timestamp": 0, "input_length": 3968, "output_length": 2, "hash_ids": list(range(62))}
    again = {**prompt, "timestamp": 5000}
    part = {"timestamp": 10000, "input_length": 3968, "output_length": 2, "hash_ids": list(range(30)) + [99] * 32}
    hits = {}
    for page in (None, 16):
        cfg = SimConfig(mode="same_dc_pd", n_p=1, n_d=1, block_tokens=64, page_tokens=page, warmup_frac=0.0)
        sim = ClusterSim(cfg).run([prompt, again, part])
        hits[page] = [r.p_hit for r in sim.reqs]
    assert hits == {None: [0, 3904, 1920], 16: [0, 3952, 1920]}
    for bad in (0, 24, 2.0, -16):
        with pytest.raises(ValueError, match="page_tokens must be a whole number of tokens >= 1 dividing block_tokens"):
            SimConfig(block_tokens=64, page_tokens=bad)


def test_a_recorded_run_is_re_simulated_with_the_cut_off_rule_it_ran():
    """``validate_config(recorded=...)``: a recorded run's ``config.cutoff_max_sent_fraction`` is
    the policy its re-simulation takes; a record without it ran before the rule (1: the remaining
    time alone), a fresh run the config's default (0.25); a value that is not a share is refused."""
    from pdd.config import ClusterConfig
    from pdd.sim.recorded import RecordedRunError
    from pdd.sim.validate import validate_config

    cfg = ClusterConfig()
    assert validate_config(cfg, 40.0).policy.cutoff_max_sent_fraction == 0.25
    assert validate_config(cfg, 40.0, {}).policy.cutoff_max_sent_fraction == 1.0
    assert validate_config(cfg, 40.0, {"cutoff_max_sent_fraction": 0.5}).policy.cutoff_max_sent_fraction == 0.5
    for bad in (1.5, -0.1, "0.5", True, None, float("nan")):
        with pytest.raises(RecordedRunError, match=r"^validate\.json: config\.cutoff_max_sent_fraction must be a "
                                                   r"number in \[0, 1\], not "):
            validate_config(cfg, 40.0, {"cutoff_max_sent_fraction": bad})
