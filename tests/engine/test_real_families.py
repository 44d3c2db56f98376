"""Real model families (``pdd make-model --like``): random-weight checkpoints built from the
published config.json of Llama-3.2-1B, Llama-3.1-8B, Qwen2.5-0.5B, Qwen3-0.6B and Mistral-7B
(sizes scaled down, family features kept), compared with transformers on CPU in fp32:
prefill logits, decode logits over paged KV (page size below the sequence length) and greedy
tokens; prompts longer than the original rope context (or the sliding window) so that the
scaling (or the window) changes the result. Bad configs are refused naming the field."""

from __future__ import annotations

import json
import os

import pytest
import torch

from pdd.cli import main as cli_main
from pdd.engine import Engine, ModelConfig
from pdd.engine.config import UnsupportedModelConfig
from pdd.engine.kv_pool import KVPool
from pdd.engine.model import load_model
from pdd.engine.runner import RunItem
from pdd.modelgen import make_like
from pdd.types import SamplingParams

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

ATOL = 2e-4  # fp32: the engine and transformers run the same float32 ops (measured diffs below)
PAGE = 4
DECODE_STEPS = 6
ORIG = 16  # original rope context of the scaled configs; the prompt is longer
PROMPT = ("The prefill stage reads the whole prompt at once and is bound by compute, while the decode "
          "stage produces one token at a time.")

# id -> (like, make_like kwargs, what differs when the feature is removed from the config)
CASES = {
    "llama-3.2-1b/llama3": ("llama-3.2-1b", dict(original_max_positions=ORIG), "rope_scaling"),
    "llama-3.1-8b/llama3": ("llama-3.1-8b", dict(original_max_positions=ORIG), "rope_scaling"),
    "llama2-style/linear": ("llama-3.1-8b", dict(rope_scaling={"type": "linear", "factor": 2.0}), "rope_scaling"),
    "llama2-style/dynamic": ("llama-3.1-8b", dict(rope_scaling={"type": "dynamic", "factor": 2.0},
                                                  max_positions=ORIG), "rope_scaling"),
    "qwen2.5-0.5b": ("qwen2.5-0.5b", {}, None),
    "qwen2.5-0.5b/yarn": ("qwen2.5-0.5b", dict(rope_scaling={"type": "yarn", "factor": 4.0,
                                                             "original_max_position_embeddings": ORIG},
                                               max_positions=4 * ORIG), "rope_scaling"),
    "qwen3-0.6b": ("qwen3-0.6b", {}, None),
    "mistral-7b/window": ("mistral-7b", dict(sliding_window=8), "sliding_window"),
}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("families")
    return {cid: make_like(str(root / cid.replace("/", "_")), like, seed=5, **kw)
            for cid, (like, kw, _) in CASES.items()}


def _hf(path):
    return transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


@pytest.mark.parametrize("cid", list(CASES))
def test_prefill_decode_greedy_equal_transformers(ckpts, cid):
    path = ckpts[cid]
    hf = _hf(path)
    eng = Engine.from_pretrained(path, num_pages=64, page_size=PAGE, prefill_chunk_tokens=4096)
    prompt = eng.tokenizer.encode(PROMPT).ids
    assert len(prompt) > 2 * ORIG and len(prompt) > 4 * PAGE
    # prefill: logits at every prompt position
    seq = eng.new_sequence("s", prompt, use_cache=False)
    (ours,) = eng.runner.forward([RunItem(prompt, 0, len(prompt), seq.page_table)], all_logits=True)
    with torch.no_grad():
        ref = hf(torch.tensor([prompt])).logits[0].float()
    prefill_diff = float((ours - ref).abs().max())
    assert prefill_diff <= ATOL, prefill_diff
    # decode over the paged KV, step by step, against transformers' cached generate
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS,
                        do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    hf_tokens = g.sequences[0, len(prompt):].tolist()
    ids, decode_diff = list(prompt), 0.0
    last = ours[-1]
    for step in range(DECODE_STEPS):
        decode_diff = max(decode_diff, float((last - g.logits[step][0].float()).abs().max()))
        nxt = int(last.argmax())
        assert nxt == hf_tokens[step], f"step {step}"
        ids.append(nxt)
        seq.token_ids.append(nxt)
        eng._ensure_pages(seq, len(ids))
        (last,) = eng.runner.forward([RunItem(ids, len(ids) - 1, 1, seq.page_table)])
    assert decode_diff <= ATOL, decode_diff
    seq.num_computed = len(ids)
    eng.release(seq, cache=False)
    # the engine's own greedy loop (scheduler, sampler, prefix cache) gives the same tokens
    sp = SamplingParams(max_tokens=DECODE_STEPS, ignore_eos=True)
    (out,) = eng.generate([prompt], sp)
    assert out == hf_tokens
    if "dynamic" not in cid:  # dynamic: a chunk's K keeps its own length's rotation (docs/MODELS.md)
        # 8-token prefill chunks, batched with a shorter prompt: first over the cached prefix of
        # the run above (extends over pages), then from nothing
        short = eng.tokenizer.encode("Hello, how are you today? I am fine, thank you.").ids
        with torch.no_grad():
            g2 = hf.generate(torch.tensor([short]), max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS,
                             do_sample=False, pad_token_id=0)
        eng.sched_cfg.prefill_chunk_tokens = 8
        for flush in (False, True):
            if flush:
                eng.flush_cache()
            outs = eng.generate([prompt, short], sp)
            assert outs == [hf_tokens, g2[0, len(short):].tolist()], f"flush={flush}"
    eng.flush_cache()
    assert eng.pool.num_free == eng.pool.num_pages
    print(f"{cid}: prefill max|diff| {prefill_diff:.3g}, decode max|diff| {decode_diff:.3g}")


