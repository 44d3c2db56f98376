"""Where a vLLM (or official openai client) user's request met pdd's API differently from vLLM:
each test names the behaviour vLLM has and pdd now matches (in-process engine, fast)."""

from __future__ import annotations


def _tok(tiny_model):
    from tokenizers import Tokenizer

    return Tokenizer.from_file(f"{tiny_model}/tokenizer.json")


def test_completion_text_prompt_gets_special_tokens_as_on_vllm(api, tiny_model):
    """vLLM's /v1/completions defaults to add_special_tokens=True: a Llama-style tokenizer puts BOS
    before a text prompt. pdd left it out, so the same prompt was other token ids (and another
    output, and prompt_tokens one lower) than on vLLM."""
    client, orch = api
    tok = _tok(tiny_model)
    with_bos = tok.encode("Hello there", add_special_tokens=True).ids
    assert with_bos != tok.encode("Hello there", add_special_tokens=False).ids  # the checkpoint adds BOS
    r = client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 1})
    assert r.status_code == 200 and orch.started[-1][0] == with_bos
    assert r.json()["usage"]["prompt_tokens"] == len(with_bos)
    client.post("/v1/completions", json={"prompt": "Hello there", "max_tokens": 1, "add_special_tokens": False})
    assert orch.started[-1][0] == tok.encode("Hello there", add_special_tokens=False).ids
    client.post("/v1/completions", json={"prompt": [5, 6, 7], "max_tokens": 1})  # token ids: as given
    assert orch.started[-1][0] == [5, 6, 7]
    # chat: the template writes the special tokens, nothing is added (vLLM's chat default)
    client.post("/v1/chat/completions", json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 1})
    assert orch.started[-1][0] == tok.encode("<|user|>\nHi</s>\n<|assistant|>\n", add_special_tokens=False).ids
