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


def test_a_config_file_larger_than_the_cap_or_not_a_regular_file_is_one_line(tmp_path, capsys):
    """``--config /dev/zero`` read forever (22 GB); a FIFO would hang: the size is capped
    (1 MiB, at most cap + 1 bytes read) and only a regular file is read."""
    from pdd.config import MAX_CONFIG_BYTES

    big = tmp_path / "big.yaml"
    big.write_text("#" * MAX_CONFIG_BYTES + "\n")
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(big)
    too_large = f"larger than the cap of 1,048,576 bytes ({MAX_CONFIG_BYTES + 1:,} bytes); give a YAML or JSON file"
    assert str(ex.value) == f"{big}: {too_large}"  # the message of every capped input file (pdd.files)
    for argv in (["serve"], ["sim", "run"], ["bench", "--modes", "colocated", "--out", str(tmp_path / "o")]):
        prog = " ".join(argv[:2]) if argv[0] == "sim" else argv[0]
        for path, why in ((str(big), too_large),
                          ("/dev/zero", "not a regular file (a device, FIFO or socket); give a YAML or JSON file")):
            err = usage_error(capsys, main, argv + ["--config", path])  # (bench said "no such file")
            assert err.splitlines()[-1] == f"pdd {prog}: error: --config {path}: {why}"
    fifo = tmp_path / "fifo.yaml"
    import os
    os.mkfifo(fifo)
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(fifo)  # opened non-blocking: no writer, no hang
    assert str(ex.value) == f"{fifo}: not a regular file (a device, FIFO or socket); give a YAML or JSON file"
    ok = tmp_path / "ok.yaml"
    ok.write_text("mode: colocated\n" + "#" * (MAX_CONFIG_BYTES - 17) + "\n")  # exactly the cap
    assert ClusterConfig.load(ok).mode == "colocated"


@pytest.mark.parametrize("name,text", [
    ("deep.yaml", "x: " + "[" * 5000 + "]" * 5000 + "\n"),
    ("deep.json", '{"x": ' + "[" * 100_000 + "]" * 100_000 + "}"),
    ("deep2.json", '{"x": ' + '{"a": ' * 64 + "1" + "}" * 64 + "}"),  # 65 levels: parses, refused after
    ("cycle.yaml", "x: &a [*a]\n"),
])
def test_a_config_nested_too_deeply_is_one_line(tmp_path, capsys, name, text):
    """A RecursionError traceback (exit 1) before. The gateway's 512 levels for a body would be
    past the parsers' own depth (PyYAML's recursion fails near 450): a config nests at most 4."""
    cfg = tmp_path / name
    cfg.write_text(text)
    why = "nested too deeply: lists and mappings (JSON arrays and objects) may nest at most 64 levels deep"
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(cfg)
    assert str(ex.value) == f"{cfg}: {why}"
    err = usage_error(capsys, main, ["serve", "--config", str(cfg)])
    assert err.splitlines()[-1] == f"pdd serve: error: --config {cfg}: {why}"


def test_a_yaml_block_nesting_past_the_parser_s_depth_is_one_line(tmp_path):
    """Block style nests by indentation, not brackets: the parser's RecursionError is caught."""
    cfg = tmp_path / "deep.yaml"
    cfg.write_text("x:\n  " + "- " * 5000 + "1\n")
    with pytest.raises(ConfigFileError) as ex:
        ClusterConfig.load(cfg)
    assert str(ex.value) == (f"{cfg}: nested too deeply: lists and mappings (JSON arrays and objects) may nest "
                             "at most 64 levels deep")
    cfg.write_text("x:\n  " + "- " * 63 + "1\n")  # 64 levels: not refused for its depth
    with pytest.raises(Exception) as ex:
        ClusterConfig.load(cfg)
    assert "nested too deeply" not in str(ex.value) and "x" in str(ex.value)
