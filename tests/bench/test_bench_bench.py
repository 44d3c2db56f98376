"""pdd bench: per-mode extras on synthetic records, config overrides, and end to end on fake topologies."""

import json

import pydantic
import pytest
from rich.console import Console

from bench_fakes import FakeTopology, serve_in_thread
from pdd.bench import bench as bench_mod
from pdd.bench.bench import (MODE_EXTRA_FIELDS, REPORT_FIELDS, RemoteTopology, apply_overrides, cutoff_stats,
                             handoff_stats, hit_rates, main, run_bench)
from pdd.bench.report import mode_metrics, read_jsonl, recompute_report
from pdd.bench.slo import SLO
from pdd.bench.sweep import SweepPlan
from pdd.workload.replay import Scale
from pdd.config import ClusterConfig
from test_bench_demo import fake_model


def handed(times, h, mode=None, rounds=None):
    pd = {"handoff_pos": h, "pipeline": "p_rld_md"}
    if mode:
        pd.update(handoff_mode=mode, handoff_rounds=rounds)
    return {"mode": "pdd", "ok": True, "send_s": 0.0, "end_s": times[-1], "token_times_s": times,
            "pos": list(range(len(times))), "tiers": ["rld"] * h + ["md"] * (len(times) - h), "pdd": pd}


def test_handoff_stats_exact():
    # tokens every 10 ms, a 100 ms gap into MD's first token (pos 5), a 40 ms one 5 tokens later
    t = [0.01 * k for k in range(6)]
    t = t[:5] + [0.04 + 0.1 + 0.01 * k for k in range(0, 12)]
    t[10] += 0.03
    for k in range(11, len(t)):
        t[k] += 0.03
    a = handed(t, 5)
    b = handed([0.01 * k for k in range(20)], 8, mode="catch_up", rounds=3)  # smooth: largest gap 10 ms
    c = dict(handed([0.01 * k for k in range(5)], 0), pdd={"pipeline": "p_rld_md", "handoff_pos": None})
    failed = dict(handed(t, 5), ok=False)
    b["pdd"]["md_diverged"] = True
    entry = {"stats_before": {"totals": {"handoffs": 3, "handoffs_one_shot": 3}},
             "stats": {"totals": {"handoffs": 5, "handoffs_one_shot": 4, "handoffs_catch_up": 1, "requests": 9}}}
    h = handoff_stats([a, b, c, failed], median_itl_ms=10.0, entry=entry)
    assert h["server"] == {"handoffs": 2, "handoffs_catch_up": 1, "handoffs_one_shot": 1} and h["md_diverged"] == 1
    assert h["handoffs"] == 2 and h["handed_over_share"] == pytest.approx(2 / 3)
    assert h["by_mode"] == {"catch_up": 1, "one_shot": 1}
    assert h["rounds_mean"] == pytest.approx(2.0) and h["rounds_max"] == 3
    assert h["handoff_pos_mean"] == pytest.approx(6.5)
    assert h["gap_ms"]["max"] == pytest.approx(100.0)  # the 40 ms gap at offset +5 is outside +-3
    assert h["gap_ms"]["median"] == pytest.approx(55.0)
    assert h["gap_over_median_itl"]["max"] == pytest.approx(10.0)
    assert handoff_stats([c])["handoffs"] == 0 and handoff_stats([c])["gap_ms"]["median"] is None


def test_hit_rates_from_server_and_records():
    entry = {
        "stats_before": {"instances": {"p0": {"role": "prefill", "prefix_hit_tokens": 10, "prompt_tokens": 100},
                                       "md0": {"role": "main_decode", "prefix_hit_tokens": 0, "prompt_tokens": 100}}},
        "stats": {"instances": {"p0": {"role": "prefill", "prefix_hit_tokens": 70, "prompt_tokens": 300},
                                "md0": {"role": "main_decode", "prefix_hit_tokens": 50, "prompt_tokens": 300},
                                "rld0": {"role": "relay_decode"}}},
    }
    assert hit_rates([], entry) == {"p_hit_rate": pytest.approx(0.3), "md_hit_rate": pytest.approx(0.25)}
    recs = [{"prompt_tokens": 100, "pdd": {"pipeline": "p_md", "p_cached_tokens": 40, "md_cached_tokens": 20}},
            {"prompt_tokens": 300, "pdd": {"pipeline": "p_rld_md", "p_cached_tokens": 0, "md_cached_tokens": 0}}]
    assert hit_rates(recs) == {"p_hit_rate": pytest.approx(0.1), "md_hit_rate": pytest.approx(0.05)}
    colo = [{"prompt_tokens": 100, "pdd": {"pipeline": "colocated", "p_cached_tokens": 50, "md_cached_tokens": 0}}]
    assert hit_rates(colo) == {"p_hit_rate": pytest.approx(0.5), "md_hit_rate": None}


