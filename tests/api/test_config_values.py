"""Config values pydantic's lax mode would have taken for something else: a boolean for a number
(YAML's true / yes / on read as 1: a 1 ms pipeline budget, a 1 Gbit/s line), a number written as a
quoted string, anything but a boolean for a boolean (a quoted 'no' read as false, 1 as true) and a
non-finite float (a YAML ``.inf`` RTT or timeout would only show as a hang) are refused naming the
field, as the HTTP API refuses them; YAML's unquoted booleans and numbers stay accepted (mode
labels' text is read as its field's type first: pdd.bench.modes.typed_overrides). Found by
new-user reviews."""

import json

import pytest
from pydantic import ValidationError

from pdd.cli import main
from pdd.config import ClusterConfig, validation_summary
from tests.cli_usage import usage_error

BOOL = "must be a number, got {} (YAML reads true/false, yes/no and on/off as booleans)"


def _cli_refusal(capsys, argv) -> str:
    """The one line ``pdd ARGV`` printed refusing its config (exit 2, no traceback)."""
    return usage_error(capsys, main, argv).rstrip("\n")


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


TEXT = "must be a number written without quotes, got the string {}"
NOT_BOOL = "must be true or false (YAML's yes/no and on/off unquoted too), got {}"


@pytest.mark.parametrize("yaml_text,message", [
    ("engine: {page_size: '16'}\n", f"engine.page_size: {TEXT.format(repr('16'))}"),
    ("link: {wan_gbps: '1.5'}\n", f"link.wan_gbps: {TEXT.format(repr('1.5'))}"),
    ("request_timeout_s: '30'\n", f"request_timeout_s: {TEXT.format(repr('30'))}"),
    ("instances: {main_decode: '2'}\n", f"instances.main_decode: {TEXT.format(repr('2'))}"),
    ("engine: {min_step_ms: '5'}\n", f"engine.min_step_ms: {TEXT.format(repr('5'))}"),
    ('policy: {pipeline_ttft_budget_ms: "80"}\n', f"policy.pipeline_ttft_budget_ms: {TEXT.format(repr('80'))}"),
    ("limits: {max_inflight_requests: '8'}\n", f"limits.max_inflight_requests: {TEXT.format(repr('8'))}"),
    ("process_nice: '5'\n", f"process_nice: {TEXT.format(repr('5'))}"),
    ("tiers: {md0: {engine: {min_step_ms: '20'}}}\n", f"tiers.md0.engine.min_step_ms: {TEXT.format(repr('20'))}"),
    ("autoscale: {max: {main_decode: '2'}}\n", f"autoscale.max: {TEXT.format(repr('2'))} at main_decode"),
    ("cpu_affinity: {prefill: ['0']}\n", f"cpu_affinity: {TEXT.format(repr('0'))} at prefill[0]"),
    ("link: {wan_cross_traffic: [[0, '0.01']]}\n", f"link.wan_cross_traffic: {TEXT.format(repr('0.01'))} at [0][1]"),
    ("engine: {num_pages: fast}\n", f"engine.num_pages: {TEXT.format(repr('fast'))}"),
    (f"engine: {{num_pages: {'f' * 200}}}\n", f"engine.num_pages: {TEXT.format(repr('f' * 200)[:120] + '... (200 characters)')}"),
])
def test_a_string_for_a_number_names_the_field(tmp_path, yaml_text, message):
    """Pydantic's lax mode parsed a quoted number, where the HTTP API refuses ``"max_tokens": "5"``."""
    assert _refused(yaml_text, tmp_path) == message


