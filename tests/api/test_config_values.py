"""Config values pydantic's lax mode would have taken for something else: a boolean for a number
(YAML's true / yes / on read as 1: a 1 ms pipeline budget, a 1 Gbit/s line) and a non-finite float
(a YAML ``.inf`` RTT or timeout would only show as a hang) are refused naming the field; numbers
written as text stay accepted (mode labels pass them so). Found by a new-user review."""

import json

import pytest
from pydantic import ValidationError

from pdd.cli import main
from pdd.config import ClusterConfig, validation_summary

BOOL = "must be a number, got {} (YAML reads true/false, yes/no and on/off as booleans)"


def _refused(yaml_text: str, tmp_path) -> str:
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml_text)
    with pytest.raises(ValidationError) as ex:
        ClusterConfig.load(cfg)
    return validation_summary(ex.value)


@pytest.mark.parametrize("yaml_text,field,shown", [
    ("policy: {pipeline_ttft_budget_ms: true}\n", "policy.pipeline_ttft_budget_ms", "true"),
    ("link: {wan_gbps: on}\n", "link.wan_gbps", "true"),
    ("instances: {main_decode: yes}\n", "instances.main_decode", "true"),
    ("engine: {min_step_ms: false}\n", "engine.min_step_ms", "false"),
    ("model_seed: true\n", "model_seed", "true"),
    ("tiers: {main_decode: {engine: {max_running: true}}}\n", "tiers.main_decode.engine.max_running", "true"),
    ("autoscale: {min: {main_decode: true}}\n", "autoscale.min", '{"main_decode": true}'),
    ("cpu_affinity: {prefill: [true]}\n", "cpu_affinity", '{"prefill": [true]}'),
    ("link: {wan_cross_traffic: [[0, true]]}\n", "link.wan_cross_traffic", "[[0, true]]"),
])
def test_a_boolean_for_a_number_names_the_field(tmp_path, yaml_text, field, shown):
    assert _refused(yaml_text, tmp_path) == f"{field}: {BOOL.format(shown)}"


@pytest.mark.parametrize("yaml_text,field", [
    ("link: {wan_rtt_ms: .inf}\n", "link.wan_rtt_ms"),
    ("request_timeout_s: .inf\n", "request_timeout_s"),
    ("liveness: {dead_after_s: .inf}\n", "liveness.dead_after_s"),
    ("policy: {pipeline_ttft_budget_ms: .nan}\n", "policy.pipeline_ttft_budget_ms"),
    ("limits: {max_queue_wait_s: -.inf}\n", "limits.max_queue_wait_s"),
])
def test_a_non_finite_float_names_the_field(tmp_path, yaml_text, field):
    assert _refused(yaml_text, tmp_path) == f"{field}: Input should be a finite number"


@pytest.mark.parametrize("yaml_text,field,shown", [
    ("link: {wan_gbps: 1.0e-312}\n", "link.wan_gbps", "1e-312"),  # subnormal: passed gt=0, a chunk's time inf
    ("link: {fast_gbps: 5.0e-7}\n", "link.fast_gbps", "5e-07"),
])
def test_a_line_rate_below_1_kbit_s_names_the_field(tmp_path, yaml_text, field, shown):
    assert _refused(yaml_text, tmp_path) == f"{field}: must be >= 1e-06 Gbit/s (1 kbit/s: a 64 KiB chunk then takes 524 s; below it a chunk's time overflows), got {shown}"
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("link: {wan_gbps: 1.0e-6, fast_gbps: 1.0e-6}\n")  # the floor itself is a rate
    assert ClusterConfig.load(cfg).link.wan_gbps == 1e-6


@pytest.mark.parametrize("yaml_text,field", [
    ("link: {wan_rtt_ms: 1.0e12}\n", "link.wan_rtt_ms"),  # passed ge=0: every byte held past every timeout
    ("link: {wan_jitter_ms: 70000}\n", "link.wan_jitter_ms"),
    ("link: {fast_rtt_ms: 60001}\n", "link.fast_rtt_ms"),
])
def test_a_line_delay_above_a_minute_names_the_field(tmp_path, yaml_text, field):
    assert _refused(yaml_text, tmp_path) == f"{field}: Input should be less than or equal to 60000"
    cfg = tmp_path / "ok.yaml"
    cfg.write_text("link: {wan_rtt_ms: 60000, wan_jitter_ms: 60000, fast_rtt_ms: 60000}\n")  # the bound itself
    assert ClusterConfig.load(cfg).link.wan_rtt_ms == 60000


def test_booleans_and_numbers_as_text_stay_accepted(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy: {cutoff: off, allow_p_rld: yes, pipeline_ttft_budget_ms: '80'}\n"
                   "engine: {num_pages: '4096'}\nautoscale: {enabled: false, min: {main_decode: 1}}\n")
    c = ClusterConfig.load(cfg)
    assert (c.policy.cutoff, c.policy.allow_p_rld, c.policy.pipeline_ttft_budget_ms, c.engine.num_pages) == (
        False, True, 80.0, 4096)
    assert c.autoscale.min == {"main_decode": 1}
    assert ClusterConfig.model_validate(c.model_dump()) == c  # a dumped config validates again unchanged


def test_serve_prints_the_field_not_a_traceback(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy:\n  pipeline_ttft_budget_ms: true\n")
    with pytest.raises(SystemExit) as ex:
        main(["serve", "--config", str(cfg)])
    assert ex.value.code == f"pdd: invalid config: policy.pipeline_ttft_budget_ms: {BOOL.format('true')}"


@pytest.mark.parametrize("name", ["", "  ", "\t\n"])
def test_an_empty_served_model_name_is_refused(tmp_path, name):
    """An empty or blank served_model_name was served: /v1/models listed '' and a client could not
    name the model. pdd serve and pdd bench (its --model, and a config file's) refuse it alike."""
    msg = (f'served_model_name must be the name clients send as "model", not empty nor only whitespace; '
           f"got {name!r}")
    assert _refused(f"served_model_name: {json.dumps(name)}\n", tmp_path) == f"served_model_name: {msg}"
    with pytest.raises(SystemExit) as ex:
        main(["serve", "--config", str(tmp_path / "c.yaml")])  # the file _refused wrote
    assert ex.value.code == f"pdd: invalid config: served_model_name: {msg}"
    assert ClusterConfig.model_validate({"served_model_name": " a b "}).served_model_name == " a b "


def test_unused_settings_are_the_pdd_only_policy_a_file_sets(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("mode: colocated\npolicy: {pipeline_ttft_budget_ms: 100, routing: load, cutoff: false}\n")
    c = ClusterConfig.load(cfg)
    assert c.unused_settings() == ["policy.pipeline_ttft_budget_ms", "policy.cutoff"]
    assert ClusterConfig.load(cfg, mode="pdd").unused_settings() == []
    assert ClusterConfig(mode="cross_dc_pd").unused_settings() == []  # defaults are not the user's settings


def test_serve_notes_pdd_only_settings_a_mode_ignores(tmp_path, capsys):
    """`pdd serve --mode colocated` with a pdd config served silently as if its budget applied. The
    note comes before anything starts (here --autoscale without roles stops it right after)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy: {pipeline_ttft_budget_ms: 100, handoff_mode: auto}\n")
    with pytest.raises(SystemExit):
        main(["serve", "--config", str(cfg), "--mode", "colocated", "--autoscale"])
    assert capsys.readouterr().err == (
        "pdd: note: mode colocated has no relay tier nor pipeline choice; it does not use "
        "policy.pipeline_ttft_budget_ms, policy.handoff_mode (pdd mode only)\n")