def test_cutoff_stats():
    recs = [{"pdd": {"rld_finished_first": True, "wan_bytes_expected": 1000, "wan_bytes": 300}},
            {"pdd": {"rld_finished_first": False, "wan_bytes_expected": 500, "wan_bytes": 500}},
            {"pdd": None}, {"pdd": {"rld_finished_first": True, "wan_bytes_expected": 10, "wan_bytes": None}}]
    entry = {"stats_before": {"totals": {"rld_finished_first": 1, "requests": 5}},
             "stats": {"totals": {"rld_finished_first": 3, "requests": 9, "cutoff_bytes": 7}}}
    c = cutoff_stats(recs, entry)  # no cut_offs counter: from the usage chunks
    assert c == {"requests": 2, "share": 0.5, "rld_finished_first": 2, "wan_bytes_cancelled": 710, "source": "records",
                 "server": {"rld_finished_first": 2, "cutoff_bytes": 7}}
    # the gateway's counters win (a cut-off happens after the usage chunk went out)
    entry = {"stats_before": {"totals": {"cut_offs": 1, "rld_finished_first": 1, "wan_bytes_cancelled": 100}},
             "stats": {"totals": {"cut_offs": 4, "rld_finished_first": 5, "wan_bytes_cancelled": 4196, "handoffs": 9}}}
    c = cutoff_stats(recs, entry)
    assert (c["requests"], c["share"], c["rld_finished_first"], c["wan_bytes_cancelled"], c["source"]) == (
        3, 0.75, 4, 4096, "server")
    assert cutoff_stats([]) == {"requests": 0, "share": 0.0, "rld_finished_first": 0, "wan_bytes_cancelled": 0,
                                "source": "records"}
    # a per-request cut_off flag (when the gateway sends one) counts the cut-offs themselves
    flagged = [{"pdd": {"cut_off": True, "rld_finished_first": False, "wan_bytes_expected": 64, "wan_bytes": 0}},
               {"pdd": {"cut_off": False, "rld_finished_first": True}}]
    c = cutoff_stats(flagged)
    assert (c["requests"], c["rld_finished_first"], c["wan_bytes_cancelled"]) == (1, 1, 64)


def test_apply_overrides():
    cfg = apply_overrides(ClusterConfig(), wan_gbps=0.2, allow_p_rld=True, wan_order="srf", handoff_mode="catch_up",
                          base_port=29000, gateway_port=29900, served_model_name=None)
    assert cfg.link.wan_gbps == 0.2 and cfg.link.wan_rtt_ms == ClusterConfig().link.wan_rtt_ms
    assert cfg.policy.allow_p_rld and cfg.policy.wan_order == "srf" and cfg.policy.handoff_mode == "catch_up"
    assert (cfg.base_port, cfg.gateway_port, cfg.served_model_name) == (29000, 29900, "pdd-small")
    with pytest.raises(Exception):
        apply_overrides(ClusterConfig(), wan_order="random")
    with pytest.raises(TypeError):
        apply_overrides(ClusterConfig(), warp_speed=9)


def test_min_step_override_sets_the_engine_field_and_is_validated():
    assert ClusterConfig().engine.min_step_ms == 0.0  # off by default
    assert apply_overrides(ClusterConfig(), min_step_ms=30).engine.min_step_ms == 30.0
    for bad in (-1, float("nan"), float("inf")):
        with pytest.raises(pydantic.ValidationError):
            apply_overrides(ClusterConfig(), min_step_ms=bad)


SCALE = Scale(block_tokens=4, output_scale=1 / 100, min_output_tokens=3, max_output_tokens=6, target_rate_rps=40)


def _console(tmp_path):
    return Console(file=open(tmp_path / "console.txt", "w"), width=200)


