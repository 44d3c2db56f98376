"""A checkpoint the engine or the gateway cannot load is refused before anything starts, in one
line naming the file and field (``pdd.engine.checkpoint``): ``pdd launch`` was a traceback in each
case below, ``pdd serve`` found them only as its instances died, and a config.json claiming
100,000 layers over a 2-layer file ran until killed."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from pdd.engine.checkpoint import checkpoint_problem


def _copy(tiny_model, tmp_path) -> Path:
    d = tmp_path / "ckpt"
    shutil.copytree(tiny_model, d)
    return d


def _edit_config(d: Path, **kv) -> None:
    c = json.loads((d / "config.json").read_text())
    for k, v in kv.items():
        if v is ...:
            c.pop(k)
        else:
            c[k] = v
    (d / "config.json").write_text(json.dumps(c))


def _weights(d: Path) -> Path:
    return next(d.glob("*.safetensors"))


def test_a_good_checkpoint_passes(tiny_model):
    assert checkpoint_problem(tiny_model) is None


@pytest.mark.parametrize("how,message", [
    ("truncated", "model.safetensors: not a readable safetensors file (Error while deserializing header: "
                  "incomplete metadata, file not fully covered)"),
    ("empty", "model.safetensors: not a readable safetensors file (Error while deserializing header: header too small)"),
    ("garbage", "model.safetensors: not a readable safetensors file (Error while deserializing header: header too large)"),
    ("no weights", "no *.safetensors weights file"),
    ("no tokenizer", "tokenizer.json missing (the gateway tokenizes with it; pdd make-model writes one)"),
    ("config not json", "config.json: not valid JSON: Expecting value: line 1 column 1 (char 0)"),
])
def test_a_damaged_file_is_named(tiny_model, tmp_path, how, message):
    d = _copy(tiny_model, tmp_path)
    w = _weights(d)
    size = w.stat().st_size
    if how == "truncated":
        w.write_bytes(w.read_bytes()[:size // 2])
    elif how == "empty":
        w.write_bytes(b"")
    elif how == "garbage":
        w.write_bytes(b"\xff" * size)
    elif how == "no weights":
        w.unlink()
    elif how == "no tokenizer":
        (d / "tokenizer.json").unlink()
    else:
        (d / "config.json").write_text("not json")
    assert checkpoint_problem(str(d)) == message


@pytest.mark.parametrize("edit,message", [
    ({"num_attention_heads": "four"}, "config.json num_attention_heads: expected a positive integer, got 'four'"),
    ({"hidden_size": -8}, "config.json hidden_size: expected a positive integer, got -8"),
    ({"num_hidden_layers": 0}, "config.json num_hidden_layers: expected a positive integer, got 0"),
    ({"vocab_size": 1024.5}, "config.json vocab_size: expected a positive integer, got 1024.5"),
    ({"head_dim": True}, "config.json head_dim: expected a positive integer, got True"),
    ({"num_key_value_heads": 3}, "config.json num_key_value_heads: 3 does not divide num_attention_heads 4"),
    ({"num_hidden_layers": ...}, "config.json num_hidden_layers: missing"),
    ({"num_hidden_layers": 100000}, "config.json num_hidden_layers: 100000, but the weights hold 2 layer(s)"),
    ({"hidden_size": 128, "head_dim": 16},
     "config.json vocab_size / hidden_size: 1024 / 128, but model.embed_tokens.weight is 1024 x 64"),
])
def test_a_config_that_disagrees_is_named(tiny_model, tmp_path, edit, message):
    d = _copy(tiny_model, tmp_path)
    _edit_config(d, **edit)
    assert checkpoint_problem(str(d)) == message


def test_pdd_launch_refuses_a_damaged_checkpoint_in_one_line(tiny_model, tmp_path, capsys):
    from pdd.cli import main
    from pdd.topology import free_port_block

    d = _copy(tiny_model, tmp_path)
    (d / "tokenizer.json").unlink()
    cfg = tmp_path / "c.yaml"
    base = free_port_block(101)  # launch checks its ports first: a block no other run holds
    cfg.write_text(f"mode: pdd\nmodel_path: {d}\nsecurity: {{tls: false, fast_path: plain}}\n"
                   f"gateway_port: {base + 100}\nbase_port: {base}\n")
    with pytest.raises(SystemExit) as e:
        main(["launch", "--role", "gateway", "--config", str(cfg)])
    assert e.value.code == 2  # bad input, as every refused config field
    assert capsys.readouterr().err == (f"pdd launch: error: model_path {d}: tokenizer.json missing (the gateway "
                                       "tokenizes with it; pdd make-model writes one)\n")
