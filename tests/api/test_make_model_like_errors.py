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
     "--hidden 100: must be a multiple of 16 for llama-3.2-1b with --heads 8 "
     "(head_dim is hidden / heads and must be an even integer), or give --head-dim"),
    # named a --head-dim 25 that was never given
    ("qwen3-0.6b", ["--hidden", "100", "--heads", "8"],
     "--hidden 100: must be a multiple of 8 for qwen3-0.6b with --heads 8 "
     "(head_dim is 2 * hidden / heads and must be an even integer), or give --head-dim"),
    # said "head_dim 2 * hidden / heads = 3.5": a number the user never gave
    ("qwen3-0.6b", ["--hidden", "7"],
     "--hidden 7: must be a multiple of 4 for qwen3-0.6b with --heads 4 "
     "(head_dim is 2 * hidden / heads and must be an even integer), or give --head-dim"),
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
             "--hidden 100: must be a multiple of 16 for llama-3.2-1b with --heads 8 "
             "(head_dim is hidden / heads and must be an even integer), or give --head-dim")
    assert [p.name for p in out.iterdir()] == ["keep.txt"]


def test_an_explicit_head_dim_takes_a_hidden_the_heads_do_not_divide(capsys, tmp_path):
    out = tmp_path / "q3"
    assert main(["make-model", "--like", "qwen3-0.6b", "--out", str(out), "--layers", "1",
                 "--hidden", "100", "--heads", "8", "--head-dim", "16", "--vocab", "300"]) == 0
    import json

    cfg = json.loads((out / "config.json").read_text())
    assert (cfg["hidden_size"], cfg["num_attention_heads"], cfg["head_dim"]) == (100, 8, 16)


# --- weights that cannot fit, and partial checkpoints (new-user pass, 2026-12-07) ---

def test_weights_larger_than_memory_are_refused_before_anything_is_written(capsys, tmp_path, monkeypatch):
    # was: RuntimeError "DefaultCPUAllocator: can't allocate memory: you tried to allocate 420000000000
    # bytes", exit 1, with config.json + tokenizer.json left in --out
    import pdd.modelgen as mg

    monkeypatch.setattr(mg, "available_memory_bytes", lambda: 8_000_000_000)
    out = tmp_path / "big"
    err = usage_error(capsys, main, ["make-model", "--like", "qwen3-0.6b", "--out", str(out), "--hidden", "100000000"])
    n = mg.weight_bytes(mg.like_shape("qwen3-0.6b", hidden=100000000), "qwen3", tied=True)
    assert err.endswith(f"pdd make-model: error: --hidden 100000000: the weights would take {n:,} bytes "
                        f"(float32) and writing them about twice that, over the 8,000,000,000 bytes of "
                        f"memory available (MemAvailable, /proc/meminfo); give smaller --layers / --hidden / "
                        f"--intermediate / --vocab\n"), err
    assert not out.exists()


def test_a_given_head_dim_is_among_the_flags_to_shrink(capsys, tmp_path, monkeypatch):
    import pdd.modelgen as mg

    monkeypatch.setattr(mg, "available_memory_bytes", lambda: 1_000_000)
    err = usage_error(capsys, main, ["make-model", "--like", "qwen3-0.6b", "--out", str(tmp_path / "m"),
                                     "--head-dim", "100000000"])
    assert err.endswith("; give smaller --layers / --hidden / --intermediate / --vocab / --head-dim\n"), err


def test_layers_have_the_same_bound(capsys, tmp_path, monkeypatch):
    import pdd.modelgen as mg

    monkeypatch.setattr(mg, "available_memory_bytes", lambda: 1_000_000)
    out = tmp_path / "deep"
    err = usage_error(capsys, main, ["make-model", "--like", "llama-3.2-1b", "--out", str(out), "--layers", "100000"])
    assert "pdd make-model: error: --layers 100000: the weights would take " in err, err
    assert "over the 1,000,000 bytes of memory available" in err, err
    assert not out.exists()


def test_weight_bytes_is_the_size_of_the_tensors_written(tmp_path):
    import json

    from safetensors import safe_open

    import pdd.modelgen as mg

    for like in ("qwen3-0.6b", "llama-3.2-1b", "qwen2.5-0.5b"):
        out = tmp_path / like
        assert main(["make-model", "--like", like, "--out", str(out), "--layers", "1", "--hidden", "64",
                     "--vocab", "300"]) == 0
        cfg = json.loads((out / "config.json").read_text())
        with safe_open(str(out / "model.safetensors"), "pt") as f:
            total = sum(f.get_tensor(k).numel() * 4 for k in f.keys())
        assert mg.weight_bytes(mg.config_shape(cfg), cfg["model_type"], tied=bool(cfg.get("tie_word_embeddings"))) \
            == total, like


def test_a_write_failing_midway_leaves_no_partial_checkpoint(capsys, tmp_path, monkeypatch):
    import pdd.modelgen as mg

    def full(*a, **k):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(mg, "save_file", full)
    out = tmp_path / "m"
    assert main(["make-model", "--like", "qwen3-0.6b", "--out", str(out), "--layers", "1", "--vocab", "300"]) == 1
    err = capsys.readouterr().err
    assert "Traceback" not in err
    assert err.endswith(f"pdd make-model: error: --out {out}: writing the checkpoint failed: "
                        "No space left on device; the files this run wrote were removed\n"), err
    assert not out.exists()
    mine = tmp_path / "mine"
    mine.mkdir()
    (mine / "keep.txt").write_text("x")
    assert main(["make-model", "--like", "qwen3-0.6b", "--out", str(mine), "--layers", "1", "--vocab", "300"]) == 1
    assert [p.name for p in mine.iterdir()] == ["keep.txt"]
    assert main(["make-model", "--preset", "tiny", "--out", str(out)]) == 1
    assert not out.exists()
