"""Sampling contract across the handoff: seeded sampling (temperature > 0 with top-p / top-k,
min-p and penalties) through pdd gives the same tokens as one monolithic engine, whatever the
handoff point (right after the first token, mid-stream); stop strings end the stream at
the same place; logprobs agree. fp32, 20 prompts.

Tolerances (stated):
  * ``LP_TOL``: |logprob(pdd) - logprob(single engine)| for every token and every top-5 entry.
  * A prompt whose tokens differ may be excused only as numerical, at its first differing
    position d: for sampling, the single engine's draw ``u(seed, d)`` (or the top-p / min-p /
    top-k cut) lies within ``PROB_TOL`` of a cumulative-probability boundary of the kept tokens
    (``pdd.engine.sampler.decision_margin``) -- MD recomputes the handed-over tokens' KV in one
    extend, which is not bit-equal to RLD's decode steps, so logits differ by float noise. At
    most 2 of the 20 prompts; the test prints which.
"""

from __future__ import annotations

import json
import random

import httpx
import pytest

from tests.e2e.conftest import TEST_DEVICE, make_cfg, topology_factory  # noqa: F401 (fixture)

pytestmark = pytest.mark.slow

N_PROMPTS = 20
MAX_TOKENS = 32
TOP_LOGPROBS = 5
LP_TOL = 1e-3
PROB_TOL = 1e-4


def _prompts() -> list[list[int]]:
    rng = random.Random(4321)
    lengths = [8, 15, 16, 17, 31, 33, 50, 64, 90, 128, 150, 200, 255, 256, 300, 333, 400, 480, 512, 600]
    assert len(lengths) == N_PROMPTS
    return [[rng.randrange(5, 4000) for _ in range(n)] for n in lengths]


def _body(i: int) -> dict:
    """Request i's sampling parameters: every prompt samples (temperature > 0) with top-p and/or
    top-k; some add min-p, some presence / frequency / repetition penalties."""
    kinds = [
        {"temperature": 1.0, "top_p": 0.9},
        {"temperature": 0.8, "top_k": 40},
        {"temperature": 1.2, "top_p": 0.95, "top_k": 100, "min_p": 0.02},
        {"temperature": 1.0, "top_p": 0.9, "presence_penalty": 0.5, "frequency_penalty": 0.3,
         "repetition_penalty": 1.15},
    ]
    return {"seed": 1000 + i, "max_tokens": MAX_TOKENS, "ignore_eos": True, **kinds[i % 4]}


def _sampling(body: dict, logprobs: int | None):
    from pdd.types import SamplingParams

    return SamplingParams(max_tokens=body["max_tokens"], temperature=body["temperature"],
                          top_p=body.get("top_p", 1.0), top_k=body.get("top_k", -1), seed=body["seed"],
                          ignore_eos=True, min_p=body.get("min_p", 0.0),
                          presence_penalty=body.get("presence_penalty", 0.0),
                          frequency_penalty=body.get("frequency_penalty", 0.0),
                          repetition_penalty=body.get("repetition_penalty", 1.0), logprobs=logprobs)


@pytest.fixture(scope="module")
def reference(small_model):
    """Tokens, logprobs and text of each prompt from one in-process engine (the oracle), and a
    probe of the decision margin at a position."""
    import torch
    from tokenizers import Tokenizer

    from pdd.engine.engine import Engine
    from pdd.engine.sampler import decision_margin
    from pdd.gateway.openai_text import Detokenizer

    torch.set_num_threads(1)
    eng = Engine.from_pretrained(small_model, num_pages=1024, page_size=16, device=TEST_DEVICE)
    tok = Tokenizer.from_file(f"{small_model}/tokenizer.json")
    refs = []
    for i, p in enumerate(_prompts()):
        s = eng.new_sequence(f"ref{i}", p, _sampling(_body(i), TOP_LOGPROBS), use_cache=False)
        eng.add(s)
        evs = []
        while eng.has_work():
            evs += eng.step()
        eng.release(s, cache=False)
        d = Detokenizer(tok)
        pieces = [d.add(e.token_id, j == len(evs) - 1) for j, e in enumerate(evs)]
        refs.append({"ids": [e.token_id for e in evs], "lps": [e.logprobs for e in evs], "pieces": pieces})

    def margin(i: int, prefix: list[int]) -> tuple[str, float]:
        prompt = _prompts()[i]
        sp = _sampling(_body(i), None)
        eng.keep_logits = True
        probe = eng.new_sequence("probe", prompt + prefix, _sampling({"max_tokens": 1, "temperature": 0, "seed": 0},
                                                                     None), use_cache=False)
        eng.add(probe)
        while eng.has_work():
            eng.step()
        row = eng.last_logits.pop("probe")
        eng.release(probe, cache=False)
        return decision_margin(row, sp, len(prefix), prompt + prefix, len(prompt), eng.eos_token_ids)

    return refs, margin, tok


def _stream(url: str, body: dict) -> dict:
    r = httpx.post(url + "/v1/completions", json={**body, "stream": True, "stream_options": {"include_usage": True}},
                   timeout=120)
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    toks = [c for c in chunks if c.get("choices")]
    return {"ids": [c["pdd"]["token_id"] for c in toks], "tiers": [c["pdd"]["tier"] for c in toks],
            "text": "".join(c["choices"][0]["text"] for c in toks),
            "lps": [c["choices"][0]["logprobs"] for c in toks],
            "finish": toks[-1]["choices"][0]["finish_reason"] if toks else None,
            "summary": next((c["pdd"] for c in chunks if "usage" in c), {})}