def test_bench_end_to_end_absolute_slo_and_sweep(tmp_path, server_url):
    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
    FakeTopology.started.clear()
    FakeTopology.events.clear()
    out = tmp_path / "bench"
    report = run_bench(out, ("pdd", "cross_dc_pd"), 6, SCALE, cfg, seed=3, slo={"ttft_ms": 20_000, "tpot_ms": 10_000},
                       sweep=SweepPlan(start_rps=40.0, max_points=2), sweep_requests=4, request_timeout_s=10,
                       progress=False, console=_console(tmp_path),
                       topology_factory=lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    # no reference run with both bounds given; one fresh topology per mode, in the given order
    assert FakeTopology.started == ["pdd", "cross_dc_pd"]
    saved = json.loads((out / "report.json").read_text())
    assert saved == json.loads(json.dumps(report))
    assert set(REPORT_FIELDS) <= set(saved)
    assert saved["slo"]["source"] == "absolute" and saved["slo"]["ttft_ms"] == 20_000
    assert saved["seeds"]["token_seed"] == 3 and saved["bench"]["reference_requests"] == 0
    assert not (out / "reference_requests.jsonl").exists()  # no reference run: no file (it was written empty)
    assert list(saved["modes"]) == ["cross_dc_pd", "pdd"]
    recs = read_jsonl(out / "requests.jsonl")
    assert len(recs) == 12
    base = recompute_report(out / "requests.jsonl")
    for mode, m in saved["modes"].items():
        assert set(MODE_EXTRA_FIELDS) <= set(m)
        assert {k: m[k] for k in base[mode]} == base[mode]  # demo's fields unchanged
        assert m["completed"] == 6 and m["slo_met"] == 6 and m["slo_attainment"] == 1.0 and m["meets_sla"]
        assert m["request_goodput"] == pytest.approx(6 / m["duration_s"])
        assert m["pipeline_mix"] == {"p_rld_md": 1.0}
        assert m["handoff"]["handoffs"] == 6 and m["handoff"]["by_mode"] == {"one_shot": 6}
        assert m["handoff"]["handoff_pos_median"] == 2 and m["cutoffs"]["requests"] == 0
        assert m["p_hit_rate"] == 0.0 and m["md_hit_rate"] == 0.0  # from the usage chunks (fake stats lack them)
        assert m["cpu_seconds_by_process"] == {"gateway": 0.25, "p": 1.0}
        # sweep: 40 then 80 req/s, both met -> SLA goodput 80
        pts = saved["sweep"]["modes"][mode]["points"]
        assert [p["rate_rps"] for p in pts] == [40.0, 80.0] and all(p["requests"] == 4 for p in pts)
        assert [p["offered_rate_rps"] for p in pts] == pytest.approx([40.0, 80.0])
        assert m["sla_goodput_rps"] == 80.0 == saved["sweep"]["modes"][mode]["sla_goodput_rps"]
        # the trace goes on after the main run's 6 requests: the sweep replays its next requests on warm
        # caches (no flush between the main run and the points); one flush at the end counts leaked pages
        assert not any(p["reused_main_run"] for p in pts) and all(p["leaked_pages"] is None for p in pts)
        assert m["leaked_pages"] == 0
    # the warm-up's flush, then one after the main run and the sweep
    assert [e for e in FakeTopology.events if e[0] == "flush"] == [("flush", "pdd")] * 2 + [("flush", "cross_dc_pd")] * 2
    sweep_recs = read_jsonl(out / "sweep_requests.jsonl")
    assert len(sweep_recs) == 16 and {r["rate_rps"] for r in sweep_recs} == {40.0, 80.0}
    for mode in ("pdd", "cross_dc_pd"):  # trace records 6-9 at 40 req/s, then 10-13 at 80
        assert [r["idx"] for r in sweep_recs if r["mode"] == mode] == list(range(6, 14))
    assert saved["sweep"]["method"] == "continuation"
    assert saved["sweep"]["plan"]["kind"] == "auto" and saved["sweep"]["requests"] == 8
    for name in ("ttft_cdf.png", "handoff_gaps.png", "wan_throughput.png", "sweep.png", "timeline_pdd.png"):
        assert (out / name).read_bytes()[:4] == b"\x89PNG"
    text = (tmp_path / "console.txt").read_text()
    assert "SLA goodput (req/s)" in text and "total wall time" in text


def test_bench_sweep_on_flushed_caches_when_the_trace_ends(tmp_path, server_url):
    """A trace with no requests after the main run's: every point replays whole conversations
    of the workload on flushed caches (leaked pages counted per point)."""
    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
    FakeTopology.started.clear()
    FakeTopology.events.clear()
    trace = tmp_path / "t.jsonl"
    # two conversations of three turns (hash_ids[1] is the conversation key), each record with the
    # 512-token blocks its ids name, and a one-block record
    hids = [[1, 10 + i % 2] + [100 * (i % 2) + k for k in range(i // 2 + 1)] for i in range(6)]
    recs = [{"timestamp": 100.0 * i, "input_length": 512 * (len(h) - 1) + 8, "output_length": 300, "hash_ids": h}
            for i, h in enumerate(hids)]
    recs.append({"timestamp": 700.0, "input_length": 4, "output_length": 300, "hash_ids": [9]})
    trace.write_text("".join(json.dumps(r) + "\n" for r in recs))
    report = run_bench(tmp_path / "b", ("pdd",), 7, SCALE, cfg, trace=trace, slo={"ttft_ms": 20_000, "tpot_ms": 10_000},
                       sweep=SweepPlan(start_rps=80.0, max_points=1), sweep_requests=3, request_timeout_s=10,
                       progress=False, console=_console(tmp_path),
                       topology_factory=lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    assert report["sweep"]["method"] == "flushed"
    (pt,) = report["sweep"]["modes"]["pdd"]["points"]
    assert pt["requests"] == 3 and pt["leaked_pages"] == 0
    # flushed after the warm-up, the main run and the point
    assert [e for e in FakeTopology.events if e[0] == "flush"] == [("flush", "pdd")] * 3
    idx = [r["idx"] for r in read_jsonl(tmp_path / "b" / "sweep_requests.jsonl")]
    keys = {recs[i]["hash_ids"][1] if len(recs[i]["hash_ids"]) > 1 else None for i in idx}
    assert len(idx) == 3 and len(keys) == 1  # one whole conversation, not the first three requests


def test_bench_reference_run_fixes_the_slo(tmp_path, server_url):
    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
    FakeTopology.started.clear()
    out = tmp_path / "bench"
    out.mkdir()
    (out / "sweep_requests.jsonl").write_text('{"idx": 0, "rate_rps": 40.0}\n')  # an earlier run's, with a sweep
    report = run_bench(out, ("pdd",), 5, SCALE, cfg, ref_requests=3, sweep=None, request_timeout_s=10,
                       progress=False, console=_console(tmp_path),
                       topology_factory=lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    # same_dc_pd is not benchmarked: it gets a topology of its own for the reference run first
    assert FakeTopology.started == ["same_dc_pd", "pdd"]
    ref = read_jsonl(out / "reference_requests.jsonl")
    assert len(ref) == 3 and {r["mode"] for r in ref} == {"same_dc_pd"}
    for a, b in zip(ref, ref[1:]):
        assert b["send_s"] >= a["end_s"]  # one request in flight at a time
    slo = report["slo"]
    assert slo["source"] == "reference" and slo["reference"]["completed"] == 3
    assert slo["ttft_ms"] == pytest.approx(3 * slo["reference"]["median_ttft_ms"])
    assert slo["tpot_ms"] == pytest.approx(1.5 * slo["reference"]["median_tpot_ms"])
    m = report["modes"]["pdd"]
    assert m["slo_met"] is not None and 0 <= m["slo_attainment"] <= 1 and m["sla_goodput_rps"] is None
    assert report["sweep"] is None and report["bench"]["reference_requests"] == 3
    assert not (out / "sweep_requests.jsonl").exists()  # no sweep ran: no file (it was written empty)
    # the same records and SLO give the same goodput when recomputed
    from pdd.bench.slo import goodput
    recs = read_jsonl(out / "requests.jsonl")
    assert goodput(recs, SLO(slo["ttft_ms"], slo["tpot_ms"]))["slo_met"] == m["slo_met"]

    # with same_dc_pd among the modes, its topology also serves the reference run (no extra start)
    FakeTopology.started.clear()
    run_bench(tmp_path / "b2", ("pdd", "same_dc_pd"), 4, SCALE, cfg, ref_requests=2, sweep=None,
              request_timeout_s=10, progress=False, console=_console(tmp_path),
              topology_factory=lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    assert FakeTopology.started == ["same_dc_pd", "pdd"]


def test_bench_against_url(tmp_path, server_url):
    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
    assert RemoteTopology(server_url).stats() == {}  # the fake server has no /pdd/stats
    trace = tmp_path / "agentic.jsonl"  # any Mooncake-format JSONL
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 1024 + 512 * i, "output_length": 300,
                                         "hash_ids": [7, 8, 9 + i][: 2 + i % 2]}) + "\n" for i in range(4)))
    report = run_bench(tmp_path / "u", ("pdd", "colocated"), 4, SCALE, cfg, trace=trace, url=server_url,
                       ref_requests=2, sweep=SweepPlan(rates=(40.0,)), sweep_requests=0, request_timeout_s=10,
                       progress=False, console=_console(tmp_path))
    assert list(report["modes"]) == ["external"] and report["bench"]["url"] == server_url
    assert report["workload"]["requests"] == 4 and report["workload"]["rate_rps"] == pytest.approx(40.0)
    assert report["slo"]["reference"]["mode"] == "external"  # the reference ran on the server itself
    pts = report["sweep"]["modes"]["external"]["points"]
    assert len(pts) == 1 and pts[0]["reused_main_run"]  # sweep = main workload at the offered rate


def test_bench_against_url_whose_vocabulary_is_smaller_stops_first(tmp_path):
    """Found by a new user: `pdd bench --url` at a server on pdd's tiny model (1,024 tokens) with the
    demo's checkpoint (4,096) left locally drew prompt ids the server refused: the warm-up, the
    reference run and every request failed (0 of 10) before it said so. One request with the
    largest id comes first; its 400 is one line naming --config."""
    from bench_fakes import fake_app, serve_in_thread

    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))  # its vocabulary: 1,024 ids
    url, stop = serve_in_thread(fake_app(vocab=512))
    try:
        with pytest.raises(ValueError) as ex:
            run_bench(tmp_path / "u", ("pdd",), 4, SCALE, cfg, url=url, ref_requests=2, sweep=None,
                      request_timeout_s=10, progress=False, console=_console(tmp_path))
    finally:
        stop()
    assert str(ex.value) == (f"--url: the server refuses this run's prompt token ids (HTTP 400: prompt: token id "
                             f"1023 is outside the vocabulary [0, 512)); they are drawn from [0, 1024) (the "
                             f"checkpoint at {tmp_path / 'model'}): give --config with the server's model_path "
                             f"(or model_preset)")
    assert not (tmp_path / "u").exists()


def test_main_cli(tmp_path, server_url, monkeypatch):
    from pdd.topology import free_port_block

    model = fake_model(tmp_path / "model")
    base = free_port_block()  # not the config's default ports: a pdd serve or make demo may hold them
    (tmp_path / "cfg.json").write_text(json.dumps({"model_path": str(model), "base_port": base}))
    seen = []

    def factory(c, log_dir=None):
        seen.append(c)
        return FakeTopology(server_url, c, log_dir)

    monkeypatch.setattr(bench_mod, "_default_topology", factory)
    argv = ["--config", str(tmp_path / "cfg.json"), "--out", str(tmp_path / "cli"), "--modes", "pdd",
            "--requests", "4", "--block-tokens", "4", "--min-output", "2", "--max-output", "4", "--rate", "50",
            "--slo", "ttft:30000", "tpot:30000", "--sweep-rate", "50,100", "--sweep-requests", "3",
            "--wan-gbps", "0.3", "--allow-p-rld", "--wan-order", "srf", "--gateway-port", str(base + 99), "--no-progress"]
    assert main(argv) == 0
    assert {c.mode for c in seen} == {"pdd"} and seen[0].link.wan_gbps == 0.3
    assert seen[0].policy.allow_p_rld and seen[0].policy.wan_order == "srf" and seen[0].gateway_port == base + 99
    rep = json.loads((tmp_path / "cli" / "report.json").read_text())
    assert rep["bench"]["argv"] == argv and rep["bench"]["command"].startswith("pdd bench --config")
    assert rep["config"]["link"]["wan_gbps"] == 0.3
    assert rep["modes"]["pdd"]["sla_goodput_rps"] == 100.0
    with pytest.raises(SystemExit):
        main(["--slo", "e2el:5"])


@pytest.mark.parametrize("args,names", [
    (["--modes", "foo,pdd"], "--modes: mode 'foo'"),
    (["--modes", " , "], "--modes: no mode given"),
    (["--modes", "pdd+warp=1"], "--modes: mode 'pdd+warp=1'"),
    (["--trace", "/nonexistent.jsonl"], "--trace: no such file"),
    (["--config", "/nonexistent.yaml"], "pdd bench: error: --config /nonexistent.yaml: no such file\n"),  # as pdd serve
    (["--requests", "0"], "--requests: must be >= 1"),
    (["--requests", "-5"], "--requests: must be >= 1"),
    (["--rate", "-1", "--sweep-rate", "none"], "--rate: must be > 0"),
    (["--rate", "0"], "--rate: must be > 0"),
    (["--url", "http://127.0.0.1:1"], "--url: cannot reach"),
])
def test_cli_refuses_bad_arguments_naming_the_flag(capsys, tmp_path, args, names):
    """Found by a new user: these raised tracebacks, ran all four modes (--modes ''), or wrote a
    report of failures and exited 0 (--url with nothing listening)."""
    from pdd.bench.bench import main

    with pytest.raises(SystemExit) as ex:
        main(args + ["--out", str(tmp_path / "b")])
    assert ex.value.code == 2
    err = capsys.readouterr().err
    assert names in err and "Traceback" not in err
    assert not (tmp_path / "b").exists()  # nothing ran


def test_cli_names_a_config_that_does_not_validate(capsys, tmp_path):
    from pdd.bench.bench import main

    bad = tmp_path / "c.yaml"
    bad.write_text("link:\n  wan_gbps: -1\n")
    with pytest.raises(SystemExit):
        main(["--config", str(bad), "--out", str(tmp_path / "b")])
    err = capsys.readouterr().err
    assert f"--config {bad}" in err and "wan_gbps" in err and "Traceback" not in err
    # one line naming the field (as pdd serve), not pydantic's multi-line text and its URL
    assert f"--config {bad}: invalid config: link.wan_gbps: Input should be greater than 0" in err
    assert "errors.pydantic.dev" not in err and "validation error for" not in err


# ---------------------------------------------------------------- issue #3 additions


def test_mode_labels_and_their_configs():
    from pdd.bench.bench import mode_config, parse_mode_label

    assert parse_mode_label("cross_dc_pd") == ("cross_dc_pd", {})
    assert parse_mode_label("pdd+allow_p_rld") == ("pdd", {"allow_p_rld": True})
    assert parse_mode_label("pdd+routing=round_robin+pipeline_ttft_budget_ms=0") == (
        "pdd", {"routing": "round_robin", "pipeline_ttft_budget_ms": "0"})
    cfg = mode_config(ClusterConfig(policy={"pipeline_ttft_budget_ms": 50}), "pdd+pipeline_ttft_budget_ms=0+handoff_mode=auto")
    assert cfg.mode == "pdd" and cfg.policy.pipeline_ttft_budget_ms == 0.0 and cfg.policy.handoff_mode == "auto"
    assert mode_config(ClusterConfig(), "same_dc_pd").policy == ClusterConfig().policy
    cfg = mode_config(ClusterConfig(), "pdd+engine.prefill_order=short_first+engine.max_running=8")
    assert (cfg.engine.prefill_order, cfg.engine.max_running) == ("short_first", 8)
    assert cfg.policy == ClusterConfig().policy
    # a link setting per mode (link.wan_connections): bare or with its section
    assert parse_mode_label("cross_dc_pd+wan_connections=4") == ("cross_dc_pd", {"link.wan_connections": "4"})
    cfg = mode_config(ClusterConfig(), "cross_dc_pd+link.wan_connections=2+kv_stream=layerwise")
    assert (cfg.link.wan_connections, cfg.policy.kv_stream) == (2, "layerwise")
    assert mode_config(ClusterConfig(), "cross_dc_pd").link.wan_connections == 1
    for bad, msg in (("fast", "unknown mode 'fast'"), ("pdd+wan_connections=0", "wan_connections: Input should be"), ("pdd+warp=9", r"'warp' is neither autoscale\[=true\|false\], standby=none, a policy setting"),
                     ("pdd+engine.warp=1", "'engine.warp' is neither"), ("pdd+link.wan_gbps=1", "'link.wan_gbps'"),
                     ("pdd+engine.prefill_order=lifo", "prefill_order: Input should be"),
                     ("pdd+routing=random", "routing: Input should be"), ("pdd+allow_p_rld=maybe", "allow_p_rld")):
        with pytest.raises(ValueError, match=msg):
            parse_mode_label(bad)


@pytest.mark.parametrize("label,message", [
    # bare, a number setting read as true: a 1 ms budget, a batch of 1
    ("pdd+pipeline_ttft_budget_ms", "mode 'pdd+pipeline_ttft_budget_ms': pipeline_ttft_budget_ms takes a value "
                                    "(pdd+pipeline_ttft_budget_ms=VALUE); only on/off settings may be given bare"),
    ("pdd+engine.max_running", "engine.max_running takes a value (pdd+engine.max_running=VALUE)"),
    ("cross_dc_pd+wan_connections", "wan_connections takes a value (cross_dc_pd+wan_connections=VALUE)"),
    # pdd-only settings moved from their default on a mode without a relay tier: they would do nothing
    ("colocated+pipeline_ttft_budget_ms=100", "mode 'colocated+pipeline_ttft_budget_ms=100': pipeline_ttft_budget_ms "
                                              "acts on pdd's relay tier or pipeline choice, which colocated does not have"),
    ("cross_dc_pd+handoff_mode=auto+allow_p_rld", "handoff_mode, allow_p_rld act on"),
    ("same_dc_pd+cutoff=false", "cutoff acts on"),
    # a validator's message without pydantic's prefix
    ("pdd+wan_connections=0", "mode 'pdd+wan_connections=0': wan_connections: Input should be greater than or equal to 1"),
])
def test_mode_labels_that_would_do_nothing_or_else_are_refused(label, message):
    from pdd.bench.modes import parse_mode_label

    with pytest.raises(ValueError) as ex:
        parse_mode_label(label)
    assert message in str(ex.value) and "Value error" not in str(ex.value)


def test_a_pdd_only_setting_at_its_default_is_a_no_op_label():
    """The recipes tell two runs of one configuration apart with a no-op (A B B A: cross_dc_pd+cutoff=true)."""
    from pdd.bench.modes import parse_mode_label

    assert parse_mode_label("cross_dc_pd+routing=round_robin+cutoff=true") == (
        "cross_dc_pd", {"routing": "round_robin", "cutoff": "true"})
    assert parse_mode_label("same_dc_pd+pipeline_ttft_budget_ms=50") == ("same_dc_pd", {"pipeline_ttft_budget_ms": "50"})
    assert parse_mode_label("pdd+pipeline_ttft_budget_ms=100+allow_p_rld") == (
        "pdd", {"pipeline_ttft_budget_ms": "100", "allow_p_rld": True})


def test_handoff_gaps_by_mode_wide_window_baseline_and_switches():
    itl = [0.01 * k for k in range(40)]
    one = handed([t if k < 20 else t + 0.05 for k, t in enumerate(itl)], 20, mode="one_shot", rounds=1)  # 60 ms gap
    # catch-up: the gap is spread over 8 tokens before the switch (15 ms each), none at the switch
    cu_t = [0.01 * k + (0.005 * min(max(0, k - 12), 8)) for k in range(40)]
    cu = handed(cu_t, 20, mode="catch_up", rounds=1)
    plain = {"mode": "pdd", "ok": True, "send_s": 0.0, "end_s": 0.4, "token_times_s": itl, "pos": list(range(40)),
             "tiers": ["md"] * 40, "pdd": {"pipeline": "p_md"}}
    entry = {"stats_before": {"instances": {"rld0": {"role": "relay_decode", "counters": {"mode_switches": 2}}}},
             "stats": {"instances": {"rld0": {"role": "relay_decode", "counters": {"mode_switches": 5}},
                                     "md0": {"role": "main_decode", "counters": {}}}}}
    h = handoff_stats([one, cu, plain], median_itl_ms=10.0, entry=entry)
    assert h["mode_switches"] == 3
    assert h["gaps_by_mode"]["one_shot"]["gap_ms"]["max"] == pytest.approx(60.0)
    assert h["gaps_by_mode"]["catch_up"]["gap_ms"]["max"] == pytest.approx(15.0)  # +-3 tokens
    assert h["gaps_by_mode"]["catch_up"]["wide"]["gap_ms"]["max"] == pytest.approx(15.0)
    assert h["gaps_by_mode"]["catch_up"]["gap_over_median_itl"]["p95"] == pytest.approx(1.5)
    # baselines: the last 7 (28) gaps of each record, ending >= 3 tokens after its handoff
    assert h["baseline_wide"]["n"] == 1 and h["baseline_wide"]["gap_ms"]["max"] == pytest.approx(10.0)  # plain only
    assert h["baseline"]["n"] == 3 and h["baseline"]["gap_ms"]["max"] == pytest.approx(10.0)
    # no RLD instance: mode switches unknown
    assert handoff_stats([plain], entry={"stats": {"instances": {}}})["mode_switches"] is None


def test_pipeline_preview_prices_the_missing_kv(tmp_path):
    from pdd.bench.bench import kv_bytes_per_token, pipeline_preview
    from pdd.workload.replay import ReplayRequest

    (tmp_path / "config.json").write_text(json.dumps({"num_hidden_layers": 4, "num_attention_heads": 8,
                                                      "num_key_value_heads": 2, "head_dim": 32, "hidden_size": 256}))
    assert kv_bytes_per_token(tmp_path) == 4 * 2 * 2 * 32 * 4 == 2048
    assert kv_bytes_per_token(tmp_path, "bfloat16") == 1024

    def req(i, hashes, n_tokens, out):
        ids = [h * 100 + k for h in hashes for k in range(16)][:n_tokens]
        return ReplayRequest(idx=i, arrival_s=float(i), prompt_ids=ids, max_tokens=out,
                             trace_record={"timestamp": i, "hash_ids": hashes}, hash_ids=tuple(hashes), block_tokens=16)

    # a cold 64-token prompt, then a turn that extends it by 16 tokens (64 cached: 4 whole pages)
    reqs = [req(0, [1, 2, 3, 4], 64, 30), req(1, [1, 2, 3, 4, 5], 80, 10)]
    cfg = ClusterConfig(link={"wan_gbps": 0.05, "wan_rtt_ms": 20.0}, policy={"pipeline_ttft_budget_ms": 25})
    p = pipeline_preview(reqs, cfg, 2048, budgets_ms=(0.0, 30.0))
    # expected WAN ms = 20 + missing x 2048 x 8 / 5e7 x 1000: 64 missing -> 40.97, 16 missing -> 25.24
    assert p["expected_wan_ms"]["p50"] == pytest.approx((20 + 64 * 0.32768 + 20 + 16 * 0.32768) / 2)
    assert set(p["by_budget_ms"]) == {"0", "25", "30"} and p["configured_budget_ms"] == 25.0
    assert p["by_budget_ms"]["0"] == {"relayed_share": 1.0, "relayed_output_share": 1.0, "p_md_expected_wan_ms_p90": None}
    assert p["by_budget_ms"]["25"]["relayed_share"] == 1.0  # 25.24 > 25
    b30 = p["by_budget_ms"]["30"]
    assert b30["relayed_share"] == 0.5 and b30["relayed_output_share"] == pytest.approx(30 / 40)
    assert b30["p_md_expected_wan_ms_p90"] == pytest.approx(20 + 16 * 0.32768)


def settling_server(settle_after_polls: int):
    """The fake SSE server plus a /pdd/stats that, after each completion request, reports a
    transfer still crossing (transfers_pending 1, wan_bytes short of wan_bytes_expected) for
    ``settle_after_polls`` polls, then balances (as pdd's gateway does a few s after a replay)."""
    from bench_fakes import fake_app, serve_in_thread

    app = fake_app()
    state = {"requests": 0, "polls": 0}

    @app.middleware("http")
    async def count_requests(request, call_next):
        if request.url.path == "/v1/completions":
            state["requests"] += 1
            state["polls"] = 0
        return await call_next(request)

    @app.get("/pdd/stats")
    async def stats():
        state["polls"] += 1
        pending = state["requests"] > 0 and state["polls"] <= settle_after_polls
        expected = 1000 * state["requests"]
        return {"mode": "pdd", "instances": {}, "transfers_pending": int(pending),
                "wan_bytes": expected - 500 if pending else expected, "wan_bytes_expected": expected}

    return serve_in_thread(app)


def _tiny_trace(tmp_path):
    trace = tmp_path / "agentic.jsonl"
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 1024, "output_length": 300,
                                         "hash_ids": [7, 8 + i]}) + "\n" for i in range(4)))
    return trace


