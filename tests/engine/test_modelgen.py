"""make_model: determinism, transformers loadability, logit margins."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pdd.engine import ModelConfig
from pdd.modelgen import make_model


def test_same_seed_is_byte_identical(tmp_path, tiny_model):
    again = make_model(str(tmp_path / "again"), preset="tiny", seed=0)
    for fn in ("model.safetensors", "tokenizer.json", "config.json", "tokenizer_config.json", "generation_config.json"):
        with open(os.path.join(tiny_model, fn), "rb") as a, open(os.path.join(again, fn), "rb") as b:
            assert a.read() == b.read(), fn
    other = make_model(str(tmp_path / "other"), preset="tiny", seed=1)
    with open(os.path.join(tiny_model, "model.safetensors"), "rb") as a, \
            open(os.path.join(other, "model.safetensors"), "rb") as b:
        assert a.read() != b.read()


def test_config_and_tokenizer(tiny_model):
    cfg = ModelConfig.from_pretrained(tiny_model)
    assert cfg.num_hidden_layers == 2 and cfg.num_key_value_heads == 2 and cfg.head_dim == 16
    assert cfg.kv_bytes_per_token("float32") == 2 * 2 * 2 * 16 * 4
    from pdd.engine.engine import load_tokenizer

    tok = load_tokenizer(tiny_model)
    assert tok.get_vocab_size() <= cfg.vocab_size
    assert tok.token_to_id("<s>") == cfg.bos_token_id and tok.token_to_id("</s>") in cfg.eos_token_ids
    enc = tok.encode("Hello, world! 123")
    assert enc.ids[0] == cfg.bos_token_id
    assert tok.decode(enc.ids) == "Hello, world! 123"


def test_transformers_loads_it(tiny_model, hf_model):
    transformers = pytest.importorskip("transformers")
    tok = transformers.AutoTokenizer.from_pretrained(tiny_model)
    from pdd.engine.engine import load_tokenizer

    ours = load_tokenizer(tiny_model)
    text = "The robot opened a book and tried to guess the words."
    assert tok(text).input_ids == ours.encode(text).ids
    assert tok.eos_token == "</s>" and tok.bos_token == "<s>"
    chat = tok.apply_chat_template([{"role": "user", "content": "hi"}], tokenize=False, add_generation_prompt=True)
    assert chat == "<|user|>\nhi</s>\n<|assistant|>\n"
    assert hf_model.config.num_hidden_layers == 2
    with open(os.path.join(tiny_model, "config.json")) as f:
        assert json.load(f)["architectures"] == ["LlamaForCausalLM"]


def test_logit_margins_are_wide(hf_model, prompts):
    """Top-1 minus top-2 logit over greedy continuations (measured: median ~3.8, 5th pct ~0.3
    on the tiny preset; fp32 batched-vs-unbatched noise is ~1e-5)."""
    margins = []
    for p in prompts:
        with torch.no_grad():
            g = hf_model.generate(torch.tensor([p]), max_new_tokens=30, min_new_tokens=30, do_sample=False, pad_token_id=1)
            lg = hf_model(g).logits[0]
        top = lg.topk(2, dim=-1).values
        margins.append(top[:, 0] - top[:, 1])
    m = torch.cat(margins)
    assert m.median() > 2.0
    assert (m < 1e-3).float().mean() < 0.01
