"""Every command that takes ``--config`` refuses a bad one with exit 2 (argparse's usage-error
status) and one line naming the file and the field: a value out of range exited 1 (``pdd:
invalid config: ...``) while a syntax error in the same file exited 2. Nothing is started."""

import pytest

from pdd.cli import main
from tests.cli_usage import usage_error

COMMANDS = [["serve"], ["bench", "--out", "{tmp}/out"], ["sim", "run", "--agentic", "3"],
            ["plan", "--requests", "3"]]


def _prog(argv):
    return "pdd " + (" ".join(argv[:2]) if argv[0] == "sim" else argv[0])


@pytest.mark.parametrize("argv", COMMANDS)
def test_a_field_out_of_range_is_exit_2_naming_file_and_field(capsys, tmp_path, argv):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gateway_port: 99999\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    err = usage_error(capsys, main, argv + ["--config", str(cfg)])
    assert err.splitlines()[-1] == (f"{_prog(argv)}: error: --config {cfg}: invalid config: gateway_port: "
                                    "Input should be less than or equal to 65535")


@pytest.mark.parametrize("argv", COMMANDS)
def test_a_syntax_error_is_exit_2_too(capsys, tmp_path, argv):
    cfg = tmp_path / "c.yaml"
    cfg.write_text("gateway_port: [\n")
    argv = [a.replace("{tmp}", str(tmp_path)) for a in argv]
    err = usage_error(capsys, main, argv + ["--config", str(cfg)])
    assert err.splitlines()[-1].startswith(f"{_prog(argv)}: error: --config {cfg}: not valid YAML/JSON: "), err


def test_serve_autoscale_without_roles_is_exit_2_naming_the_flag(capsys):
    err = usage_error(capsys, main, ["serve", "--autoscale"])
    assert err == ("pdd serve: error: --autoscale: invalid config: autoscale: max: name the roles to scale and "
                   "their most active instances (e.g. {main_decode: 2}); with none the loop would change nothing\n")


def test_certs_without_the_ca_key_to_issue_with_is_exit_2_naming_out(capsys, tmp_path):
    """An --out holding a CA certificate but not its key (copied without it) was exit 1."""
    import shutil

    from pdd.cli import main as pdd_main

    assert pdd_main(["certs", "--out", str(tmp_path / "a")]) == 0
    (tmp_path / "b").mkdir()
    shutil.copy(tmp_path / "a" / "ca.pem", tmp_path / "b" / "ca.pem")
    capsys.readouterr()
    out = tmp_path / "b"
    assert usage_error(capsys, main, ["certs", "--out", str(out)]) == (
        f"pdd certs: error: --out {out}: no certificate for 'p0' and no ca.key to issue one; run `pdd certs --out "
        f"{out}` where the CA key is\n")
