"""``pdd make-model --family`` checkpoints (Qwen2 with q/k/v biases and tied embeddings, Qwen3
with q/k norms) load in transformers and our engine alike: greedy tokens equal, logprobs agree,
and seeded sampling with penalties picks the same tokens from transformers' logits."""

from __future__ import annotations

import json

import pytest
import torch

from pdd.cli import main as cli_main
from pdd.engine import Engine
from pdd.engine.sampler import decision_margin, sample_row
from pdd.types import SamplingParams

transformers = pytest.importorskip("transformers")
torch.set_num_threads(1)

LP_TOL = 1e-4
PROB_TOL = 1e-4


@pytest.mark.parametrize("family,tied", [("qwen2", True), ("qwen2", False), ("qwen3", True)])
def test_make_model_family_matches_transformers(tmp_path, family, tied):
    out = str(tmp_path / family)
    argv = ["make-model", "--out", out, "--preset", "tiny", "--seed", "4", "--family", family]
    assert cli_main(argv + (["--tie-embeddings"] if tied else [])) == 0
    cfg = json.load(open(f"{out}/config.json"))
    assert cfg["model_type"] == family and cfg["tie_word_embeddings"] is tied
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    if tied:
        assert hf.lm_head.weight.data_ptr() == hf.model.embed_tokens.weight.data_ptr()
    eng = Engine.from_pretrained(out, num_pages=64, page_size=8)
    prompt = eng.tokenizer.encode("Hello, how are you today? The moon and the river").ids
    sp = SamplingParams(max_tokens=12, ignore_eos=True, temperature=0.9, top_p=0.95, top_k=50, seed=11,
                        repetition_penalty=1.2, presence_penalty=0.3, logprobs=2)
    seq = eng.new_sequence("s", prompt, sp, use_cache=False)
    eng.add(seq)
    events = []
    while eng.has_work():
        events += eng.step()
    ours = [e.token_id for e in events]
    ids = list(prompt)
    for pos, ev in enumerate(events):
        with torch.no_grad():
            row = hf(torch.tensor([ids])).logits[0, -1].float()
        tok, lp = sample_row(row, sp, pos, ids, len(prompt))
        assert abs(lp["lp"] - ev.logprobs["lp"]) < LP_TOL
        if tok != ev.token_id:
            kind, m = decision_margin(row, sp, pos, ids, len(prompt))
            assert m < PROB_TOL, f"position {pos}: {tok} != {ev.token_id}, margin {m}"
            break
        ids.append(tok)
    # greedy: the same tokens as transformers' generate
    g_out = eng.generate([prompt], SamplingParams(max_tokens=10, ignore_eos=True))[0]
    with torch.no_grad():
        g = hf.generate(torch.tensor([prompt]), max_new_tokens=10, min_new_tokens=10, do_sample=False, pad_token_id=1)
    assert g_out == g[0, len(prompt):].tolist()
    assert len(ours) == 12


@pytest.mark.parametrize("like", ["llama-3.2-1b", "qwen3-0.6b"])
def test_chat_on_a_like_checkpoint_equals_transformers(tmp_path, like):
    """/v1/chat/completions on a ``make-model --like`` checkpoint (llama3 rope scaling past the
    original context, or qwen3 q/k norms): the family's chat template, greedy tokens as
    transformers' generate on apply_chat_template's ids."""
    from fastapi.testclient import TestClient
    from tokenizers import Tokenizer

    from pdd.config import ClusterConfig
    from pdd.gateway.api import create_app
    from pdd.modelgen import make_like

    from .conftest import EngineOrch

    path = make_like(str(tmp_path / like), like, seed=2, original_max_positions=16 if like.startswith("llama") else None)
    conv = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "What is the weather like?"}]
    hf_tok = transformers.AutoTokenizer.from_pretrained(path)
    ids = hf_tok.apply_chat_template(conv, tokenize=True, add_generation_prompt=True)
    ids = ids["input_ids"] if not isinstance(ids, list) else ids
    assert len(ids) > 16
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    with torch.no_grad():
        g = hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8, do_sample=False, pad_token_id=0)
    want = g[0, len(ids):].tolist()
    eng = Engine.from_pretrained(path, num_pages=64, page_size=8)
    cfg = ClusterConfig.model_validate({"model_path": path, "served_model_name": like})
    orch = EngineOrch(eng)
    app = create_app(cfg, orch, Tokenizer.from_file(f"{path}/tokenizer.json"))
    with TestClient(app) as client:
        r = client.post("/v1/chat/completions", json={"model": like, "messages": conv, "max_tokens": 8,
                                                       "temperature": 0, "ignore_eos": True})
    assert r.status_code == 200, r.text
    body = r.json()
    assert orch.started[0][0] == ids  # the family's template, tokenized as transformers does
    assert body["usage"]["completion_tokens"] == 8
    assert body["choices"][0]["message"]["content"] == eng.tokenizer.decode(want)
