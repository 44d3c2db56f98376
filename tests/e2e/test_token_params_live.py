"""allowed_token_ids, bad_words and return_token_ids through the official openai client on the
tiny model: greedy output equals the single-engine oracle's under the same mask on every
pipeline, and in pdd mode across the RLD -> MD handoff (MD samples with the ids RLD handed over)."""

from __future__ import annotations

import random

import pytest

from pdd.gateway.openai_schemas import bad_words_token_ids
from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

K = 8  # handoff_min_tokens: RLD samples outputs 0..K-1, MD from K on (once MD's KV is there)
MAX_TOKENS = 32
FAST_WAN = {"wan_gbps": 5.0, "wan_rtt_ms": 1.0, "wan_jitter_ms": 0.0}


def _prompt(seed: int, n: int = 48) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def pdd_topo(tiny_model, tmp_path_factory):
    from pdd.launch import Topology

    # a fast WAN so MD's KV is there early and the handoff point is set by handoff_min_tokens;
    # RLD's step held to >= 20 ms, so its K tokens take far longer than MD's KV needs
    cfg = make_cfg(tiny_model, "pdd", link=FAST_WAN, policy={"handoff_min_tokens": K},
                   tiers={"relay_decode": {"engine": {"min_step_ms": 20.0}}})
    topo = Topology(cfg, log_dir=tmp_path_factory.mktemp("logs"))
    topo.start()
    yield topo
    topo.stop()


def _client(topo):
    from openai import OpenAI

    return OpenAI(base_url=topo.url + "/v1", api_key="none")


def _choices(resp) -> list[tuple[list[int], dict]]:
    """Each choice's ``token_ids`` and its pdd summary (handoff_pos, ...)."""
    ext = resp.model_extra["pdd"]
    per = ext.get("choices", [ext])
    return [(c.model_extra["token_ids"], s) for c, s in zip(resp.choices, per)]


def test_allowed_token_ids_greedy_equals_the_oracle_across_the_handoff(pdd_topo, tiny_model):
    prompt = _prompt(1)
    (free,), _ = greedy_oracle(tiny_model, [prompt], MAX_TOKENS)
    allowed = sorted(set(free[1::3]))[:5] + [300, 301]
    (want,), _ = greedy_oracle(tiny_model, [prompt], MAX_TOKENS, allowed_token_ids=allowed)
    assert want != free and set(want) <= set(allowed)
    r = _client(pdd_topo).completions.create(
        model=pdd_topo.cfg.served_model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, n=2,
        extra_body={"ignore_eos": True, "allowed_token_ids": allowed, "return_token_ids": True})
    got = _choices(r)
    assert [ids for ids, _ in got] == [want, want]
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == [prompt, prompt]
    assert all(s["handoff_pos"] is not None and s["handoff_pos"] >= K for _, s in got), [s for _, s in got]


def _straddling_words(tiny_model, seeds) -> list[tuple[list[int], str, list[list[int]], list[int]]]:
    """(prompt, word, its banned id sequences, the oracle's unmasked output) for each prompt whose
    greedy output has, at outputs K-1 and K, a pair of tokens that tokenising their text gives
    back (vLLM's rule) and that does not occur earlier: a two-token bad word whose first token RLD
    samples and whose last one MD must mask."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    prompts = [_prompt(s) for s in seeds]
    outs, _ = greedy_oracle(tiny_model, prompts, MAX_TOKENS)
    found = []
    for p, o in zip(prompts, outs):
        pair = o[K - 1:K + 1]
        word = tok.decode(pair)
        if not word.strip():  # refused (it would tokenise to nothing)
            continue
        ids = bad_words_token_ids([word], lambda t: tok.encode(t, add_special_tokens=False).ids, 1024)
        if pair in ids and all(o[i:i + 2] != pair for i in range(K - 1)):
            found.append((p, word, ids, o))
    return found


def test_multi_token_bad_word_is_never_produced_across_the_handoff(pdd_topo, tiny_model):
    cases = _straddling_words(tiny_model, range(12))[:3]
    assert len(cases) == 3
    straddled = 0
    for prompt, word, ids, free in cases:
        (want,), _ = greedy_oracle(tiny_model, [prompt], MAX_TOKENS, bad_words_token_ids=ids)
        assert want[:K] == free[:K] and want[K] != free[K]  # masked where the word would end
        r = _client(pdd_topo).completions.create(
            model=pdd_topo.cfg.served_model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "bad_words": [word], "return_token_ids": True})
        ((got, s),) = _choices(r)
        assert got == want, (word, s)
        assert all(got[i:i + 2] != free[K - 1:K + 1] for i in range(MAX_TOKENS - 1))
        assert s["handoff_pos"] is not None and s["handoff_pos"] >= K, s
        straddled += s["handoff_pos"] == K  # RLD sampled the word's first token, MD masked its last
    assert straddled >= 1


@pytest.mark.parametrize("mode", ["colocated", "same_dc_pd", "cross_dc_pd"])
def test_every_pipeline_honours_the_three(mode, tiny_model, topology_factory):
    topo = topology_factory(make_cfg(tiny_model, mode, link=FAST_WAN))
    prompt, word, ids, free = _straddling_words(tiny_model, range(12))[0]
    allowed = sorted(set(free)) + [300]
    (want,), _ = greedy_oracle(tiny_model, [prompt], MAX_TOKENS, allowed_token_ids=allowed,
                               bad_words_token_ids=ids)
    assert want != free
    r = _client(topo).completions.create(
        model=topo.cfg.served_model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, n=2,
        extra_body={"ignore_eos": True, "allowed_token_ids": allowed, "bad_words": [word],
                    "return_token_ids": True})
    assert [ids_ for ids_, _ in _choices(r)] == [want, want]
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == [prompt, prompt]
