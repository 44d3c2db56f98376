"""max_tokens, min_tokens, stop_token_ids and EOS mean the same on every tier (issue 5, item 5).

A request run by one engine must end at the same position, with the same tokens and finish
reason, as the same request relayed the way pdd runs it: P samples the first token (with
``max_tokens`` 1 and ``ignore_eos``; ``roles.base.first_token_finish`` applies the request's own
limits to it), RLD imports P's KV and decodes ``k`` tokens, MD imports the KV, extends with RLD's
ids and decodes to the end. Seeded sampling draws the same token for a position on every tier.
(Stop *strings* are the gateway's alone: tests/api/test_openai_parity.py checks them across the
handoff.)"""

from __future__ import annotations

import itertools

import pytest

from pdd.engine.engine import Engine
from pdd.roles.base import first_token_finish
from pdd.types import SamplingParams

PROMPT = list(range(30, 51))  # 21 tokens: two whole pages of 8 and a partial one


@pytest.fixture(scope="module")
def engines(tiny_model):
    return [Engine.from_pretrained(tiny_model, num_pages=64, page_size=8) for _ in range(4)]


def _run(eng, seq):
    reason = None
    eng.add(seq)
    while eng.has_work():
        for ev in eng.step():
            if ev.finished:
                reason = ev.finish_reason.value
    return reason


def single(eng, sp):
    seq = eng.new_sequence("one", PROMPT, sp, use_cache=False)
    reason = _run(eng, seq)
    out = seq.output_ids
    eng.release(seq, cache=False)
    return out, reason


def relayed(p, rld, md, sp, k):
    p_sp = SamplingParams.from_dict({**sp.to_dict(), "max_tokens": 1, "ignore_eos": True})
    sp_seq = p.new_sequence("r", PROMPT, p_sp, use_cache=False)
    _run(p, sp_seq)
    t0 = sp_seq.output_ids[0]
    kv = bytes(p.pool.export_pages(sp_seq.page_table))
    p.release(sp_seq, cache=False)
    fin = first_token_finish(t0, sp, set(p.eos_token_ids))
    if fin is not None:
        return [t0], fin
    r = rld.new_sequence("r", PROMPT, sp, use_cache=False)
    rld.pool.import_pages(r.page_table, kv)
    rld.kv_imported(r, t0, add=True)
    reason = None
    while rld.has_work() and r.num_outputs < k:
        for ev in rld.step():
            if ev.finished:
                reason = ev.finish_reason.value
    ids = r.output_ids
    if reason is not None:
        rld.release(r, cache=False)
        return ids, reason
    rld.release(rld.remove("r"), cache=False)  # one-shot handoff: RLD stops, MD takes the ids
    m = md.new_sequence("r", PROMPT, sp, use_cache=False)
    md.pool.import_pages(m.page_table, kv)
    md.kv_imported(m, t0, add=False)
    md.append_tokens(m, ids[1:], sample=True)
    reason = _run(md, m)
    out = m.output_ids
    md.release(m, cache=False)
    return out, reason


def _cases():
    for max_t, min_t, stop, ignore_eos, k in itertools.product((1, 2, 6, 14), (0, 1, 4), (False, True), (False, True),
                                                               (1, 3)):
        if min_t <= max_t:
            yield max_t, min_t, stop, ignore_eos, k


def test_limits_end_a_relayed_request_where_a_single_engine_ends_it(engines):
    one, p, rld, md = engines
    eos = one.eos_token_ids
    seen_reasons = set()
    for seed in (3, 11):
        free_run, _ = single(one, SamplingParams(max_tokens=14, temperature=1.0, seed=seed, ignore_eos=True))
        stop_id = free_run[3]  # a token the request really samples at position 3
        for max_t, min_t, stop, ignore_eos, k in _cases():
            sp = SamplingParams(max_tokens=max_t, min_tokens=min_t, temperature=1.0, seed=seed, ignore_eos=ignore_eos,
                                stop_token_ids=[stop_id] if stop else [])
            want = single(one, sp)
            got = relayed(p, rld, md, sp, k)
            assert got == want, (seed, max_t, min_t, stop, ignore_eos, k)
            assert len(want[0]) <= max_t and (len(want[0]) >= min_t or want[1] != "stop")
            seen_reasons.add(want[1])
    assert seen_reasons == {"length", "stop"}  # both kinds of ending were exercised
    for e in engines:
        assert e.pool.num_free == e.pool.num_pages  # every page freed exactly once
    assert eos  # the model has an EOS id, so ignore_eos mattered
