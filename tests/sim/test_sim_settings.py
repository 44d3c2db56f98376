"""`pdd sim run --json` and `pdd sim experiment`'s result.json record the settings the simulation
ran with: every SimConfig field as used (after defaults, flags and a profile's live-run fit), the
runtime keys the mirrored ones stand for, and the values a field left None resolved to, so the
run can be repeated from its record alone (docs/SIM.md)."""

import json
from dataclasses import fields

from pdd.cli import main as pdd_main
from pdd.config import EngineConfig, LinkConfig, PolicyConfig
from pdd.sim.hardware import Efficiency
from pdd.sim.sim_config import RUNTIME_MIRRORS, SimConfig, config_from_settings, settings_of

SECTION = {PolicyConfig: "policy", LinkConfig: "link", EngineConfig: "engine"}


def test_settings_hold_every_field_and_rebuild_the_config():
    cfg = SimConfig(mode="pdd", wan_order="srf", wan_express_lane_bdp=0.5, ttft_budget_ms=120.0,
                    wan_send_buffer_bdp=3.0, wan_cross_traffic=((0.0, 5.0), (60.0, 10.0)), min_step_s=0.002,
                    tier_engines={"MD": {"max_running_seqs": 7}, "MD1": {"page_tokens": 64}},
                    efficiency=Efficiency(compute=0.5), step_overhead_s={"P": 0.001})
    st = settings_of(cfg)
    assert json.loads(json.dumps(st)) == st  # plain JSON values: what --json writes is what this returns
    assert set(st["sim_config"]) == {f.name for f in fields(SimConfig)}
    assert st["sim_config"]["wan_cross_traffic"] == [[0.0, 5.0], [60.0, 10.0]]
    assert st["sim_config"]["tier_engines"]["MD"]["max_running_seqs"] == 7
    assert st["sim_config"]["efficiency"]["compute"] == 0.5
    assert config_from_settings(st["sim_config"]) == cfg
    assert config_from_settings(json.loads(json.dumps(st))["sim_config"]) == cfg
    # the runtime's key of every mirrored field, in the runtime's units
    rt = st["runtime"]
    assert set(rt) == {f"{SECTION[m]}.{n}" for m, n, _ in RUNTIME_MIRRORS.values()}
    assert (rt["policy.wan_order"], rt["policy.wan_express_lane_bdp"], rt["policy.pipeline_ttft_budget_ms"],
            rt["policy.wan_send_buffer_bdp"], rt["engine.min_step_ms"], rt["link.wan_cross_traffic"]) == \
        ("srf", 0.5, 120.0, 3.0, 2.0, [[0.0, 5.0], [60.0, 10.0]])
    for name, (model, rt_name, conv) in RUNTIME_MIRRORS.items():  # each converts back to the field's value
        assert conv(rt[f"{SECTION[model]}.{rt_name}"]) == getattr(cfg, name), name
    # what a None deferred to: 3 BDPs of 100 Gbit/s x 20 ms; H100 SXM's NIC x 1 GPU; the model's KV bytes
    res = st["resolved"]
    assert res["wan_send_buffer_bytes"] == 3 * 100e9 / 8 * 0.020 == cfg.committed_bytes()
    assert res["wan_written_lead_bytes"] == res["wan_send_buffer_bytes"]
    assert res["wan_rtt_estimate_ms"] == 20.0
    assert res["fast_gbps"] == cfg.chip("a").nic_gbps * cfg.model_profile().gpus_per_instance
    assert res["kv_bytes_per_token"] == cfg.model_profile().kv_bytes_per_token
    assert res["page_tokens"] == 512
    assert (res["price_a"], res["price_b"]) == (cfg.chip("a").usd_per_hour, cfg.chip("b").usd_per_hour)
    assert res["engines"]["MD"]["max_running_seqs"] == 7 and res["engines"]["MD1"]["page_tokens"] == 64
    assert res["engines"]["P"]["max_running_seqs"] == 256 and set(res["engines"]) == {"P", "RLD", "MD", "MD1"}


