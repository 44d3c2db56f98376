"""``pdd make-model --like``: a shape the family cannot take is a usage error naming the flag (exit 2),
and a refused run leaves no --out directory behind. Found by a new user."""

import pytest

from pdd.cli import main
from tests.cli_usage import usage_error


def _refused(capsys, argv, message):
    err = usage_error(capsys, main, argv)
    assert err.endswith(f"pdd make-model: error: {message}\n"), err


@pytest.mark.parametrize("like, flags, message", [
    # hidden 100 / 8 heads was silently truncated to head_dim 12
    ("llama-3.2-1b", ["--hidden", "100", "--heads", "8"],
     "--hidden 100 / --heads 8: head_dim 1 * hidden / heads = 12.5 for llama-3.2-1b, "
     "must be an even integer >= 2 (or give --head-dim)"),
    # named a --head-dim 25 that was never given
    ("qwen3-0.6b", ["--hidden", "100", "--heads", "8"],
     "--hidden 100 / --heads 8: head_dim 2 * hidden / heads = 25 for qwen3-0.6b, "
     "must be an even integer >= 2 (or give --head-dim)"),
    # --vocab 0 was read as "not given" and wrote a 1024-entry vocabulary
    ("llama-3.2-1b", ["--vocab", "0"], "--vocab 0: at least 300 entries (the 256 byte symbols and some merges)"),
    ("llama-3.2-1b", ["--rope-scaling", '{"rope_type": "bogus"}'],
     "config.json rope_scaling.rope_type='bogus' is not supported (supported: default, dynamic, linear, llama3, yarn)"),
])
def test_a_refused_shape_names_the_flag_and_writes_nothing(capsys, tmp_path, like, flags, message):
    out = tmp_path / "m"
    _refused(capsys, ["make-model", "--like", like, "--out", str(out), *flags], message)
    assert not out.exists()


def test_a_refused_shape_keeps_an_existing_out_directory(capsys, tmp_path):
    out = tmp_path / "mine"
    out.mkdir()
    (out / "keep.txt").write_text("x")
    _refused(capsys, ["make-model", "--like", "llama-3.2-1b", "--out", str(out), "--hidden", "100", "--heads", "8"],
             "--hidden 100 / --heads 8: head_dim 1 * hidden / heads = 12.5 for llama-3.2-1b, "
             "must be an even integer >= 2 (or give --head-dim)")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_an_explicit_head_dim_takes_a_hidden_the_heads_do_not_divide(capsys, tmp_path):
    out = tmp_path / "q3"
    assert main(["make-model", "--like", "qwen3-0.6b", "--out", str(out), "--layers", "1",
                 "--hidden", "100", "--heads", "8", "--head-dim", "16", "--vocab", "300"]) == 0
    import json

    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]) == (100, 8, 16)
