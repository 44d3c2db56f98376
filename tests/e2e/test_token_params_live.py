"""allowed_token_ids, bad_words and return_token_ids through the official openai client on the
tiny model: greedy output equals the single-engine oracle's under the same mask on every
pipeline, and in pdd mode across the RLD -> MD handoff (MD samples with the ids RLD handed over)."""

from __future__ import annotations

import functools
import random

import pytest

from pdd.gateway.openai_schemas import bad_words_token_ids
from tests.e2e.conftest import greedy_oracle, handoff_topology, make_cfg

pytestmark = pytest.mark.slow

K = 8  # handoff_min_tokens: RLD samples outputs 0..K-1, MD from K on (once MD's KV is there)
MAX_TOKENS = 32
FAST_WAN = {"wan_gbps": 5.0, "wan_rtt_ms": 1.0, "wan_jitter_ms": 0.0}


def _prompt(seed: int, n: int = 48) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 1000) for _ in range(n)]


@pytest.fixture(scope="module")
def pdd_topo(tiny_model, tmp_path_factory):
    with handoff_topology(tiny_model, tmp_path_factory.mktemp("logs"), K) as topo:
        yield topo


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


W = 4  # handoff positions K .. K+W-1 each have a bad word straddling them (the handoff's exact
# position depends on when RLD's reply to the gateway's handoff call lands: K or a step or two later)


def _encoder(tiny_model: str):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    return lambda t: tok.encode(t, add_special_tokens=False).ids


def _word_chain(tiny_model, prompt) -> tuple[list[str], list[list[int]]] | None:
    """Two-token bad words w_0 .. w_{W-1} for ``prompt``, each straddling its own position: under
    the ban of w_0 .. w_j the greedy output is the one under w_0 .. w_{j-1} up to output K+j-1,
    whose last two tokens (K+j-1, K+j) are w_j, then differs at K+j (masked there). So whichever
    of K .. K+W-1 the handoff lands on (MD's first sampled output), RLD sampled the first token of
    the word ending there and MD had to mask its last one. Returns (words, the final oracle
    output), or None when a step's pair is no usable word (vLLM's rule: tokenising its text gives
    the pair back; it bans nothing earlier)."""
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_model}/tokenizer.json")
    encode = _encoder(tiny_model)
    (cur,), _ = greedy_oracle(tiny_model, [prompt], MAX_TOKENS)
    words: list[str] = []
    for j in range(W):
        pos = K + j
        pair = cur[pos - 1:pos + 1]
        word = tok.decode(pair)
        if not word.strip() or pair not in bad_words_token_ids([word], encode, 1024):
            return None
        (nxt,), _ = greedy_oracle(tiny_model, [prompt], MAX_TOKENS,
                                  bad_words_token_ids=bad_words_token_ids(words + [word], encode, 1024))
        if nxt[:pos] != cur[:pos] or nxt[pos] == cur[pos]:
            return None
        words.append(word)
        cur = nxt
    return words, cur


@functools.lru_cache(maxsize=None)
def _chains(tiny_model: str) -> tuple:
    """(prompt, words, oracle output under their ban) for the first two of seeds 0..23 whose
    prompt has a :func:`_word_chain`."""
    cases = []
    for seed in range(24):
        chain = _word_chain(tiny_model, _prompt(seed))
        if chain is not None:
            cases.append((_prompt(seed), *chain))
        if len(cases) == 2:
            break
    return tuple(cases)


def test_multi_token_bad_word_is_never_produced_across_the_handoff(pdd_topo, tiny_model):
    cases = _chains(tiny_model)
    assert len(cases) == 2
    for prompt, words, want in cases:
        r = _client(pdd_topo).completions.create(
            model=pdd_topo.cfg.served_model_name, prompt=prompt, max_tokens=MAX_TOKENS, temperature=0,
            extra_body={"ignore_eos": True, "bad_words": words, "return_token_ids": True})
        ((got, s),) = _choices(r)
        assert got == want, (words, s)
        h = s["handoff_pos"]
        # RLD sampled outputs < h, MD outputs >= h: the word ending at h began on RLD, MD masked its end
        assert h is not None and K <= h < K + W, s


@pytest.mark.parametrize("mode", ["colocated", "same_dc_pd", "cross_dc_pd"])
def test_every_pipeline_honours_the_three(mode, tiny_model, topology_factory):
    topo = topology_factory(make_cfg(tiny_model, mode, link=FAST_WAN))
    prompt, words, _ = _chains(tiny_model)[0]
    word = words[0]
    ids = bad_words_token_ids([word], _encoder(tiny_model), 1024)
    (free,), _ = greedy_oracle(tiny_model, [prompt], MAX_TOKENS)
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


def test_masks_leaving_no_allowed_id_across_the_handoff(pdd_topo):
    """What the request alone makes impossible is a 400 naming the field; what the outputs make
    so (``"!!"`` is ``[6, 6]``: after a 6, the only allowed id is banned) is served from the
    allowed ids on RLD and MD alike, greedy and sampled: never id 0 or a NaN draw."""
    import openai

    c = _client(pdd_topo)
    name = pdd_topo.cfg.served_model_name
    for extra, param in (({"allowed_token_ids": [1], "min_tokens": 5}, "min_tokens"),
                         ({"allowed_token_ids": [77], "stop_token_ids": [77], "min_tokens": 5}, "min_tokens"),
                         ({"allowed_token_ids": [1], "bad_words": ["</s>"]}, "bad_words")):
        with pytest.raises(openai.BadRequestError) as ei:
            c.completions.create(model=name, prompt="hello world", max_tokens=8, temperature=0,
                                 extra_body={"return_token_ids": True, **extra})
        assert ei.value.body["param"] == param, ei.value.body
    for temperature in (0, 1):
        r = c.completions.create(model=name, prompt=_prompt(3), max_tokens=MAX_TOKENS, temperature=temperature,
                                 seed=7, extra_body={"ignore_eos": True, "allowed_token_ids": [6],
                                                     "bad_words": ["!!"], "return_token_ids": True})
        ((got, s),) = _choices(r)
        assert got == [6] * MAX_TOKENS, s
        assert s["handoff_pos"] is not None, s
