"""The files a user names to ``pdd bench`` and ``pdd sim`` / ``pdd plan`` (``--trace``,
``--profile``, ``--op-profile``, a ``--live-from`` run's files) are read only when they are
regular files, and at most a cap of bytes: ``/dev/zero`` as a trace was "no such file" (it
exists), as a profile it was read until memory ran out, and a FIFO hung. One line naming the
flag and the file, exit 2."""

import json
import os
from pathlib import Path

import pytest

from pdd.cli import main
from pdd.files import InputFileError, read_text
from tests.cli_usage import usage_error

NOT_REGULAR = "not a regular file (a device, FIFO or socket)"
TRACE = "give a Mooncake-format JSONL trace"


@pytest.fixture
def fifo(tmp_path):
    p = tmp_path / "fifo"
    os.mkfifo(p)
    return str(p)


def _last(capsys, argv) -> str:
    return usage_error(capsys, main, argv).splitlines()[-1]


@pytest.mark.parametrize("path", ["/dev/zero", "FIFO"])
def test_bench_names_a_trace_that_is_no_regular_file(capsys, tmp_path, fifo, path):
    path = fifo if path == "FIFO" else path
    assert _last(capsys, ["bench", "--trace", path, "--out", str(tmp_path / "o")]) == (
        f"pdd bench: error: --trace: {path}: {NOT_REGULAR}; {TRACE}")


def test_bench_still_says_no_such_file_for_a_missing_trace(capsys, tmp_path):
    assert _last(capsys, ["bench", "--trace", str(tmp_path / "nope.jsonl"), "--out", str(tmp_path / "o")]) == (
        f"pdd bench: error: --trace: no such file: {tmp_path / 'nope.jsonl'}")


def test_a_trace_above_the_size_cap_is_named(capsys, tmp_path, monkeypatch):
    import pdd.workload.records as records

    monkeypatch.setattr(records, "MAX_TRACE_BYTES", 100)
    t = tmp_path / "t.jsonl"
    t.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}) + "\n" * 100)
    assert _last(capsys, ["bench", "--trace", str(t), "--out", str(tmp_path / "o")]) == (
        f"pdd bench: error: --trace: {t}: larger than the cap of 100 bytes ({t.stat().st_size} bytes); {TRACE}")


def test_a_trace_line_above_the_line_cap_names_its_line(capsys, tmp_path, monkeypatch):
    """A regular file without newlines (a zero-filled image) was one line read whole."""
    import pdd.workload.records as records

    monkeypatch.setattr(records, "MAX_TRACE_LINE_CHARS", 1000)
    t = tmp_path / "t.jsonl"
    t.write_text(json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [1]}) + "\n"
                 + "\0" * 5000)
    assert _last(capsys, ["sim", "run", "--trace", str(t)]) == (
        f"pdd sim run: error: --trace: {t}, line 2: longer than 1,000 characters; not a trace record")


@pytest.mark.parametrize("path", ["/dev/zero", "FIFO"])
def test_sim_run_names_a_trace_that_is_no_regular_file(capsys, fifo, path):
    path = fifo if path == "FIFO" else path
    assert _last(capsys, ["sim", "run", "--trace", path]) == (
        f"pdd sim run: error: argument --trace: {path}: {NOT_REGULAR}")


@pytest.mark.parametrize("flag", ["--profile", "--profile-a"])
def test_sim_run_names_a_profile_that_is_no_regular_file(capsys, fifo, flag):
    """``--profile /dev/zero`` was read until memory ran out."""
    for path in ("/dev/zero", fifo):
        assert _last(capsys, ["sim", "run", "--agentic", "3", flag, path]) == (
            f"pdd sim run: error: {flag} {path}: {NOT_REGULAR}; give a JSON profile (pdd profile) or a roofline "
            "calibration file")


def test_compare_profiles_names_an_op_profile_that_is_no_regular_file(capsys):
    assert _last(capsys, ["sim", "compare-profiles", "--op-profile", "/dev/zero"]) == (
        f"pdd sim compare-profiles: error: argument --op-profile: /dev/zero: {NOT_REGULAR}")


def test_a_live_from_run_whose_file_is_no_regular_file_is_named(capsys, tmp_path):
    root = Path(__file__).resolve().parents[2]
    run = tmp_path / "run"
    run.mkdir()
    for f in (root / "data" / "validation" / "seed3").iterdir():
        (run / f.name).symlink_to(f)
    (run / "requests.jsonl").unlink()
    (run / "requests.jsonl").symlink_to("/dev/zero")
    line = _last(capsys, ["sim", "validate", "--live-from", str(run), "--out", str(tmp_path / "v")])
    assert line == (f"pdd sim validate: error: --live-from: {run / 'requests.jsonl'}: {NOT_REGULAR}; "
                    "give a `pdd sim validate --out` directory's file")


def test_read_text_caps_its_bytes(tmp_path):
    p = tmp_path / "p.json"
    p.write_text("{}" + " " * 100)
    assert read_text(p, 200) == "{}" + " " * 100
    with pytest.raises(InputFileError) as ex:
        read_text(p, 50)
    assert str(ex.value) == f"{p}: larger than the cap of 50 bytes (102 bytes); give a JSON file"
    with pytest.raises(IsADirectoryError):
        read_text(tmp_path)
    with pytest.raises(FileNotFoundError):
        read_text(tmp_path / "nope")


def test_read_bytes_caps_its_bytes_and_a_config_file_is_read_through_it(tmp_path, monkeypatch):
    """``ClusterConfig.load`` had its own copy of the regular-file check and the capped read
    (``config._read_config_text``), with its own too-large message; it reads through
    ``pdd.files.read_bytes`` now, which says the same as for every capped file."""
    import pdd.files as files
    from pdd.config import MAX_CONFIG_BYTES, ClusterConfig, ConfigFileError
    from pdd.files import read_bytes

    p = tmp_path / "c.yaml"
    p.write_bytes(b"mode: colocated\n\xff")
    assert read_bytes(p, 17) == b"mode: colocated\n\xff"  # bytes: no UTF-8 check
    with pytest.raises(InputFileError) as ex:
        read_bytes(p, 16)
    assert str(ex.value) == f"{p}: larger than the cap of 16 bytes (17 bytes); give a JSON file"
    seen, real = [], files.read_bytes
    monkeypatch.setattr(files, "read_bytes", lambda *a, **k: seen.append((a, k)) or real(*a, **k))
    p.write_text("mode: colocated\n")
    assert ClusterConfig.load(p).mode == "colocated"
    assert seen == [((p, MAX_CONFIG_BYTES), {"what": "give a YAML or JSON file"})]
    monkeypatch.setattr(files, "read_bytes", lambda *a, **k: real(p, 3, what=k["what"]))
    with pytest.raises(ConfigFileError) as ex:  # the CLIs print a ConfigFileError naming --config
        ClusterConfig.load(p)
    assert str(ex.value) == f"{p}: larger than the cap of 3 bytes (16 bytes); give a YAML or JSON file"