def test_bench_url_waits_for_the_server_to_settle_before_the_final_stats(tmp_path):
    """--url: the final /pdd/stats is read once transfers_pending is 0, so the WAN counts balance
    (a new user's read right after the replay: 1.49 MB sent vs 8.04 expected)."""
    url, stop = settling_server(settle_after_polls=3)
    try:
        cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
        report = run_bench(tmp_path / "u", ("pdd",), 4, SCALE, cfg, trace=_tiny_trace(tmp_path), url=url,
                           slo={"ttft_ms": 1e6, "tpot_ms": 1e6}, sweep=None, request_timeout_s=10, progress=False,
                           console=_console(tmp_path))
    finally:
        stop()
    m = report["modes"]["pdd"]
    assert m["completed"] == 4 and m["stats_settled"] is True
    assert m["wan_bytes"] == m["wan_bytes_expected"] == 4000  # after - before, both read settled
    assert "still busy" not in (tmp_path / "console.txt").read_text()


def test_remote_wait_idle_is_bounded_and_says_so(tmp_path):
    from pdd.bench.live import measured_replay

    url, stop = settling_server(settle_after_polls=10 ** 6)  # never settles once a request came
    try:
        remote = RemoteTopology(url)
        assert remote.wait_idle(timeout_s=0.3) is True  # nothing asked yet: settled
        remote.wait_idle = lambda: RemoteTopology.wait_idle(remote, timeout_s=0.3, poll_s=0.05)
        from pdd.workload.replay import ReplayRequest
        reqs = [ReplayRequest(idx=0, arrival_s=0.0, prompt_ids=[20, 21, 22], max_tokens=3, trace_record={})]
        console = _console(tmp_path)
        records, entry = measured_replay(remote, reqs, model="m", mode="pdd", timeout_s=10, progress=False,
                                         console=console)
        console.file.flush()
    finally:
        stop()
    assert records[0].ok and entry["idle"] is False
    assert mode_metrics([r.to_dict() for r in records], entry)["stats_settled"] is False
    assert "pdd: the server was still busy" in (tmp_path / "console.txt").read_text()