@pytest.mark.parametrize("cid", [c for c, (_, _, feat) in CASES.items() if feat])
def test_the_feature_changes_the_logits(ckpts, cid):
    """Without its rope scaling (or window) the same weights give other logits on this prompt:
    the comparison above checks the feature, not plain RoPE."""
    path, feature = ckpts[cid], CASES[cid][2]
    cfg = ModelConfig.from_pretrained(path)
    plain = ModelConfig.from_dict({**json.load(open(os.path.join(path, "config.json"))), feature: None})
    assert getattr(cfg, feature) and getattr(plain, feature) is None
    prompt = Engine.from_pretrained(path, num_pages=8).tokenizer.encode(PROMPT).ids
    outs = []
    for c in (cfg, plain):
        m = load_model(path, c)
        eng = Engine(m, KVPool(c, 64, PAGE))
        seq = eng.new_sequence("s", prompt, use_cache=False)
        outs.append(eng.runner.forward([RunItem(prompt, 0, len(prompt), seq.page_table)], all_logits=True)[0])
    assert float((outs[0] - outs[1]).abs().max()) > 0.1


def test_published_features_are_kept(ckpts):
    """The scaled configs keep each family's features (checked on the loaded ModelConfig)."""
    c = {cid: ModelConfig.from_pretrained(p) for cid, p in ckpts.items()}
    l32 = c["llama-3.2-1b/llama3"]
    assert l32.rope_scaling == {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": ORIG}
    assert l32.tie_word_embeddings and l32.rope_theta == 500000.0 and l32.max_position_embeddings == 131072
    assert c["llama-3.1-8b/llama3"].rope_scaling["factor"] == 8.0 and not c["llama-3.1-8b/llama3"].tie_word_embeddings
    q25 = c["qwen2.5-0.5b"]
    assert q25.qkv_bias and q25.tie_word_embeddings and q25.sliding_window is None and q25.rope_theta == 1e6
    assert c["qwen2.5-0.5b/yarn"].rope_scaling == {"rope_type": "yarn", "factor": 4.0,
                                                   "original_max_position_embeddings": ORIG}
    q3 = c["qwen3-0.6b"]
    assert q3.qk_norm and q3.tie_word_embeddings and q3.head_dim * q3.num_attention_heads == 2 * q3.hidden_size
    m = c["mistral-7b/window"]
    assert m.sliding_window == 8 and m.sliding_window_layers == [0, 1] and m.model_type == "mistral"


@pytest.mark.parametrize("cid,bos,stops", [
    ("llama-3.2-1b/llama3", "<|begin_of_text|>", ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"]),
    ("qwen2.5-0.5b", None, ["<|endoftext|>", "<|im_end|>"]),
    ("qwen3-0.6b", None, ["<|im_end|>", "<|endoftext|>"]),
    ("mistral-7b/window", "<s>", ["</s>"]),
])
def test_tokenizer_and_chat_template_match_transformers(ckpts, cid, bos, stops):
    from pdd.engine.engine import load_tokenizer
    from pdd.gateway.openai_chat import ChatTemplate

    path = ckpts[cid]
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    ours = load_tokenizer(path)
    ids = ours.encode("Hello, how are you today?").ids
    assert hf_tok("Hello, how are you today?").input_ids == ids
    assert (ids[0] == ours.token_to_id(bos)) if bos else ids[0] not in (ours.token_to_id(t) for t in stops)
    cfg = ModelConfig.from_pretrained(path)
    assert sorted(cfg.eos_token_ids) == sorted(ours.token_to_id(t) for t in stops)
    if cid.startswith("mistral"):
        conv = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"},
                {"role": "user", "content": "why?"}]
    else:
        conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"},
                {"role": "assistant", "content": "yo"}, {"role": "user", "content": "why?"}]
    text = ChatTemplate.from_model_dir(path).render(conv, add_generation_prompt=True)
    assert text == hf_tok.apply_chat_template(conv, tokenize=False, add_generation_prompt=True)
    marker = {"llama": "<|start_header_id|>assistant<|end_header_id|>\n\n", "qwen": "<|im_start|>assistant\n",
              "mistral": "[INST] why? [/INST]"}
    assert text.endswith(next(v for k, v in marker.items() if cid.startswith(k)))
    # special tokens are single ids
    for t in ("<|start_header_id|>", "<|im_start|>", "<think>"):
        if ours.token_to_id(t) is not None:
            assert ours.encode(t, add_special_tokens=False).ids == [ours.token_to_id(t)]


