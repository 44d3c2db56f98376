"""The simulator's WAN line models loss, cross traffic and layer-wise KV streaming with the
runtime's formulas (pdd.policy.tcp_model; pdd.transfer.kv layer groups): exact values."""

import math

import pytest

import pdd.policy.tcp_model as tcp
from pdd.sim.cluster import ClusterSim, SimConfig
from pdd.sim.sim_config import SimEngine
from pdd.workload.records import generate_agentic

MB = 1 << 20


def _alone(cfg: SimConfig, nbytes: float, flows: int = 1) -> list:
    """Send ``flows`` flows of ``nbytes`` at t=0 on cfg's WAN line; their last-byte times."""
    sim = ClusterSim(cfg)
    fs = [sim.wan.send(i, nbytes, lambda: None) for i in range(flows)]
    sim.env.run()
    return [f.t_end for f in fs]


@pytest.mark.parametrize("order", ["ps", "fifo"])
def test_lossy_flow_moves_at_the_mathis_rate(order):
    cfg = SimConfig(mode="cross_dc_pd", wan_gbps=10.0, wan_rtt_ms=20.0, wan_loss_rate=1e-4, wan_order=order)
    conn = tcp.mathis_gbps(1460, 20.0, 1e-4)  # 0.0715 Gbit/s: far below the line
    assert conn < 10.0
    (t,) = _alone(cfg, 8 * MB)
    assert t == pytest.approx(tcp.transfer_seconds(8 * MB, 10.0, 0.0, conn), rel=1e-9)
    assert t == pytest.approx(8 * MB * 8 / (conn * 1e9), rel=1e-9)


def test_lossy_flows_share_the_line_only_when_it_is_the_bottleneck():
    # conn = 0.0715 Gbit/s; 4 flows on a 0.2 Gbit/s line: each min(0.05, conn) = 0.05 (line-bound)
    # flows sharing the line at once: processor sharing (the runtime's fifo sends them in turn)
    cfg = SimConfig(mode="cross_dc_pd", wan_gbps=0.2, wan_rtt_ms=20.0, wan_loss_rate=1e-4, wan_order="ps",
                    wan_express_lane_bdp=0.0)
    ts = _alone(cfg, MB, flows=4)
    assert ts == pytest.approx([4 * MB * 8 / 0.2e9] * 4, rel=1e-9)
    # 2 flows: each min(0.1, conn) = conn: the line is not saturated
    conn = tcp.mathis_gbps(1460, 20.0, 1e-4)
    ts = _alone(cfg, MB, flows=2)
    assert ts == pytest.approx([MB * 8 / (conn * 1e9)] * 2, rel=1e-9)


def test_cross_traffic_taking_half_the_line_halves_the_throughput():
    base = SimConfig(mode="cross_dc_pd", wan_gbps=1.0, wan_rtt_ms=20.0)
    (t0,) = _alone(base, 16 * MB)
    (t1,) = _alone(base.replace(wan_cross_traffic=((0.0, 0.5),)), 16 * MB)
    assert t0 == pytest.approx(16 * MB * 8 / 1e9, rel=1e-12)
    assert t1 == pytest.approx(2 * t0, rel=1e-9)
    assert t1 == pytest.approx(tcp.transfer_seconds(16 * MB, 1.0, 0.5), rel=1e-9)


@pytest.mark.parametrize("order", ["ps", "srf"])
def test_cross_traffic_schedule_integrates_as_the_emulator(order):
    sched = ((0.05, 0.5), (0.1, 0.75), (0.2, 0.0))
    cfg = SimConfig(mode="cross_dc_pd", wan_gbps=1.0, wan_rtt_ms=20.0, wan_cross_traffic=sched, wan_order=order)
    (t,) = _alone(cfg, 16 * MB)
    assert t == pytest.approx(tcp.serialize_end(0.0, 16 * MB, 1.0, sched), rel=1e-9)
    # cross traffic and loss together: one connection alone moves at min(line - cross, conn)
    lossy = cfg.replace(wan_cross_traffic=((0.0, 0.9),), wan_loss_rate=1e-4)
    (t,) = _alone(lossy, 4 * MB)
    conn = tcp.mathis_gbps(1460, 20.0, 1e-4)
    assert t == pytest.approx(tcp.transfer_seconds(4 * MB, 1.0, 0.9, conn), rel=1e-9)


