"""pdd's log lines name their level, time and logger (``INFO 12-07 02:31:05 [pdd.transfer.link] ...``),
INFO included, at the level of ``--log-level`` / ``PDD_LOG_LEVEL`` (default INFO), in every process a
command starts. Before, pdd's loggers were never configured: Python's last-resort handler printed
WARNING and above as the bare message and every INFO line was lost."""

from __future__ import annotations

import json
import logging
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from pdd.cli import main
from tests.cli_usage import usage_error

ROOT = Path(__file__).resolve().parents[2]
LINE = r"{level} \d\d-\d\d \d\d:\d\d:\d\d \[{name}\] {message}"
LINK_INFO = LINE.format(level="INFO", name=re.escape("pdd.transfer.link"),
                        message=re.escape("link 127.0.0.1 gbps=0.05 rtt_ms=20.0 ports=[9331] control=9330"))


def _launch_link(tmp_path: Path, *flags: str, level_env: str | None = None) -> str:
    """``pdd launch --role link`` (the WAN emulator: no model needed) until it is READY, then
    SIGTERM; its stderr."""
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"mode": "pdd", "base_port": 9330, "gateway_port": 9262,
                               "security": {"tls": False, "fast_path": "plain"}}))
    env = dict(os.environ, PYTHONPATH=f"{ROOT / 'src'}{os.pathsep}{ROOT}")
    env.pop("PDD_LOG_LEVEL", None)
    if level_env is not None:
        env["PDD_LOG_LEVEL"] = level_env
    p = subprocess.Popen([sys.executable, "-m", "pdd.cli", "launch", "--role", "link", "--config", str(cfg), *flags],
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        assert p.stdout.readline() == "LINK READY\n", p.stderr.read() if p.poll() is not None else ""
        p.send_signal(signal.SIGTERM)
        _, err = p.communicate(timeout=30)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    return err


def test_an_instance_prints_its_info_lines_with_level_time_and_logger(tmp_path):
    err = _launch_link(tmp_path).splitlines()
    assert len(err) == 1 and re.fullmatch(LINK_INFO, err[0]), err


@pytest.mark.parametrize("flags,env", [(("--log-level", "warning"), None), ((), "WARNING"),
                                       (("--log-level", "WARNING"), "debug")],
                         ids=["flag", "env", "flag-over-env"])
def test_the_log_level_hides_info_lines(tmp_path, flags, env):
    assert _launch_link(tmp_path, *flags, level_env=env) == ""


def test_a_warning_names_its_level_and_logger(capsys, tmp_path, monkeypatch):
    """The one line per dropped connection (docs/FAULTS.md) as the gateway prints it."""
    monkeypatch.delenv("PDD_LOG_LEVEL", raising=False)  # (restored unset after the test)
    with pytest.raises(SystemExit):  # configured at pdd's start, before the missing --config file is refused
        main(["serve", "--log-level", "debug", "--config", str(tmp_path / "none.yaml")])
    capsys.readouterr()
    logging.getLogger("pdd.gateway.orchestrator").warning("lost the connection to instance md0 (why)")
    logging.getLogger("pdd.gateway.orchestrator").debug("a debug line")
    logging.getLogger("httpx").info("HTTP Request: GET http://x 200 OK")  # others: WARNING and above only
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2, err
    assert re.fullmatch(LINE.format(level="WARNING", name=re.escape("pdd.gateway.orchestrator"),
                                    message=re.escape("lost the connection to instance md0 (why)")), err[0]), err
    assert re.fullmatch(LINE.format(level="DEBUG", name=re.escape("pdd.gateway.orchestrator"),
                                    message="a debug line"), err[1]), err
    assert os.environ["PDD_LOG_LEVEL"] == "DEBUG"  # what serve's instances inherit


def test_a_bad_log_level_flag_is_a_usage_error_naming_it(capsys):
    err = usage_error(capsys, main, ["launch", "--role", "link", "--log-level", "loud"])
    assert err.endswith("pdd launch: error: argument --log-level: 'loud': not a log level (one of DEBUG, INFO, "
                        "WARNING, ERROR, CRITICAL, any case; WARN for WARNING)\n"), err


def test_a_bad_log_level_variable_is_refused_in_one_line(capsys, monkeypatch):
    monkeypatch.setenv("PDD_LOG_LEVEL", "loud")
    assert main(["serve", "--config", "/nonexistent/pdd.yaml"]) == 2  # refused before the config is read
    assert capsys.readouterr().err == ("pdd: PDD_LOG_LEVEL 'loud': not a log level (one of DEBUG, INFO, WARNING, "
                                       "ERROR, CRITICAL, any case; WARN for WARNING)\n")


def test_a_log_level_flag_replaces_a_bad_variable_and_help_still_prints(capsys, monkeypatch):
    """A bad ``PDD_LOG_LEVEL`` is refused only where nothing replaces it: ``--log-level warn``
    (Python's alias of WARNING) overrides it, and ``--help`` prints (both exited 2 on the
    variable); ``pdd demo``, which takes no flag, refuses it in one line."""
    monkeypatch.setenv("PDD_LOG_LEVEL", "loud")
    with pytest.raises(SystemExit) as e:
        main(["serve", "--config", "/nonexistent/pdd.yaml", "--log-level", "warn"])
    err = capsys.readouterr().err
    assert "PDD_LOG_LEVEL" not in err and "/nonexistent/pdd.yaml" in err and e.value.code != 0, err
    assert logging.getLogger("pdd").level == logging.WARNING
    monkeypatch.setenv("PDD_LOG_LEVEL", "loud")  # --log-level put WARNING there (for serve's instances)
    with pytest.raises(SystemExit) as e:
        main(["serve", "--help"])
    assert e.value.code == 0 and "--log-level" in capsys.readouterr().out
    assert main(["demo", "--requests", "1"]) == 2
    assert capsys.readouterr().err.startswith("pdd: PDD_LOG_LEVEL 'loud': not a log level")