@pytest.mark.parametrize("body", [[], "x", 5])
def test_remote_stats_that_are_no_json_object_are_no_stats(body):
    # a server answering /pdd/stats and /pdd/flush with a JSON array or string: `pdd bench --url`
    # read its mode with .get and ended with an AttributeError traceback
    from fastapi import FastAPI
    from fastapi.responses import JSONResponse

    app = FastAPI()
    app.get("/pdd/stats")(lambda: JSONResponse(body))
    app.post("/pdd/flush")(lambda: JSONResponse(body))
    app.get("/health")(lambda: JSONResponse({"mode": "pdd"}))
    url, stop = serve_in_thread(app)
    try:
        remote = RemoteTopology(url)
        assert remote.stats() == {} and remote.flush() == {}
        assert remote.mode() == "pdd" and remote.wait_idle(timeout_s=0.1) is True
    finally:
        stop()


@pytest.mark.parametrize("ramp,text", [((5.0, 1.0), "ramp 5 -> 1 req/s"), ((0.5, 8.0), "ramp 0.5 -> 8 req/s")])
def test_a_ramped_run_says_its_ramp_where_it_prints_its_rate(tmp_path, server_url, monkeypatch, ramp, text):
    """``--ramp 5:1`` printed "pdd @ 2.36 req/s" (the mean) on its workload line and progress bar,
    never the ramp; both now name it, the mean after it."""
    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
    labels = []
    real = bench_mod.measured_replay

    def spy(*a, **k):
        labels.append(k.get("label"))
        return real(*a, **k)

    monkeypatch.setattr(bench_mod, "measured_replay", spy)
    report = run_bench(tmp_path / "bench", ("pdd",), 6, SCALE, cfg, seed=3, slo={"ttft_ms": 20_000, "tpot_ms": 10_000},
                       request_timeout_s=10, progress=False, console=_console(tmp_path), ramp=ramp,
                       topology_factory=lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    mean = report["workload"]["rate_rps"]
    assert report["workload"]["ramp_rps"] == list(ramp)
    assert labels == [f"pdd @ {text} (mean {mean:.2f})"]
    lines = [ln for ln in (tmp_path / "console.txt").read_text().splitlines() if ln.startswith("workload:")]
    assert len(lines) == 1 and f" of arrivals ({text}, mean {mean:.2f} req/s), prompt mean " in lines[0]


@pytest.mark.parametrize("shape", [{"ramp": (80.0, 20.0)}, {"rate_schedule": ((0.0, 80.0), (1.0, 20.0))}])
def test_a_sweep_point_at_a_shaped_main_run_s_mean_rate_is_run_not_reused(tmp_path, server_url, monkeypatch, shape):
    """A sweep point whose rate equalled the main run's mean took the main run's records as its
    own ("reused_main_run"), though a ``--ramp`` / ``--rate-schedule`` main run is not a
    constant-rate run at that rate: the point is run now; only a constant-rate main run is reused."""
    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
    kw = dict(slo={"ttft_ms": 20_000, "tpot_ms": 10_000}, request_timeout_s=10, progress=False,
              topology_factory=lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    mean = run_bench(tmp_path / "a", ("pdd",), 6, SCALE, cfg, seed=3, console=_console(tmp_path), **shape,
                     **kw)["workload"]["rate_rps"]
    labels = []
    real = bench_mod.measured_replay
    monkeypatch.setattr(bench_mod, "measured_replay", lambda *a, **k: labels.append(k.get("label")) or real(*a, **k))
    report = run_bench(tmp_path / "b", ("pdd",), 6, SCALE, cfg, seed=3, console=_console(tmp_path), **shape,
                       sweep=SweepPlan(rates=(mean,)), sweep_requests=4, **kw)
    assert report["workload"]["rate_rps"] == mean
    (pt,) = report["sweep"]["modes"]["pdd"]["points"]
    assert pt["reused_main_run"] is False and pt["rate_rps"] == mean and pt["requests"] == 4
    assert labels[1:] == [f"pdd sweep @ {mean:g} req/s"]
    # a constant-rate main run at the point's rate is still the point (test_bench_against_url)


class _FakeFaultRunner:
    """A FaultRunner that injects nothing into the fake topology and reports its spec injected
    (``injected``) or never injected: the bench records the run as faulted or not."""
    injected = True

    def __init__(self, topo, faults, recover_after_s=None):
        self.faults, self.injections, self.not_injected = list(faults), [], {}

    def start(self):
        for f in self.faults:
            if self.injected:
                self.injections.append({"spec": f.text, "kind": f.spec.kind, "nth": f.nth, "rid": None,
                                        "target": "rld0", "phase": f.spec.phase})
            else:
                self.not_injected[f.text] = "no eligible request reached rld_decode"
        return self

    def finish(self):
        pass


@pytest.mark.parametrize("injected", [True, False])
def test_a_faulted_main_run_is_not_taken_as_a_sweep_point(tmp_path, server_url, monkeypatch, injected):
    """A ``--fault`` main run at a constant rate was taken as the sweep point at its rate
    ("reused_main_run"), though faults were injected in it: the point is run now, without faults.
    A main run whose fault was never injected is still the point."""
    from pdd.bench import faults as faults_mod

    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
    trace = tmp_path / "t.jsonl"  # spread arrivals: a constant offered rate (40 req/s, SCALE's)
    trace.write_text("".join(json.dumps({"timestamp": 1000 * i, "input_length": 1024 + 512 * i, "output_length": 300,
                                         "hash_ids": [7, 8, 9 + i][: 2 + i % 2]}) + "\n" for i in range(6)))
    kw = dict(slo={"ttft_ms": 20_000, "tpot_ms": 10_000}, request_timeout_s=10, progress=False, trace=trace,
              topology_factory=lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    offered = run_bench(tmp_path / "a", ("pdd",), 6, SCALE, cfg, seed=3, console=_console(tmp_path),
                        **kw)["workload"]["rate_rps"]
    monkeypatch.setattr(_FakeFaultRunner, "injected", injected)
    monkeypatch.setattr(faults_mod, "FaultRunner", _FakeFaultRunner)
    labels = []
    real = bench_mod.measured_replay
    monkeypatch.setattr(bench_mod, "measured_replay", lambda *a, **k: labels.append(k.get("label")) or real(*a, **k))
    report = run_bench(tmp_path / "b", ("pdd",), 6, SCALE, cfg, seed=3, console=_console(tmp_path),
                       faults=["kill:rld@rld_decode"], sweep=SweepPlan(rates=(offered,)), sweep_requests=4, **kw)
    assert len(report["faults"]["modes"]["pdd"]["injections"]) == (1 if injected else 0)
    (pt,) = report["sweep"]["modes"]["pdd"]["points"]
    assert pt["reused_main_run"] is (not injected) and pt["rate_rps"] == offered
    assert labels[1:] == ([f"pdd sweep @ {offered:g} req/s"] if injected else [])


def test_main_run_as_sweep_point_only_constant_rate_and_fault_free():
    """The decision alone: the main run's records stand in for the point at its rate only when
    its rate was constant and no fault was injected in it."""
    from pdd.bench.bench import main_run_as_point

    recs = [{"rid": "a"}]
    assert main_run_as_point(recs, constant_rate=True, injections=()) is recs
    assert main_run_as_point(recs, constant_rate=False, injections=()) is None
    assert main_run_as_point(recs, constant_rate=True, injections=[{"spec": "kill:rld@rld_decode"}]) is None
    assert main_run_as_point(recs, constant_rate=True,  # an injection that failed may still have taken effect
                             injections=[{"spec": "kill:rld@rld_decode", "error": "RuntimeError: x"}]) is None


@pytest.mark.parametrize("sched,label,points", [
    (((0.0, 80.0), (1.0, 20.0)), "schedule 80 -> 20 req/s over 1 s", "schedule 0s:80, 1s:20 req/s"),
    # --load-profile ramp --low-rate 20 --peak-rate 80 --phase-seconds 0.1:0.1:0.1:0.1
    (((0.0, 20.0), (0.1, 20.0), (0.2, 80.0), (0.3, 80.0), (0.4, 20.0), (0.5, 20.0)),
     "schedule 20 -> 80 -> 20 req/s over 0.5 s", "schedule 0s:20, 0.1s:20, 0.2s:80, 0.3s:80, 0.4s:20, 0.5s:20 req/s"),
])
def test_a_scheduled_run_says_its_schedule_where_it_prints_its_rate(tmp_path, server_url, monkeypatch, sched, label,
                                                                      points):
    """``--rate-schedule`` / ``--load-profile ramp`` printed "pdd @ 47.3 req/s" (the mean) on the
    progress bar and the workload line; both now name the schedule, the mean after it."""
    cfg = ClusterConfig(model_path=str(fake_model(tmp_path / "model")))
    labels = []
    real = bench_mod.measured_replay
    monkeypatch.setattr(bench_mod, "measured_replay", lambda *a, **k: labels.append(k.get("label")) or real(*a, **k))
    report = run_bench(tmp_path / "bench", ("pdd",), 6, SCALE, cfg, seed=3, slo={"ttft_ms": 20_000, "tpot_ms": 10_000},
                       request_timeout_s=10, progress=False, console=_console(tmp_path), rate_schedule=sched,
                       topology_factory=lambda c, log_dir=None: FakeTopology(server_url, c, log_dir))
    mean = report["workload"]["rate_rps"]
    assert report["workload"]["requests"] == 6 and report["workload"]["rate_schedule"] == [list(p) for p in sched]
    assert labels == [f"pdd @ {label} (mean {mean:.2f})"]
    lines = [ln for ln in (tmp_path / "console.txt").read_text().splitlines() if ln.startswith("workload:")]
    assert len(lines) == 1 and f" of arrivals ({points}, mean {mean:.2f} req/s), prompt mean " in lines[0]
