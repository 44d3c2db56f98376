"""Ctrl-C (or SIGTERM's Stopped) escaping a subcommand: one line naming it and the shell's
status, no traceback (pdd.cli.main)."""
import signal

import pytest

from pdd import cli
from pdd.cli_args import Stopped


def _interrupt(*_a, **_k):
    raise KeyboardInterrupt


@pytest.mark.parametrize("argv,target,prog", [
    (["plan", "--requests", "10"], "pdd.sim.cli.cmd_plan", "pdd plan"),
    (["sim", "run"], "pdd.sim.cli.cmd_run", "pdd sim run"),
    (["bench", "--requests", "2"], "pdd.bench.bench.main", "pdd bench"),
])
def test_ctrl_c_is_one_line_and_130(argv, target, prog, monkeypatch, capsys):
    monkeypatch.setattr(target, _interrupt)
    assert cli.main(argv) == 130
    out, err = capsys.readouterr()
    assert err == f"{prog}: interrupted\n"
    assert "Traceback" not in out + err


def test_sigterm_stopped_escaping_is_one_line_and_143(monkeypatch, capsys):
    def stop(*_a, **_k):
        raise Stopped(signal.SIGTERM)

    monkeypatch.setattr("pdd.sim.cli.cmd_plan", stop)
    assert cli.main(["plan"]) == 143
    assert capsys.readouterr().err == "pdd plan: stopped by SIGTERM\n"