def test_sim_run_json_records_the_effective_settings(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert pdd_main(["sim", "run", "--limit", "5", "--wan-order", "srf", "--wan-express-lane-bdp", "0.75",
                     "--budget-ms", "120", "--wan-rtt-ms", "40", "--n-md", "2", "--json", str(out)]) == 0
    s = json.loads(out.read_text())
    sc = s["settings"]["sim_config"]
    assert (sc["wan_order"], sc["wan_express_lane_bdp"], sc["ttft_budget_ms"], sc["wan_rtt_ms"], sc["n_md"]) == \
        ("srf", 0.75, 120.0, 40.0, 2)
    # the flags' defaults (the CLI's own, not SimConfig's) and the runtime's, as used
    assert (sc["wan_gbps"], sc["n_p"], sc["wan_send_buffer_bdp"], sc["slo_ttft_s"], sc["cutoff"]) == \
        (25.0, 4, 1.0, 2.0, True)
    assert s["settings"]["runtime"]["policy.wan_express_lane_bdp"] == 0.75
    assert s["settings"]["resolved"]["wan_send_buffer_bytes"] == 25e9 / 8 * 0.040
    # the same run again from the record alone: the same figures
    from pdd.sim.cluster import ClusterSim
    from pdd.sim.report import summarize
    from pdd.workload.records import MOONCAKE_TRACE, from_earliest, load_trace

    again = summarize(ClusterSim(config_from_settings(sc)).run(from_earliest(load_trace(MOONCAKE_TRACE, limit=5))))
    assert {k: again[k] for k in ("median_ttft_ms", "p90_tpot_ms", "completed")} == \
        {k: s[k] for k in ("median_ttft_ms", "p90_tpot_ms", "completed")}
    # the command's own flags, the workload's among them
    assert (s["arguments"]["limit"], s["arguments"]["wan_express_lane_bdp"], s["arguments"]["json"]) == \
        (5, 0.75, str(out))


def test_sim_run_json_records_the_autoscale_loop(tmp_path, capsys):
    out = tmp_path / "s.json"
    assert pdd_main(["sim", "run", "--agentic", "5", "--autoscale", "md=5", "--autoscale-start-s", "7",
                     "--json", str(out)]) == 0
    a = json.loads(out.read_text())["settings"]["autoscale"]
    assert (a["enabled"], a["max"], a["start_s"]) == (True, {"main_decode": 5}, 7.0)


def test_sim_run_json_records_a_config_files_settings(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("link:\n  wan_gbps: 40\npolicy:\n  wan_order: srf\n  wan_express_lane_bdp: 0\n")
    out = tmp_path / "s.json"
    assert pdd_main(["sim", "run", "--limit", "3", "--config", str(cfg), "--json", str(out)]) == 0
    sc = json.loads(out.read_text())["settings"]["sim_config"]
    assert (sc["wan_gbps"], sc["wan_order"], sc["wan_express_lane_bdp"]) == (40.0, "srf", 0.0)


def test_experiment_result_json_records_each_deployments_settings(tmp_path, capsys):
    from pdd.sim.experiments import _agentic_cluster

    out = tmp_path / "e"
    assert pdd_main(["sim", "experiment", "cutoff", "--quick", "--out", str(out)]) == 0
    res = json.loads((out / "result.json").read_text())
    base = _agentic_cluster(15.0)["pdd"]
    st = res["settings"]
    assert list(st) == [r["variant"] for r in res["rows"]]
    on = st["cut-off on (min remaining 0.5 s)"]
    assert config_from_settings(on["sim_config"]) == base
    assert (on["sim_config"]["wan_order"], on["sim_config"]["wan_express_lane_bdp"],
            on["sim_config"]["ttft_budget_ms"], on["resolved"]["wan_send_buffer_bytes"]) == \
        ("fifo", 2.0, 50.0, base.committed_bytes())
    assert st["cut-off off"]["sim_config"]["cutoff"] is False
    assert st["cut-off on (min remaining 0 s)"]["sim_config"]["cutoff_min_remaining_s"] == 0.0


def test_cost_ceiling_result_json_records_each_rows_deployment(tmp_path, capsys):
    out = tmp_path / "c"
    assert pdd_main(["sim", "experiment", "cost-ceiling", "--out", str(out), "--set", "pairs=A100-SXM4-80GB/H20-96GB",
                     "--set", "tpot_ms=50,100", "--set", "kv_bytes=49152"]) == 0
    res = json.loads((out / "result.json").read_text())
    assert list(res["settings"]) == ["A100-SXM4-80GB/H20-96GB tpot 50 ms kv 49152 B",
                                     "A100-SXM4-80GB/H20-96GB tpot 100 ms kv 49152 B"]
    sc = res["settings"]["A100-SXM4-80GB/H20-96GB tpot 100 ms kv 49152 B"]["sim_config"]
    assert (sc["chip_a"], sc["chip_b"], sc["slo_tpot_s"], sc["kv_bytes_per_token"], sc["price_a"], sc["price_b"]) == \
        ("A100-SXM4-80GB", "H20-96GB", 0.1, 49152, 1.5, 1.875)
