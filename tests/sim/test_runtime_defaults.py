"""SimConfig's defaults are the runtime's (pdd.config): `pdd sim run` and the experiments
simulate the pdd that `pdd serve` runs unless a setting is changed on purpose."""

from dataclasses import fields

import pytest

from pdd.config import EngineConfig, LinkConfig, PolicyConfig
from pdd.policy.wan_order import send_buffer_bytes
from pdd.sim.sim_config import RUNTIME_MIRRORS, SimConfig, runtime_default


def _runtime(model, name):
    return model.model_fields[name].get_default(call_default_factory=True)


def _sim_default(name):
    return {f.name: f.default for f in fields(SimConfig)}[name]


# SimConfig field -> the runtime's default, read here independently of RUNTIME_MIRRORS
EXPECTED = {
    "wan_order": "fifo",
    "wan_express_lane_bdp": 2.0,
    "wan_send_buffer_bdp": 1.0,
    "ttft_budget_ms": 50.0,
    "handoff_mode": "one_shot",
    "catchup_threshold": 64,
    "allow_p_rld": False,
    "md_predicted_send": True,
    "md_wait_claims": True,
    "early_handoff": True,
    "cutoff": True,
    "cutoff_min_remaining_s": 0.5,
    "cutoff_max_sent_fraction": 0.25,
    "wan_estimate": "live",
    "routing": "cache_aware",
    "load_slack": _runtime(PolicyConfig, "load_slack"),
    "md_load_slack": _runtime(PolicyConfig, "md_load_slack"),
    "md_load_cap": 0,
    "kv_stream": "whole",
    "kv_stream_layer_group": 1,
    "wan_loss_rate": 0.0,
    "wan_mss_bytes": 1460,
    "wan_cross_traffic": (),
    "prefill_order": "fcfs",
    "min_step_s": 0.0,
}


@pytest.mark.parametrize("name", sorted(EXPECTED))
def test_mirrored_default_is_the_runtimes(name):
    assert _sim_default(name) == EXPECTED[name]
    model, rt_name, conv = RUNTIME_MIRRORS[name]
    assert _sim_default(name) == conv(_runtime(model, rt_name))
    assert runtime_default(name) == _sim_default(name)


def test_every_mirror_is_listed_and_every_runtime_field_it_names_exists():
    assert set(RUNTIME_MIRRORS) == set(EXPECTED)
    for name, (model, rt_name, _) in RUNTIME_MIRRORS.items():
        assert model in (PolicyConfig, LinkConfig, EngineConfig)
        assert rt_name in model.model_fields, (name, rt_name)


def test_the_runtimes_defaults_themselves():
    # the three the simulator used to differ on (ps, no express lane, 250 ms)
    assert _runtime(PolicyConfig, "wan_order") == "fifo"
    assert _runtime(PolicyConfig, "wan_express_lane_bdp") == 2.0
    assert _runtime(PolicyConfig, "pipeline_ttft_budget_ms") == 50.0


def test_gateway_always_plans_with_the_wan_backlog():
    # the runtime gateway has no switch: its pipeline inputs always carry the backlog
    assert SimConfig().wan_backlog_in_plan is True


def test_send_buffer_is_the_runtimes_bdp_of_the_line_unless_set():
    c = SimConfig(wan_gbps=15.0, wan_rtt_ms=30.0)
    assert c.wan_send_buffer_bytes is None
    assert c.committed_bytes() == send_buffer_bytes(15.0, 30.0, 1.0) == 56_250_000
    # follows the line when it is replaced
    assert c.replace(wan_gbps=0.05, wan_rtt_ms=20.0).committed_bytes() == 125_000
    assert SimConfig(wan_gbps=0.01, wan_rtt_ms=1.0).committed_bytes() == 65_536  # the 64 KiB floor
    assert SimConfig(wan_send_buffer_bdp=0.0).committed_bytes() == 0.0
    assert SimConfig(wan_send_buffer_bytes=1234.0).committed_bytes() == 1234.0


def test_ps_is_still_a_modelling_choice():
    assert SimConfig(wan_order="ps").wan_order == "ps"
    with pytest.raises(ValueError, match="wan_order"):
        SimConfig(wan_order="lifo")


def test_validation_simulates_the_recorded_runs_policy_not_the_simulators_defaults():
    """pdd sim validate re-simulates a run with its recorded config's settings: every mirrored
    field set away from its default in the config reaches the SimConfig (the send buffer is the
    live fit's measurement instead: 0 bytes without one)."""
    from pathlib import Path

    from pdd import step_profile as P
    from pdd.config import ClusterConfig
    from pdd.sim import validate as V

    odd = dict(wan_order="srf", wan_express_lane_bdp=0.5, pipeline_ttft_budget_ms=123.0, handoff_mode="catch_up",
               catchup_threshold_tokens=7, allow_p_rld=True, md_predicted_send=False, md_wait_claims=False,
               early_handoff=False, cutoff=False, cutoff_min_remaining_s=0.25, cutoff_max_sent_fraction=0.5,
               wan_estimate="config", routing="load", load_slack=3, md_load_slack=5, md_load_cap=9,
               kv_stream="layerwise", kv_stream_layer_group=2)
    cfg = ClusterConfig.model_validate({"mode": "pdd", "policy": odd,
                                        "link": {"wan_loss_rate": 0.001, "wan_mss_bytes": 1200,
                                                 "wan_cross_traffic": [[0.0, 0.01]]},
                                        "engine": {"prefill_order": "short_first", "min_step_ms": 2.0}})
    path = Path(__file__).parents[2] / "data" / "profiles" / "this-machine.json"
    s = V.sim_config(cfg, path, P.load(path), 64, host_cores=2.0)
    names = {v[1]: k for k, v in RUNTIME_MIRRORS.items() if v[0] is PolicyConfig}
    for rt, v in odd.items():
        assert getattr(s, names[rt]) == v, rt
    assert (s.wan_loss_rate, s.wan_mss_bytes, s.wan_cross_traffic) == (0.001, 1200, ((0.0, 0.01),))
    assert (s.prefill_order, s.min_step_s) == ("short_first", 0.002)
    assert s.wan_send_buffer_bytes == 0.0 and s.committed_bytes() == 0.0


def test_pdd_sim_run_without_flags_simulates_the_runtimes_policy():
    """`pdd sim run`'s flags default to SimConfig's, so a run without them simulates the
    runtime's defaults (its --budget-ms was 250 and --wan-order ps)."""
    import argparse

    from pdd.sim import cli

    ap = argparse.ArgumentParser(prog="pdd")
    cli.add_sim_parser(ap.add_subparsers(dest="cmd", required=True))
    c = cli._make_cfg(ap.parse_args(["sim", "run"]))
    for name in RUNTIME_MIRRORS:
        assert getattr(c, name) == runtime_default(name), name
    assert c.wan_backlog_in_plan is True and c.wan_send_buffer_bytes is None
    c = cli._make_cfg(ap.parse_args(["sim", "run", "--wan-order", "ps", "--wan-express-lane-bdp", "0"]))
    assert (c.wan_order, c.wan_express_lane_bdp) == ("ps", 0.0)