def _stop_for(pieces: list[str], start: int) -> tuple[int, str] | None:
    """A stop string spanning the boundary between two non-empty token texts at or after start."""
    for k in range(start, len(pieces) - 1):
        if pieces[k] and pieces[k + 1]:
            return k, pieces[k][-2:] + pieces[k + 1][:2]
    return None


@pytest.mark.parametrize("handoff_min_tokens,label,stop_from",
                         # no "never" (RLD decodes all): "mid-stream"'s first 12 tokens are RLD's alone, and the
                         # suite must stay within CI's 30 minutes
                         [(1, "after-first-token", 2), (12, "mid-stream", 14)])
def test_seeded_sampling_equals_single_engine_across_handoff(small_model, reference, topology_factory,
                                                              handoff_min_tokens, label, stop_from):
    refs, margin, tok = reference
    # a fast WAN so MD's KV is there early and the handoff point is set by handoff_min_tokens;
    # every request relayed (budget 0). Where a handoff is wanted RLD's step is held to >= 20 ms,
    # so its tokens after handoff_min_tokens take >= 0.4 s, far longer than the handoff call needs
    # on a quiet machine; a busy one may still let RLD finish first (checked below, as in
    # tests/e2e/test_output_contract.py)
    hold = {"relay_decode": {"engine": {"min_step_ms": 20.0}}} if handoff_min_tokens < MAX_TOKENS else {}
    cfg = make_cfg(small_model, "pdd", link={"wan_gbps": 5.0, "wan_rtt_ms": 1.0, "wan_jitter_ms": 0.0},
                   policy={"handoff_min_tokens": handoff_min_tokens, "pipeline_ttft_budget_ms": 0}, tiers=hold)
    topo = topology_factory(cfg)
    excused, handoffs, lp_err, stops = [], [], 0.0, []
    for i, p in enumerate(_prompts()):
        ref = refs[i]
        got = _stream(topo.url, {"prompt": p, "logprobs": TOP_LOGPROBS, **_body(i)})
        hp = got["summary"]["handoff_pos"]
        handoffs.append(hp)
        assert len(got["ids"]) == MAX_TOKENS and got["finish"] == "length"
        if handoff_min_tokens >= MAX_TOKENS:
            assert hp is None and set(got["tiers"]) == {"rld"}
        elif hp is None:  # RLD finished before the handoff reached it (a busy machine)
            assert got["summary"]["rld_finished_first"] and set(got["tiers"]) == {"rld"}, got["summary"]
        else:
            assert hp >= handoff_min_tokens
            assert got["tiers"] == ["rld"] * hp + ["md"] * (MAX_TOKENS - hp)
        same = got["ids"] == ref["ids"]
        n_cmp = MAX_TOKENS
        if not same:
            d = next(j for j, (a, b) in enumerate(zip(got["ids"], ref["ids"])) if a != b)
            kind, m = margin(i, ref["ids"][:d])
            assert kind == "prob" and m <= PROB_TOL, (
                f"[{label}] prompt {i} ({len(p)} tokens) diverged at {d} (handoff {hp}): {kind} margin {m:.3g}")
            excused.append((i, d, hp, f"{kind}={m:.2e}"))
            n_cmp = d + 1  # the differing token's own logprob still comes from the same position
        for j in range(n_cmp):
            lp, rl = got["lps"][j], ref["lps"][j]
            lp_err = max(lp_err, abs(lp["token_logprobs"][0] - rl["lp"])) if j < n_cmp - 1 or same else lp_err
            top = lp["top_logprobs"][0]
            for tid, v in rl["top"]:
                s = _token_str(tok, tid)
                if s in top:
                    lp_err = max(lp_err, abs(top[s] - v))
        # stop strings: the same text as the single engine's output cut at the stop string. With a
        # handoff, the stop string starts in RLD's last token and ends in MD's first (so it can only
        # complete after the handoff); without, it spans tokens from ``stop_from`` on.
        if same:
            sel = _stop_for(ref["pieces"], hp - 1 if hp else stop_from)
            if sel is not None:
                k, stop = sel
                text = "".join(ref["pieces"])
                expected = text[:text.index(stop)]
                s = _stream(topo.url, {"prompt": p, **_body(i), "max_tokens": 200, "stop": [stop]})
                assert s["text"] == expected, f"[{label}] prompt {i}: stop {stop!r} at token {k}"
                assert s["finish"] == "stop" and len(s["ids"]) <= k + 2
                stops.append((k + 1, s["tiers"][-1]))  # the token completing it, and its tier
    print(f"\n[{label}] handoff positions: {handoffs}")
    print(f"[{label}] excused numerical divergences (prompt, first position, handoff, margin): {excused}")
    print(f"[{label}] max |logprob difference|: {lp_err:.2e} (tolerance {LP_TOL:g}); "
          f"stop strings checked: {len(stops)} (completing at (token, tier)): {stops}")
    assert lp_err <= LP_TOL
    assert len(excused) <= 2
    assert len(stops) >= N_PROMPTS - len(excused) - 2
    if handoff_min_tokens < MAX_TOKENS:  # the handoff this case is about happened
        assert sum(h is not None for h in handoffs) >= N_PROMPTS // 2, handoffs
        # stop strings completed by MD, after the handoff, were checked
        # (how many depends on when each separately sent stop request handed over: timing)
        assert sum(t == "md" for _, t in stops) >= 1


def _token_str(tok, tid: int) -> str:
    from pdd.gateway.openai_text import TokenText

    global _TT
    try:
        tt = _TT
    except NameError:
        tt = _TT = TokenText(tok)
    return tt.get(int(tid))[0]