_BASE = {"model_type": "llama", "num_attention_heads": 2, "hidden_size": 8, "vocab_size": 8,
         "intermediate_size": 8, "num_hidden_layers": 1}


@pytest.mark.parametrize("extra,exc,field", [
    ({"rope_scaling": {"rope_type": "longrope", "factor": 2.0}}, UnsupportedModelConfig, "rope_scaling.rope_type"),
    ({"rope_scaling": {"type": "ntk-by-parts", "factor": 2.0}}, UnsupportedModelConfig, "rope_scaling.rope_type"),
    ({"rope_parameters": {"rope_type": "su", "rope_theta": 1e4}}, UnsupportedModelConfig, "rope_parameters.rope_type"),
    ({"rope_scaling": {"rope_type": "llama3", "factor": 8.0, "high_freq_factor": 4.0,
                       "original_max_position_embeddings": 8192}}, ValueError, "rope_scaling.low_freq_factor"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 0.5}},
     ValueError, "rope_scaling.original_max_position_embeddings"),
    ({"rope_scaling": {"rope_type": "linear"}}, ValueError, "rope_scaling.factor"),
    ({"rope_scaling": {"rope_type": "dynamic", "factor": 0.5}}, ValueError, "rope_scaling.factor"),
    ({"model_type": "mixtral"}, UnsupportedModelConfig, "model_type"),
    ({"num_local_experts": 8}, UnsupportedModelConfig, "num_local_experts"),
    ({"kv_lora_rank": 512}, UnsupportedModelConfig, "kv_lora_rank"),
    ({"partial_rotary_factor": 0.5}, UnsupportedModelConfig, "partial_rotary_factor"),
    ({"hidden_act": "gelu"}, UnsupportedModelConfig, "hidden_act"),
    ({"model_type": "mistral", "sliding_window": 0}, ValueError, "sliding_window"),
    ({"model_type": "qwen2", "use_sliding_window": True, "sliding_window": 8,
      "layer_types": ["chunked_attention"]}, UnsupportedModelConfig, "layer_types"),
])
def test_unsupported_or_malformed_config_is_refused_naming_the_field(extra, exc, field):
    with pytest.raises(exc, match=f"config.json {field}"):
        ModelConfig.from_dict({**_BASE, **extra})


def test_make_model_like_cli(tmp_path, capsys):
    out = str(tmp_path / "q")
    assert cli_main(["make-model", "--like", "qwen2.5-0.5b", "--out", out, "--layers", "3", "--hidden", "64",
                     "--rope-scaling", '{"rope_type": "yarn", "factor": 2.0, "original_max_position_embeddings": 32}',
                     "--max-positions", "64"]) == 0
    cfg = ModelConfig.from_pretrained(out)
    assert (cfg.num_hidden_layers, cfg.hidden_size, cfg.model_type, cfg.qkv_bias) == (3, 64, "qwen2", True)
    assert cfg.rope_scaling["rope_type"] == "yarn" and cfg.vocab_size == 1024 + 22
    with pytest.raises(SystemExit) as e:
        cli_main(["make-model", "--like", "llama-3.1-8b", "--out", str(tmp_path / "bad"),
                  "--rope-scaling", '{"rope_type": "longrope", "factor": 2.0}'])
    assert e.value.code == 2
    assert "config.json rope_scaling.rope_type='longrope' is not supported" in capsys.readouterr().err
    assert not os.path.exists(tmp_path / "bad" / "config.json")


def test_serve_refuses_an_unsupported_checkpoint(tmp_path, ckpts, capsys):
    import shutil
    from types import SimpleNamespace

    from pdd.cli import ensure_model

    path = tmp_path / "m"
    shutil.copytree(ckpts["qwen3-0.6b"], path)
    d = json.load(open(path / "config.json"))
    d["rope_scaling"] = {"rope_type": "longrope", "short_factor": [1.0], "long_factor": [1.0]}
    (path / "config.json").write_text(json.dumps(d))
    with pytest.raises(SystemExit) as ex:
        ensure_model(SimpleNamespace(model_path=str(path), model_preset="small", model_seed=0))
    assert ex.value.code == 2  # bad input (the config's model_path), as every refusal of one
    err = capsys.readouterr().err
    assert err.startswith(f"pdd serve: error: model_path {path}: ") and len(err.splitlines()) == 1, err
    assert "rope_scaling.rope_type='longrope' is not supported" in err
