"""``pdd serve``: a flag out of the config's range names the flag beside the field it sets (the user
typed ``--port``, not ``gateway_port``) and is a usage error (exit 2); a value from the config file
names the file and the field only (exit 2 too). Refused before anything is started."""

import pytest

from pdd.cli import main
from tests.cli_usage import usage_error


def _exit_message(capsys, argv):
    """The one line a refused ``pdd`` command printed (exit 2, no traceback)."""
    return usage_error(capsys, main, argv).rstrip("\n")


def test_a_bad_port_flag_is_named(capsys):
    """Bad CLI input, exit 2, as pdd demo --port 0 and pdd bench --gateway-port 0 (it was exit 1)."""
    assert usage_error(capsys, main, ["serve", "--port", "99999"]) == (
        "pdd serve: error: invalid config: gateway_port (--port): Input should be less than or equal to 65535\n")


def test_two_bad_flags_are_both_named(capsys):
    assert usage_error(capsys, main, ["serve", "--port", "0", "--base-port", "70000"]) == (
        "pdd serve: error: invalid config: base_port (--base-port): Input should be less than or equal to 65400; "
        "gateway_port (--port): Input should be greater than or equal to 1\n")


def test_a_bad_port_in_the_file_names_the_field_only(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gateway_port: 99999\n")
    assert _exit_message(capsys, ["serve", "--config", str(cfg)]) == (
        f"pdd serve: error: --config {cfg}: invalid config: gateway_port: Input should be less than or equal to 65535")


def test_autoscale_without_roles_to_scale_is_refused(capsys):
    assert _exit_message(capsys, ["serve", "--autoscale"]) == (
        "pdd serve: error: --autoscale: invalid config: autoscale: max: name the roles to scale and their most active "
        "instances (e.g. {main_decode: 2}); with none the loop would change nothing")


def test_autoscale_bad_block_names_the_field(tmp_path, capsys):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("autoscale: {max: {main_decode: 2}}\n")
    assert _exit_message(capsys, ["serve", "--config", str(cfg), "--autoscale"]) == (
        f"pdd serve: error: --config {cfg}: invalid config: autoscale.max.main_decode: 2 is more than the role's 1 "
        "slot(s); raise instances and list the extra ones in standby")


@pytest.mark.parametrize("text,flags,message", [
    ("gateway_port: 70000\n", ["--port", "9300"], "gateway_port: Input should be less than or equal to 65535"),
    ("base_port: 70000\n", ["--base-port", "18000"], "base_port: Input should be less than or equal to 65400"),
    ("gateway_port: 0\nbase_port: 80\n", ["--port", "9300", "--base-port", "18000"],
     "base_port: Input should be greater than or equal to 1024; gateway_port: Input should be greater than or equal to 1"),
])
def test_a_bad_port_in_the_file_is_refused_under_the_flag_that_overrides_it(tmp_path, monkeypatch, capsys, text,
                                                                           flags, message):
    """Found by a new user: ``gateway_port: 70000`` with ``--port 9300`` was accepted (the flag
    replaced the value before the check), where pdd bench and serve without --port refuse the file.
    The file's field is named, not the flag, as without it (exit 2)."""
    import pdd.cli
    import pdd.topology

    def started(*a, **k):
        raise AssertionError("serve went on to start the topology")

    monkeypatch.setattr(pdd.topology, "ports_taken_refusal", started)
    monkeypatch.setattr(pdd.cli, "ensure_model", started)
    cfg = tmp_path / "c.yaml"
    cfg.write_text(text)
    assert _exit_message(capsys, ["serve", "--config", str(cfg), *flags]) == (
        f"pdd serve: error: --config {cfg}: invalid config: {message}")


def test_a_flag_may_still_move_a_port_the_file_sets_to_a_valid_one(tmp_path):
    from pdd.config import ClusterConfig

    cfg = tmp_path / "c.yaml"
    cfg.write_text("gateway_port: 9000\nbase_port: 8950\n")  # the file's ports collide; --port moves the gateway out
    assert ClusterConfig.load(cfg, gateway_port=9300).gateway_port == 9300


@pytest.mark.parametrize("value,message", [
    ("abc", "--shutdown-timeout 'abc': not a number; give seconds >= 0"),
    ("", "--shutdown-timeout '': not a number; give seconds >= 0"),
    ("-1", "invalid config: shutdown_timeout_s (--shutdown-timeout): Input should be greater than or equal to 0"),
    ("nan", "invalid config: shutdown_timeout_s (--shutdown-timeout): Input should be a finite number"),
    ("inf", "invalid config: shutdown_timeout_s (--shutdown-timeout): Input should be a finite number"),
])
def test_a_bad_shutdown_timeout_is_refused_in_one_line_naming_the_flag(capsys, value, message):
    assert usage_error(capsys, main, ["serve", f"--shutdown-timeout={value}"]) == f"pdd serve: error: {message}\n"


def test_the_shutdown_timeout_flag_sets_the_config_field(monkeypatch):
    """``--shutdown-timeout 0`` (end requests in flight at once) reaches the topology's config; left
    out, the config's (30 s by default)."""
    seen = _configs_serve_starts(monkeypatch, "shutdown_timeout_s", [
        ["serve", "--shutdown-timeout", "0"], ["serve", "--shutdown-timeout", "2.5"], ["serve"],
        ["serve", "--shutdown-timeout=-0"]])
    assert seen == [0.0, 2.5, 30.0, 0.0]
    assert str(seen[-1]) == "0.0"  # not -0.0 ("may finish for up to -0 s")


def test_the_tool_call_parser_flag_sets_the_config_field(monkeypatch, capsys):
    """``--tool-call-parser NAME`` (vLLM's flag) reaches the topology's config; left out, the
    config's (``auto``); another name is a usage error naming the choices."""
    seen = _configs_serve_starts(monkeypatch, "tool_call_parser", [
        ["serve", "--tool-call-parser", "hermes"], ["serve", "--tool-call-parser=none"], ["serve"]])
    assert seen == ["hermes", "none", "auto"]
    assert "invalid choice: 'pythonic'" in usage_error(capsys, main, ["serve", "--tool-call-parser", "pythonic"])


def _configs_serve_starts(monkeypatch, field: str, argvs: list[list[str]]) -> list:
    """``field`` of the config ``pdd serve`` would start each of ``argvs`` with (it stops where it
    would make the model: nothing is started, no port is checked)."""
    import pdd.cli

    seen = []

    def started(cfg, *a, **k):
        seen.append(getattr(cfg, field))
        raise SystemExit(0)

    monkeypatch.setattr(pdd.cli, "ensure_model", started)
    monkeypatch.setattr("pdd.topology.ports_taken_refusal", lambda *a, **k: None)
    for argv in argvs:
        with pytest.raises(SystemExit):
            main(argv)
    return seen