@pytest.mark.parametrize("yaml_text,message", [
    ("policy: {cutoff: 'yes'}\n", f"policy.cutoff: {NOT_BOOL.format(chr(39).join(['the string ', 'yes', '']))}"),
    ("policy: {cutoff: 1}\n", f"policy.cutoff: {NOT_BOOL.format('the number 1')}"),
    ("policy: {early_handoff: 'no'}\n", f"policy.early_handoff: {NOT_BOOL.format(chr(39).join(['the string ', 'no', '']))}"),
    ("policy: {kv_whole_pages: 0}\n", f"policy.kv_whole_pages: {NOT_BOOL.format('the number 0')}"),
    ('security: {tls: "false"}\n', f"security.tls: {NOT_BOOL.format(chr(39).join(['the string ', 'false', '']))}"),
    ("vllm: {main_decode: 1.0}\n", f"vllm.main_decode: {NOT_BOOL.format('the number 1.0')}"),
    ("autoscale: {enabled: 'yes', max: {main_decode: 1}}\n",
     f"autoscale.enabled: {NOT_BOOL.format(chr(39).join(['the string ', 'yes', '']))}"),
    ("policy: {cutoff: null}\n", f"policy.cutoff: {NOT_BOOL.format('null')}"),
    ("policy: {cutoff: [true]}\n", f"policy.cutoff: {NOT_BOOL.format('[true]')}"),
])
def test_anything_but_a_boolean_for_a_boolean_names_the_field(tmp_path, yaml_text, message):
    """Pydantic's lax mode read a quoted 'no' as false and 1 as true (while the same text in
    ``autoscale.enabled`` was refused by its rule): every boolean field now takes booleans only."""
    assert _refused(yaml_text, tmp_path) == message


@pytest.mark.parametrize("yaml_text,message", [
    # the gateway sat at 100% CPU sampling every 1e-9 s
    ("autoscale: {enabled: true, sample_s: 1.0e-9, max: {main_decode: 2}}\n",
     "autoscale.sample_s: Input should be greater than or equal to 0.01"),
    ("autoscale: {enabled: true, interval_s: 0.01, sample_s: 0.01, max: {main_decode: 2}}\n",
     "autoscale.interval_s: Input should be greater than or equal to 0.1"),
    # a decision with no sample in its interval read utilisation 0 and drained an instance
    ("autoscale: {enabled: true, interval_s: 1, sample_s: 100, max: {main_decode: 2}}\n",
     "autoscale: sample_s: 100 must be <= interval_s (1): a decision reads the load sampled within its interval"),
])
def test_the_autoscaling_loop_s_periods_are_bounded(tmp_path, yaml_text, message):
    assert _refused(yaml_text, tmp_path) == message