def test_bad_wan_fields_are_refused_naming_the_field():
    with pytest.raises(ValueError, match="wan_loss_rate"):
        SimConfig(wan_loss_rate=1.0)
    with pytest.raises(ValueError, match="wan_cross_traffic"):
        SimConfig(wan_gbps=1.0, wan_cross_traffic=((0.0, 1.5),))
    with pytest.raises(ValueError, match="kv_stream"):
        SimConfig(kv_stream="chunked")
    with pytest.raises(ValueError, match="kv_stream_layer_group"):
        SimConfig(kv_stream_layer_group=0)


def _one(cfg: SimConfig, prompt: int):
    rec = [{"timestamp": 0, "input_length": prompt, "output_length": 1, "hash_ids": list(range(prompt // 512))}]
    return ClusterSim(cfg).run(rec).reqs[0]


@pytest.mark.parametrize("gbps", [0.5, 20.0])  # transfer-bound, compute-bound
def test_layerwise_ttft_closed_form_cross_dc(gbps):
    """One request alone, zero RTT, G equal layer groups: whole = D + B/R; layer-wise, group g
    (B/G bytes) is written at (g+1)*D/G and the line sends them in turn, so the last byte leaves
    at max(D/G + B/R, D + B/(G*R))."""
    prompt = 4096
    cfg = SimConfig(mode="cross_dc_pd", n_p=1, n_md=1, wan_gbps=gbps, wan_rtt_ms=0.0, wan_order="fifo",
                    warmup_frac=0.0)
    whole = _one(cfg, prompt)
    lw = _one(cfg.replace(kv_stream="layerwise", kv_stream_layer_group=8), prompt)  # 32 layers: G = 4
    d = whole.t_prefill_done - whole.arrival
    assert lw.t_prefill_done - lw.arrival == d  # streaming does not change the step
    b = prompt * cfg.model_profile().kv_bytes_per_token * 8 / (gbps * 1e9)  # whole transfer, s
    g = 4
    assert whole.t_first - whole.arrival == pytest.approx(d + b, rel=1e-9)
    assert lw.t_first - lw.arrival == pytest.approx(max(d / g + b, d + b / g), rel=1e-9)
    assert lw.t_first < whole.t_first


def test_layerwise_ttft_closed_form_fast_path_uneven_groups():
    """same_dc_pd over the fast path, 32 layers in groups of 12: 12, 12, 8 layers, written at
    12/32, 24/32, 1 of the step; compute-bound: the last group's bytes after the step's end."""
    prompt = 4096
    cfg = SimConfig(mode="same_dc_pd", n_p=1, n_d=1, fast_gbps=100.0, fast_rtt_ms=0.0, warmup_frac=0.0)
    whole = _one(cfg, prompt)
    lw = _one(cfg.replace(kv_stream="layerwise", kv_stream_layer_group=12), prompt)
    d = whole.t_prefill_done - whole.arrival
    b = prompt * cfg.model_profile().kv_bytes_per_token * 8 / 100e9
    assert whole.t_first - whole.arrival == pytest.approx(d + b, rel=1e-9)
    # last byte: max over groups of (written_g + bytes from g on / R)
    written = [12 / 32 * d, 24 / 32 * d, d]
    share = [12 / 32, 12 / 32, 8 / 32]
    want = max(written[i] + sum(share[i:]) * b for i in range(3))
    assert lw.t_first - lw.arrival == pytest.approx(want, rel=1e-9)


@pytest.mark.parametrize("kw", [
    dict(mode="pdd"), dict(mode="pdd", ttft_budget_ms=0.0, handoff_mode="catch_up", wan_order="srf"),
    dict(mode="pdd", wan_order="ps", prefill_chunk_tokens=1024), dict(mode="cross_dc_pd"),
    dict(mode="same_dc_pd")])
def test_layerwise_lossy_runs_complete_and_free_every_page(kw):
    recs = generate_agentic(150, seed=5, rate=2.0)
    base = SimConfig(**{**dict(n_p=2, n_rld=1, n_md=2, n_d=2, wan_gbps=10.0, warmup_frac=0.0, wan_order="fifo",
                               wan_loss_rate=1e-5, wan_cross_traffic=((0.0, 2.0), (30.0, 6.0))), **kw})
    for cfg in (base, base.replace(kv_stream="layerwise", kv_stream_layer_group=4)):
        sim = ClusterSim(cfg).run(recs)
        assert all(r.finished for r in sim.reqs)
        for insts in sim.tiers.values():
            for inst in insts:
                assert inst.private == 0, inst.name
                if inst.cache is not None:
                    assert not inst.cache.locks, inst.name
                assert not inst.seqs and not inst.waiting and inst.slots == 0
        for line in ([sim.wan] if sim.wan else []) + list(sim.fast.values()):
            assert not line.flows and line.n_held == 0
        assert not sim.kv_ready and not sim.kv_dispatched


def test_configured_estimate_is_capped_by_the_loss():
    sim = ClusterSim(SimConfig(mode="pdd", wan_gbps=10.0, wan_rtt_ms=20.0, wan_loss_rate=1e-4))
    assert sim.wan_gbps_estimate() == tcp.mathis_gbps(1460, 20.0, 1e-4)
    assert ClusterSim(SimConfig(mode="pdd", wan_gbps=10.0)).wan_gbps_estimate() == 10.0
    assert math.isinf(ClusterSim(SimConfig(mode="pdd", wan_rtt_ms=0.0, wan_loss_rate=0.01)).wan_conn_gbps)


def test_sim_config_reads_the_runtime_keys():
    from pdd.config import ClusterConfig
    from pdd.sim.sim_config import runtime_wan_fields

    cc = ClusterConfig.model_validate({
        "link": {"wan_gbps": 2.0, "wan_rtt_ms": 30.0, "wan_loss_rate": 0.001, "wan_mss_bytes": 1400,
                 "wan_cross_traffic": [[0, 0.5], [10, 1.0]]},
        "policy": {"kv_stream": "layerwise", "kv_stream_layer_group": 2, "wan_order": "srf"}})
    f = runtime_wan_fields(cc)
    cfg = SimConfig(mode="pdd", **f)
    assert (cfg.wan_gbps, cfg.wan_rtt_ms, cfg.wan_loss_rate, cfg.wan_mss_bytes) == (2.0, 30.0, 0.001, 1400)
    assert cfg.wan_cross_traffic == ((0.0, 0.5), (10.0, 1.0))
    assert (cfg.kv_stream, cfg.kv_stream_layer_group, cfg.wan_order) == ("layerwise", 2, "srf")


def test_sim_run_reads_the_runtime_yaml(tmp_path):
    import argparse

    from pdd.sim.cli import _cfg_args, _make_cfg

    y = tmp_path / "c.yaml"
    y.write_text("link:\n  wan_loss_rate: 0.001\n  wan_cross_traffic: [[0, 0.01]]\npolicy:\n  kv_stream: layerwise\n")
    p = argparse.ArgumentParser()
    _cfg_args(p)
    cfg = _make_cfg(p.parse_args(["--config", str(y)]))
    assert (cfg.wan_gbps, cfg.wan_loss_rate, cfg.wan_cross_traffic, cfg.kv_stream, cfg.wan_order) == \
        (0.05, 0.001, ((0.0, 0.01),), "layerwise", "fifo")
    cfg = _make_cfg(p.parse_args(["--wan-loss-rate", "0.01", "--cross-traffic", "0:5,10:1", "--kv-stream",
                                  "layerwise", "--kv-stream-layer-group", "4"]))
    assert (cfg.wan_loss_rate, cfg.wan_cross_traffic, cfg.kv_stream_layer_group) == (0.01, ((0.0, 5.0), (10.0, 1.0)), 4)


def test_sim_run_says_which_config_blocks_it_does_not_simulate(tmp_path, capsys):
    """A heterogeneous config (tiers: a bf16 MD) given to `pdd sim run --config` was simulated as a
    homogeneous topology without a word (the same WAN bytes as without the tiers): stderr names
    what is not read (the instance counts, the KV dtype); a config of WAN fields alone gets no note."""
    import argparse

    from pdd.sim.cli import _cfg_args, _make_cfg

    p = argparse.ArgumentParser()
    _cfg_args(p)
    het = tmp_path / "het.yaml"
    het.write_text("tiers:\n  main_decode:\n    engine: {dtype: bfloat16, page_size: 32}\ninstances: {main_decode: 2}\n")
    _make_cfg(p.parse_args(["--config", str(het)]))
    err = capsys.readouterr().err
    assert f"--config {het}: not simulated here: instances, tiers.main_decode.engine.dtype (" in err
    wan = tmp_path / "wan.yaml"
    wan.write_text("link:\n  wan_loss_rate: 0.001\n")
    _make_cfg(p.parse_args(["--config", str(wan)]))
    assert "not simulated" not in capsys.readouterr().err


def test_sim_run_reads_the_configs_engine_and_tiers(tmp_path, capsys):
    """`pdd sim run --config` read neither `engine` nor `tiers` (it said so): every tier ran the
    flags' scheduler and the chip's KV pool. The blocks' settings now replace the flags, each tier
    and instance with its own (SimConfig.tier_engines), as ClusterConfig.engine_for merges them."""
    import argparse

    from pdd.sim.cli import _cfg_args, _make_cfg
    from pdd.sim.cluster import ClusterSim, RequestTooLarge

    p = argparse.ArgumentParser()
    _cfg_args(p)
    y = tmp_path / "tiers.yaml"
    y.write_text("instances: {prefill: 1, relay_decode: 1, main_decode: 2}\n"
                 "engine: {max_running: 32, max_batch_tokens: 4096, page_size: 16, num_pages: 8192, device: cpu}\n"
                 "tiers:\n"
                 "  main_decode: {engine: {min_step_ms: 20, page_size: 32, prefill_order: short_first}}\n"
                 "  md1: {engine: {num_pages: 128, max_running: 8}}\n")
    cfg = _make_cfg(p.parse_args(["--config", str(y), "--n-md", "2", "--max-running-seqs", "256"]))
    assert (cfg.max_running_seqs, cfg.max_batch_tokens, cfg.prefill_chunk_tokens, cfg.page_tokens) == (32, 4096, 8192, 16)
    assert cfg.tier_engines == {
        "P": SimEngine(kv_pool_tokens=131072), "RLD": SimEngine(kv_pool_tokens=131072),
        "MD": SimEngine(kv_pool_tokens=262144, min_step_s=0.02, page_tokens=32, prefill_order="short_first"),
        "MD1": SimEngine(kv_pool_tokens=4096, max_running_seqs=8)}
    assert "not simulated here: instances, engine.device (" in capsys.readouterr().err
    md0, md1 = ClusterSim(cfg).tiers["MD"]
    assert (md0.pool, md0.max_running, md0.page, md0.min_step_s) == (262144, 32, 32, 0.02)
    assert (md1.pool, md1.max_running, md1.page, md1.min_step_s) == (4096, 8, 32, 0.02)
    # md1's 4,096-token pool: a 5,000-token prompt is refused before anything is simulated
    rec = [{"timestamp": 0.0, "input_length": 5000, "output_length": 10, "hash_ids": list(range(10))}]
    with pytest.raises(RequestTooLarge):
        ClusterSim(cfg).run(rec)


def test_a_tracked_flow_s_bytes_over_time_follow_the_line_s_rate():
    """``Line.sent_at``: a tracked flow's bytes on the line at any past time, linear between the
    line's events (at each its rate changed), the current rate after the last; MD's progress
    reports read it (``ClusterSim.md_progress``)."""
    from pdd.sim.cluster import ClusterSim, Line, SimConfig

    sim = ClusterSim(SimConfig(mode="cross_dc_pd", n_p=1, n_md=1))
    line = Line(sim, "x", 8.0, 0.01, "ps", cross=((1.0, 6.0),))  # 1 GB/s, 0.25 GB/s from t = 1 s
    a = line.send("a", 2e9, lambda: None, track=True)
    b = line.send("b", 1e9, lambda: None)
    assert b.hist_t is None and line.n_tracked == 1
    sim.env.run(until=1.5)
    assert line.sent_at(a, 0.0) == 0.0
    assert line.sent_at(a, 0.5) == pytest.approx(0.25e9)  # half the line while b shares it
    assert line.sent_at(a, 1.0) == pytest.approx(0.5e9)
    assert line.sent_at(a, 1.5) == pytest.approx(0.5e9 + 0.0625e9)  # half of 0.25 GB/s
    assert line.first_sent_s(a) == 0.0
    sim.env.run()
    assert a.done and line.n_tracked == 0
    assert line.sent_at(a, a.t_end + 5.0) == pytest.approx(2e9)
    with pytest.raises(ValueError, match="not tracked"):
        line.sent_at(b, 0.5)
