"""Other architectures of the family (qwen2 biases, qwen3 q/k norms) and the demo preset,
greedy-equal to transformers."""

from __future__ import annotations

import pytest
import torch

from pdd.engine import Engine, ModelConfig
from pdd.modelgen import make_model
from pdd.types import SamplingParams


@pytest.mark.parametrize("family,preset", [("qwen2", "tiny"), ("qwen3", "tiny"), ("llama", "small")])
def test_family_greedy_equals_transformers(tmp_path, device, family, preset):
    transformers = pytest.importorskip("transformers")
    path = make_model(str(tmp_path / family), preset=preset, seed=3, family=family)
    cfg = ModelConfig.from_pretrained(path)
    assert cfg.model_type == family and cfg.qkv_bias == (family == "qwen2") and cfg.qk_norm == (family == "qwen3")
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    eng = Engine.from_pretrained(path, num_pages=64, page_size=8, device=device)
    prompts = [eng.tokenizer.encode(t).ids for t in ("Hello, how are you today?", "def main(): return 0")]
    outs = eng.generate(prompts, SamplingParams(max_tokens=16, ignore_eos=True))
    for p, o in zip(prompts, outs):
        with torch.no_grad():
            g = hf.generate(torch.tensor([p]), max_new_tokens=16, min_new_tokens=16, do_sample=False, pad_token_id=1)
        assert o == g[0, len(p):].tolist()


def test_unsupported_model_type_is_refused():
    with pytest.raises(NotImplementedError):
        ModelConfig.from_dict({"model_type": "mixtral", "num_attention_heads": 2, "hidden_size": 8,
                               "vocab_size": 8, "intermediate_size": 8, "num_hidden_layers": 1})
