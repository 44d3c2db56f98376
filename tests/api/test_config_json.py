"""A config file named ``*.json`` is read as JSON (``ClusterConfig.load``, which every command's
``--config`` goes through): a syntax error is one line in JSON's words naming the file, line and
column (exit 2, as for any config file that does not parse), and JSON that PyYAML refuses (tab
indents) or misreads (a surrogate pair) loads. Found by a new user: a trailing comma in a
``.json`` config was accepted (YAML allows it), a missing comma was a PyYAML "while parsing a flow
mapping" message, and a tab-indented file was refused as YAML."""

from __future__ import annotations

import sys

import pytest

from pdd.cli import main
from pdd.config import ClusterConfig, ConfigFileError
from tests.cli_usage import usage_error

TRAILING_COMMA = '{\n  "mode": "colocated",\n  "gateway_port": 9100,\n}\n'


@pytest.mark.parametrize("text,problem", [
    # Python 3.13 names the trailing comma itself (at the comma), 3.11 and 3.12 what it expected after it
    (TRAILING_COMMA, "Illegal trailing comma before end of object (line 3, column 23)" if sys.version_info >= (3, 13)
     else "Expecting property name enclosed in double quotes (line 4, column 1)"),
    ('{"mode": "colocated" "gateway_port": 9100}', "Expecting ',' delimiter (line 1, column 22)"),
    ("{'mode': 'colocated'}", "Expecting property name enclosed in double quotes (line 1, column 2)"),
    ("mode: colocated\n", "Expecting value (line 1, column 1)"),  # YAML in a .json file
    ('{"mode": "colocated"}\n{"mode": "pdd"}\n', "Extra data (line 2, column 1)"),
])
def test_a_json_syntax_error_is_one_line_naming_the_file_line_and_column(tmp_path, capsys, text, problem):
    cfg = tmp_path / "bad.json"
    cfg.write_text(text)
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(cfg)
    assert str(ex.value) == f"{cfg}: not valid JSON: {problem}"
    for argv in (["serve"], ["launch", "--role", "gateway"], ["certs", "--out", str(tmp_path / "certs")],
                 ["bench", "--modes", "colocated"], ["sim", "run"]):
        err = usage_error(capsys, main, argv + ["--config", str(cfg)])
        prog = " ".join(argv[:2]) if argv[0] == "sim" else argv[0]
        assert err.splitlines()[-1] == f"pdd {prog}: error: --config {cfg}: not valid JSON: {problem}"
    assert not (tmp_path / "certs").exists()


def test_json_that_yaml_refuses_or_misreads_loads(tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text('{\n\t"mode": "colocated",\n\t"served_model_name": "m\\ud83d\\ude00",\n\t"gateway_port": 9100\n}\n')
    c = ClusterConfig.load(cfg)
    assert (c.mode, c.served_model_name, c.gateway_port) == ("colocated", "m\U0001f600", 9100)
    cfg.write_text('\ufeff{"mode": "colocated"}')  # a UTF-8 byte-order mark, as the YAML loader skips it
    assert ClusterConfig.load(cfg).mode == "colocated"
    for empty in ("", " \n", "null"):  # no settings: the defaults, as an empty YAML file
        cfg.write_text(empty)
        assert ClusterConfig.load(cfg) == ClusterConfig()


def test_a_yaml_file_is_read_as_before(tmp_path):
    cfg = tmp_path / "c.yaml"
    cfg.write_text('{"mode": "colocated" "gateway_port": 9100}')
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(cfg)
    assert str(ex.value) == (f"{cfg}: not valid YAML/JSON: while parsing a flow mapping: expected ',' or '}}', but "
                             "got '<scalar>' (line 1, column 22)")
    cfg.write_text(TRAILING_COMMA)  # YAML's flow mappings allow a trailing comma
    assert (ClusterConfig.load(cfg).mode, ClusterConfig.load(cfg).gateway_port) == ("colocated", 9100)