def test_unquoted_booleans_and_numbers_stay_accepted(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy: {cutoff: off, allow_p_rld: yes, early_handoff: no, sibling_kv_once: on, kv_whole_pages: true,"
                   " pipeline_ttft_budget_ms: 80, routing: load, handoff_mode: auto}\n"
                   "engine: {num_pages: 4096, min_step_ms: 5, dtype: float16, device: cpu}\n"
                   "link: {wan_gbps: 1, wan_cross_traffic: [[0, 0.01], [1.5, 0]]}\n"
                   "tiers: {main_decode: {engine: {dtype: bfloat16, page_size: 32, prefill_order: short_first}}}\n"
                   "autoscale: {enabled: false, min: {main_decode: 1}}\nrequest_timeout_s: 30\n")
    c = ClusterConfig.load(cfg)
    assert (c.policy.cutoff, c.policy.allow_p_rld, c.policy.early_handoff, c.policy.sibling_kv_once,
            c.policy.kv_whole_pages, c.policy.pipeline_ttft_budget_ms, c.engine.num_pages) == (
        False, True, False, True, True, 80.0, 4096)
    assert (c.link.wan_gbps, c.link.wan_cross_traffic, c.request_timeout_s) == (1.0, [(0.0, 0.01), (1.5, 0.0)], 30.0)
    assert c.autoscale.min == {"main_decode": 1}
    assert ClusterConfig.model_validate(c.model_dump()) == c  # a dumped config validates again unchanged
    assert ClusterConfig.model_validate_json(c.model_dump_json()) == c  # as cluster.json, the instances' config


def test_numbers_in_exponent_form_are_numbers(tmp_path):
    """YAML 1.1 (PyYAML) reads an unquoted ``5e-1`` or ``1.0e12`` as a string, which the number
    fields refuse: the config loader reads them as YAML 1.2 and JSON do; quoted they stay strings."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("link: {wan_gbps: 5e-1, fast_gbps: 1E1, wan_rtt_ms: 2.5e+1}\nengine: {num_pages: 4e3}\n")
    c = ClusterConfig.load(cfg)
    assert (c.link.wan_gbps, c.link.fast_gbps, c.link.wan_rtt_ms, c.engine.num_pages) == (0.5, 10.0, 25.0, 4000)
    assert _refused("link: {wan_gbps: '5e-1'}\n", tmp_path) == f"link.wan_gbps: {TEXT.format(repr('5e-1'))}"


NOT_JSON = "must be a finite number; {} is not a valid JSON number (JSON has no NaN or Infinity)"


@pytest.mark.parametrize("json_text,message", [
    ('{"engine": {"page_size": NaN}}', f"engine.page_size: {NOT_JSON.format('NaN')}"),
    ('{"link": {"wan_gbps": Infinity}}', f"link.wan_gbps: {NOT_JSON.format('Infinity')}"),
    ('{"link": {"wan_cross_traffic": [[0, -Infinity]]}}', f"link.wan_cross_traffic: {NOT_JSON.format('-Infinity')} at [0][1]"),
    ('{"policy": {"cutoff": NaN}}',
     f"policy.cutoff: {NOT_BOOL.format('NaN (not a valid JSON number: JSON has no NaN or Infinity)')}"),
    ('{"engine": {"page_size": "NaN"}}', f"engine.page_size: {TEXT.format(repr('NaN'))}"),  # quoted: a string
])
def test_nan_in_a_json_config_is_named_as_not_json(tmp_path, capsys, json_text, message):
    """Found in user testing: ``{"page_size": NaN}`` (what Python's json.dumps writes for a NaN) was
    refused as "the string 'NaN'", which the file did not quote; JSON has no NaN nor Infinity."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json_text)
    with pytest.raises(ValidationError) as ex:
        ClusterConfig.load(cfg)
    assert validation_summary(ex.value) == message
    assert _cli_refusal(capsys, ["serve", "--config", str(cfg)]) == (
        f"pdd serve: error: --config {cfg}: invalid config: {message}")


def test_nan_stays_text_where_a_field_takes_text(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text('{"served_model_name": NaN}')
    c = ClusterConfig.load(cfg)
    assert c.served_model_name == "NaN" and type(c.served_model_name) is str


def test_mode_label_text_is_read_as_its_fields_type():
    """A label has only text: ``pdd+pipeline_ttft_budget_ms=80+cutoff=no`` sets the number 80 and
    false, not a string the config now refuses; a value that is neither is named."""
    from pdd.bench.modes import mode_config, parse_mode_label

    cfg = mode_config(ClusterConfig(), "pdd+pipeline_ttft_budget_ms=80+cutoff=no+engine.min_step_ms=2.5"
                                       "+routing=load+vllm.kvcache_gib=2+vllm.python=/v/bin/python")
    assert (cfg.policy.pipeline_ttft_budget_ms, cfg.policy.cutoff, cfg.engine.min_step_ms, cfg.policy.routing,
            cfg.vllm.kvcache_gib, cfg.vllm.python) == (80.0, False, 2.5, "load", 2, "/v/bin/python")
    assert mode_config(ClusterConfig(), "cross_dc_pd+wan_connections=4").link.wan_connections == 4
    for label, msg in (("pdd+pipeline_ttft_budget_ms=fast", "pipeline_ttft_budget_ms: must be a number, got 'fast'"),
                       ("pdd+cutoff=maybe", "cutoff: must be true or false, got 'maybe'")):
        with pytest.raises(ValueError) as ex:
            parse_mode_label(label)
        assert str(ex.value) == f"mode {label!r}: {msg}"


def test_serve_prints_the_field_not_a_traceback(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("policy:\n  pipeline_ttft_budget_ms: true\n")
    assert _cli_refusal(capsys, ["serve", "--config", str(cfg)]) == (
        f"pdd serve: error: --config {cfg}: invalid config: policy.pipeline_ttft_budget_ms: {BOOL.format('true')}")


@pytest.mark.parametrize("name", ["", "  ", "\t\n"])
def test_an_empty_served_model_name_is_refused(tmp_path, capsys, name):
    """An empty or blank served_model_name was served: /v1/models listed '' and a client could not
    name the model. pdd serve and pdd bench (its --model, and a config file's) refuse it alike."""
    msg = (f'served_model_name must be the name clients send as "model", not empty nor only whitespace; '
           f"got {name!r}")
    assert _refused(f"served_model_name: {json.dumps(name)}\n", tmp_path) == f"served_model_name: {msg}"
    assert _cli_refusal(capsys, ["serve", "--config", str(tmp_path / "c.yaml")]) == (
        f"pdd serve: error: --config {tmp_path / 'c.yaml'}: invalid config: served_model_name: {msg}")
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
    assert capsys.readouterr().err.splitlines()[0] == (
        "pdd: note: mode colocated has no relay tier nor pipeline choice; it does not use "
        "policy.pipeline_ttft_budget_ms, policy.handoff_mode (pdd mode only)")


HOST = ("must be an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1) or a hostname (RFC 1123: dot-separated labels of "
        "letters, digits and hyphens, e.g. localhost), got {}")


@pytest.mark.parametrize("host", ["not a host!", "", " 127.0.0.1", "999.1.1.1", "1.2.3", "-a.example", "a..b",
                                  "under_score", "x" * 64, "y" * 300, "http://127.0.0.1", "localhost:8000", "[::1]",
                                  "."])
def test_a_host_that_is_neither_an_ip_nor_a_hostname_is_refused_at_load(tmp_path, capsys, host):
    """``host: 'not a host!'`` was reported as its ports "already in use", and ``host: ''``
    started the topology and failed later with socket.gaierror."""
    # a long one cut to 120 characters, then its length (pdd.text.shown, as the HTTP API's refusals)
    shown = repr(host) if len(repr(host)) <= 120 else f"'{host[:119]}... ({len(host)} characters)"
    assert _refused(f"host: {json.dumps(host)}\n", tmp_path) == f"host: {HOST.format(shown)}"
    assert _cli_refusal(capsys, ["serve", "--config", str(tmp_path / "c.yaml")]) == (
        f"pdd serve: error: --config {tmp_path / 'c.yaml'}: invalid config: host: {HOST.format(shown)}")


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "0.0.0.0", "::1", "10.1.2.3", "node-1.dc.example",
                                  "example.com.", "1host", "x" * 63])
def test_ip_addresses_and_hostnames_stay_accepted(host):
    assert ClusterConfig.model_validate({"host": host}).host == host


EMPTY_KEY = ("is empty or only whitespace: no client can send it (the gateway drops an empty key; with no other key "
             "it would serve without auth); give a key or leave it out")
SPACED_KEY = ("has whitespace before or after it, which no Authorization header can carry (the value is trimmed): it "
              "could never match; remove the whitespace")


@pytest.mark.parametrize("keys,message", [
    ([""], f"key 1 of 1 {EMPTY_KEY}"),
    (["   "], f"key 1 of 1 {EMPTY_KEY}"),
    (["sk-good", "\t"], f"key 2 of 2 {EMPTY_KEY}"),
    ([" sk-1"], f"key 1 of 1 {SPACED_KEY}"),
    (["sk-1", "sk-2\n"], f"key 2 of 2 {SPACED_KEY}"),
    (["sk\x001"], "key 1 of 1 holds a control character, which no HTTP header can carry: it could never match"),
])
def test_an_api_key_no_client_can_send_is_refused_at_load(tmp_path, capsys, keys, message):
    """``security.api_keys: ['']`` passed the config; the gateway drops empty keys, so it served
    without auth until pdd serve's start-up check, after the whole topology started, refused it.
    The message names the key by position, never its text."""
    assert _refused(f"security: {{api_keys: {json.dumps(keys)}}}\n", tmp_path) == f"security.api_keys: {message}"
    assert _cli_refusal(capsys, ["serve", "--config", str(tmp_path / "c.yaml")]) == (
        f"pdd serve: error: --config {tmp_path / 'c.yaml'}: invalid config: security.api_keys: {message}")


def test_api_keys_a_client_can_send_stay_accepted():
    keys = ["sk-1", "a key with spaces inside", "k\tey", "clé"]
    assert ClusterConfig.model_validate({"security": {"api_keys": keys}}).security.api_keys == keys
    assert ClusterConfig.model_validate({"security": {"api_keys": []}}).security.api_keys == []


@pytest.mark.parametrize("name,text,message", [
    ("c.yaml", "engine: {page_size: 16, page_size: 32}\n",
     "not valid YAML/JSON: duplicate key 'page_size', given first on line 1 (line 1, column 25)"),
    ("c.yaml", "engine:\n  page_size: 16\n  num_pages: 64\n  page_size: 32\n",
     "not valid YAML/JSON: duplicate key 'page_size', given first on line 2 (line 4, column 3)"),
    ("c.json", '{"engine": {"page_size": 16},\n "mode": "pdd",\n "engine": {"num_pages": 64}}\n',
     "not valid JSON: duplicate key 'engine', given first on line 1 (line 3, column 2)"),
    ("c.json", '{"autoscale": {"min": {"prefill": 1}, "max": {"prefill": 1}},\n "engine": {"page_size": 16,\n'
               '  "page_size": 32}}\n',  # the same key in two objects is no duplicate; twice in one is
     "not valid JSON: duplicate key 'page_size', given first on line 2 (line 3, column 3)"),
])
def test_a_key_given_twice_is_refused_naming_it_and_its_lines(tmp_path, capsys, name, text, message):
    """Found by a new user: ``engine: {page_size: 16, page_size: 32}`` was accepted, the last one
    silently winning (PyYAML's way; JSON files were read by the same loader)."""
    from pdd.config import ConfigFileError

    cfg = tmp_path / name
    cfg.write_text(text)
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(cfg)
    assert str(ex.value) == f"{cfg}: {message}"
    with pytest.raises(SystemExit) as ex:
        main(["certs", "--config", str(cfg), "--out", str(tmp_path / "certs")])
    assert ex.value.code == 2
    assert capsys.readouterr().err == f"pdd certs: error: --config {cfg}: {message}\n"


def test_a_merge_key_may_still_be_overridden(tmp_path):
    """YAML's ``<<`` merge brings keys a mapping may override: not a key given twice."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("tiers:\n  prefill:\n    engine: &e {page_size: 16, num_pages: 64}\n"
                   "  main_decode:\n    engine:\n      <<: *e\n      page_size: 32\n")
    c = ClusterConfig.load(cfg)
    assert (c.tiers["main_decode"].engine.page_size, c.tiers["main_decode"].engine.num_pages) == (32, 64)


def test_a_max_input_len_above_max_model_len_is_refused_naming_both(tmp_path, capsys):
    """Found by a new user: ``max_input_len`` above ``max_model_len`` was accepted; a prompt between
    the two passed the gateway's input check only to be refused as over the context."""
    _refused_on_load_and_by_the_cli(tmp_path, capsys, "engine: {max_model_len: 512, max_input_len: 600}\n", (
        "engine: max_input_len 600 is above max_model_len 512 (prompt + output tokens): no prompt that long fits; "
        "lower max_input_len or raise max_model_len"))


def _refused_on_load_and_by_the_cli(tmp_path, capsys, text: str, message: str) -> None:
    """The config ``text`` is refused with ``message`` by ``ClusterConfig.load`` and by a command
    (``pdd certs``: exit 2 with that line, nothing written)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    with pytest.raises(ValidationError) as ex:
        ClusterConfig.load(cfg)
    assert validation_summary(ex.value) == message
    assert _cli_refusal(capsys, ["certs", "--config", str(cfg), "--out", str(tmp_path / "certs")]) == (
        f"pdd certs: error: --config {cfg}: invalid config: {message}")
    assert not (tmp_path / "certs").exists()


def test_a_lowered_max_model_len_alone_lowers_the_default_max_input_len(tmp_path):
    """A block that sets only ``max_model_len`` (below the default max_input_len 4000) stays valid,
    and so does its dump read back (what pdd serve hands its instances)."""
    cfg = tmp_path / "c.yaml"
    cfg.write_text("engine: {max_model_len: 256}\ntiers: {prefill: {engine: {num_pages: 64}}}\n")
    c = ClusterConfig.load(cfg)
    assert (c.engine.max_model_len, c.engine.max_input_len) == (256, 256)
    assert ClusterConfig.model_validate(c.model_dump()).engine.max_input_len == 256
    assert c.engine_for("p0").max_input_len == 256
    assert ClusterConfig().engine.max_input_len == 4000


POOL = "the KV pool (num_pages {} x page_size 16 = {} tokens)"


def test_a_max_model_len_above_the_kv_pool_is_refused_naming_both(tmp_path, capsys):
    """Found by a new user: ``num_pages: 32`` with ``max_model_len: 1024`` (a pool of 512 tokens)
    was accepted; a request with no max_tokens was admitted and failed part-way with a 503
    OutOfPages (a stream: 200, some tokens, then an error). vLLM refuses such a config at start."""
    _refused_on_load_and_by_the_cli(tmp_path, capsys, "engine: {num_pages: 32, max_model_len: 1024}\n", (
        "engine: max_model_len 1024 is above the KV pool (num_pages 32 x page_size 16 = 512 tokens): one sequence "
        "that long cannot be held; raise num_pages or lower max_model_len"))
    assert ClusterConfig.model_validate({"engine": {"num_pages": 32, "max_model_len": 512}}).engine.max_model_len == 512


def test_a_default_max_model_len_is_lowered_to_the_kv_pool(tmp_path):
    """Left out, max_model_len is the pool's tokens (max_input_len left out follows), not counted
    as given, and the config's dump (what pdd serve hands its instances) reads back the same."""
    c = ClusterConfig.model_validate({"engine": {"num_pages": 32}})
    assert (c.engine.max_model_len, c.engine.max_input_len) == (512, 512)
    assert c.engine.model_fields_set == {"num_pages"}
    assert ClusterConfig.model_validate(c.model_dump()).engine == c.engine
    c = ClusterConfig.model_validate({"engine": {"num_pages": 32, "max_input_len": 300}})
    assert (c.engine.max_model_len, c.engine.max_input_len) == (512, 300)
    assert _refused("engine: {num_pages: 32, max_input_len: 600}\n", tmp_path) == (
        "engine: max_input_len 600 is above max_model_len 512 (prompt + output tokens): no prompt that long fits; "
        "lower max_input_len or raise max_model_len")
    assert (ClusterConfig().engine.max_model_len, ClusterConfig().engine.max_input_len) == (4096, 4000)


@pytest.mark.parametrize("engine,tiers,message", [
    ({"max_model_len": 1024}, {"main_decode": {"engine": {"num_pages": 32}}},
     "tiers.main_decode.engine.num_pages: {} is below engine.max_model_len 1024: one sequence that long cannot be "
     "held; raise num_pages or lower engine.max_model_len".format(POOL.format(32, 512))),
    ({"max_input_len": 600}, {"prefill": {"engine": {"num_pages": 32}}},
     "tiers.prefill.engine.num_pages: {} is below engine.max_input_len 600: no prompt that long fits; raise "
     "num_pages or lower engine.max_input_len".format(POOL.format(32, 512))),
    ({"max_model_len": 1024, "page_size": 64, "num_pages": 16}, {"md1": {"engine": {"page_size": 16}}},
     "tiers.md1.engine.page_size: {} is below engine.max_model_len 1024: one sequence that long cannot be held; "
     "raise page_size or lower engine.max_model_len".format(POOL.format(16, 256))),
])
def test_a_tier_pool_below_a_given_max_model_len_is_refused_naming_the_tier_field(tmp_path, engine, tiers, message):
    """``max_model_len`` is every request's context window, whatever tier serves it: a tier's or
    instance's block that shrinks its pool below a given one is refused, naming the block's field."""
    text = json.dumps({"instances": {"main_decode": 2}, "engine": engine, "tiers": tiers})
    assert _refused(text, tmp_path) == message


def test_a_tier_pool_lowers_a_default_max_model_len_in_every_tier():
    """Left out everywhere, max_model_len is the smallest pool's tokens (a tier's or an instance's
    block), the same context window for every tier and mode; max_input_len left out follows."""
    c = ClusterConfig.model_validate({"instances": {"main_decode": 2}, "engine": {"num_pages": 64},
                                      "tiers": {"main_decode": {"engine": {"num_pages": 48}},
                                                "md1": {"engine": {"page_size": 8}},
                                                "prefill": {"engine": {"num_pages": 4096}}}})
    assert (c.engine.max_model_len, c.engine.max_input_len) == (384, 384)  # md1: 48 pages of 8 tokens
    assert [c.engine_for(n).max_model_len for n in ("p0", "rld0", "md0", "md1")] == [384] * 4
    assert c.engine.model_fields_set == {"num_pages"} and "engine" in c.model_fields_set
    assert ClusterConfig.model_validate(c.model_dump()).engine == c.engine
    c = ClusterConfig.model_validate({"tiers": {"main_decode": {"engine": {"num_pages": 32}}}})
    assert (c.engine.max_model_len, c.engine.max_input_len, c.engine.num_pages) == (512, 512, 2048)
    assert "engine" not in c.model_fields_set
    c = ClusterConfig.model_validate({"engine": {"max_input_len": 100}, "tiers": {"prefill": {"engine": {"num_pages": 8}}}})
    assert (c.engine.max_model_len, c.engine.max_input_len) == (128, 100)


def test_a_bare_nan_config_is_named_as_not_json(tmp_path):
    """A config file holding only ``NaN`` said "got a _BareNonFinite" (the loader's class)."""
    from pdd.config import ConfigFileError

    cfg = tmp_path / "c.json"
    cfg.write_text("NaN\n")
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(cfg)
    assert str(ex.value) == (f"{cfg}: expected a JSON object (a YAML mapping) of config fields, got NaN (not a valid "
                             "JSON number)")


@pytest.mark.parametrize("yaml_text,dead,hb", [
    ("liveness: {dead_after_s: 0.1, heartbeat_interval_s: 5}\n", "0.1", "5"),
    ("liveness: {heartbeat_interval_s: 3}\n", "5", "3"),  # the default dead_after_s under a slower heartbeat
    ("liveness: {dead_after_s: 1.9}\n", "1.9", "1"),
])
def test_a_dead_peer_wait_shorter_than_two_heartbeats_is_refused(tmp_path, yaml_text, dead, hb):
    """A peer declared dead after less than two heartbeats of silence is declared dead while
    alive (a new user's ``dead_after_s: 0.1``, ``heartbeat_interval_s: 5`` served, and dropped
    every idle connection every 5 s); twice the heartbeat (the tests' 0.25 / 1.5 too) passes."""
    assert _refused(yaml_text, tmp_path) == (
        f"liveness: dead_after_s {dead} must be at least twice heartbeat_interval_s {hb} (a quiet peer shows "
        "life once per heartbeat: a shorter wait declares live peers dead); raise dead_after_s or lower "
        "heartbeat_interval_s")
    ok = ClusterConfig.model_validate({"liveness": {"dead_after_s": 2.0, "heartbeat_interval_s": 1.0}})
    assert (ok.liveness.dead_after_s, ok.liveness.heartbeat_interval_s) == (2.0, 1.0)


def test_model_path_left_out_follows_the_preset(tmp_path):
    """``model_path`` left out is ``models/<model_preset>`` (docs/SERVE.md): ``model_preset: tiny``
    alone looked in ``models/small`` (and `pdd serve` wrote a tiny checkpoint there)."""
    f = tmp_path / "c.yaml"
    f.write_text("model_preset: tiny\n")
    assert ClusterConfig.load(f).model_path == "models/tiny"
    f.write_text("model_preset: tiny\nmodel_path: ckpt\n")
    assert ClusterConfig.load(f).model_path == "ckpt"
    assert ClusterConfig().model_path == "models/small"
