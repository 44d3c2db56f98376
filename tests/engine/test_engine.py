"""Engine behaviour: prefix reuse, batching (forward-call counts), extend, chunking, pages."""

from __future__ import annotations

import pytest
import torch

from pdd.engine import OutOfPages
from pdd.engine.kv_pool import PagesHeld
from pdd.engine.runner import RunItem
from pdd.engine.sequence import SeqStatus
from pdd.types import FinishReason, SamplingParams

GREEDY = SamplingParams(max_tokens=12, ignore_eos=True)


def _run(eng, seqs):
    events = []
    while eng.has_work():
        events += eng.step()
    return events


def _all_free(eng):
    eng.flush_cache()
    return eng.pool.num_free == eng.pool.num_pages


def test_prefix_cache_reuse_gives_identical_tokens(make_engine, prompts):
    eng = make_engine(page_size=4)
    long = prompts[3]
    (cold,) = eng.generate([long], GREEDY)
    computed_before = eng.runner.tokens_computed
    seq = eng.new_sequence("warm", long, GREEDY)
    assert seq.num_cached_tokens == (len(long) - 1) // 4 * 4 > 0
    assert seq.num_computed == seq.num_cached_tokens
    eng.add(seq)
    _run(eng, [seq])
    assert seq.output_ids == cold
    # only the uncached suffix (and the decodes) were computed
    assert eng.runner.tokens_computed - computed_before == len(long) - seq.num_cached_tokens + 11
    eng.release(seq)
    assert eng.radix.stats()["hit_tokens"] == seq.num_cached_tokens
    assert _all_free(eng)


def test_min_uncached_caps_the_match(make_engine, prompts):
    eng = make_engine(page_size=4)
    p = prompts[1][:16]  # exactly 4 pages
    eng.generate([p], GREEDY)
    s1 = eng.new_sequence("a", p, GREEDY, min_uncached=1)
    assert s1.num_cached_tokens == 12
    s0 = eng.new_sequence("b", p, GREEDY, min_uncached=0)
    assert s0.num_cached_tokens == 16 and s0.pending == 0
    s5 = eng.new_sequence("c", p, GREEDY, min_uncached=5)
    assert s5.num_cached_tokens == 8
    for s in (s1, s0, s5):
        eng.release(s, cache=False)
    assert _all_free(eng)


def test_batched_decode_is_one_forward_call(make_engine, prompts):
    eng = make_engine()
    seqs = [eng.new_sequence(i, p, GREEDY, use_cache=False) for i, p in enumerate(prompts)]
    for s in seqs:
        eng.add(s)
    eng.step()  # one batch: all prefills fit in the default budget
    assert all(s.num_outputs == 1 for s in seqs)
    calls = eng.runner.forward_calls
    events = eng.step()
    assert eng.runner.forward_calls == calls + 1
    assert sorted(e.seq_id for e in events) == list(range(len(prompts)))
    assert all(e.position == 1 for e in events)
    _run(eng, seqs)
    # batched outputs equal one-at-a-time outputs
    alone = [eng.generate([p], GREEDY, use_cache=False)[0] for p in prompts]
    assert [s.output_ids for s in seqs] == alone
    for s in seqs:
        eng.release(s, cache=False)
    assert _all_free(eng)


def test_extend_is_one_forward_call_and_matches_decoding(make_engine, prompts):
    eng = make_engine()
    prompt = prompts[1]
    (ref_out,) = eng.generate([prompt], GREEDY, use_cache=False)
    # per-token logits when decoding one by one
    seq = eng.new_sequence("d", prompt, GREEDY, use_cache=False)
    eng.keep_logits = True
    eng.add(seq)
    step_logits = []
    while eng.has_work():
        eng.step()
        step_logits.append(eng.last_logits["d"])
    eng.release(seq, cache=False)
    # handed-over ids: first k outputs; MD-like sequence extends over them in one call
    k = 7
    md = eng.new_sequence("md", prompt, GREEDY, use_cache=False)
    eng.add(md)
    eng.step()  # prefill + first token
    assert md.output_ids == ref_out[:1]
    eng.remove("md")
    eng.append_tokens(md, ref_out[1:k])
    eng.add(md)
    calls = eng.runner.forward_calls
    ev = eng.step()
    assert eng.runner.forward_calls == calls + 1
    assert md.num_computed == len(prompt) + k
    assert [e.token_id for e in ev] == [ref_out[k]] and ev[0].position == k
    torch.testing.assert_close(eng.last_logits["md"], step_logits[k], atol=1e-4, rtol=1e-4)
    _run(eng, [md])
    assert md.output_ids == ref_out
    eng.release(md)
    # extend logits at every position equal the one-by-one logits
    s2 = eng.new_sequence("x", prompt + ref_out[:k], GREEDY, use_cache=False)
    s2.num_computed = 0
    eng._ensure_pages(s2, len(s2.token_ids))
    (lg,) = eng.runner.forward([RunItem(s2.token_ids, 0, len(s2.token_ids), s2.page_table)], all_logits=True)
    for j in range(k):
        torch.testing.assert_close(lg[len(prompt) - 1 + j].cpu(), step_logits[j], atol=1e-4, rtol=1e-4)
    s2.num_computed = len(s2.token_ids)
    eng.release(s2, cache=False)
    assert _all_free(eng)


def test_catch_up_extend_without_sampling(make_engine, prompts):
    eng = make_engine()
    prompt = prompts[0]
    (ref_out,) = eng.generate([prompt], GREEDY, use_cache=False)
    md = eng.new_sequence("md", prompt, GREEDY, use_cache=False)
    eng.append_tokens(md, [], sample=False)
    eng.add(md)
    assert eng.step() == [] and md.num_computed == len(prompt) and md.num_outputs == 0
    eng.append_tokens(md, ref_out[:4], sample=False)
    assert eng.step() == [] and not eng.has_work()
    eng.append_tokens(md, ref_out[4:6], sample=True)
    ev = eng.step()
    assert [e.token_id for e in ev] == [ref_out[6]] and ev[0].position == 6
    _run(eng, [md])
    assert md.output_ids == ref_out
    eng.release(md)
    assert _all_free(eng)


def test_chunked_prefill_equals_unchunked(make_engine, prompts):
    prompt = prompts[3]
    whole = make_engine(max_batch_tokens=4096, prefill_chunk_tokens=4096)
    chunked = make_engine(max_batch_tokens=7, prefill_chunk_tokens=5)
    for eng in (whole, chunked):
        eng.keep_logits = True
    a = whole.new_sequence("s", prompt, GREEDY, use_cache=False)
    b = chunked.new_sequence("s", prompt, GREEDY, use_cache=False)
    whole.add(a)
    chunked.add(b)
    whole.step()
    calls = 0
    while b.num_outputs == 0:
        chunked.step()
        calls += 1
    assert calls == -(-len(prompt) // 5)
    torch.testing.assert_close(chunked.last_logits["s"], whole.last_logits["s"], atol=1e-4, rtol=1e-4)
    _run(whole, [a])
    _run(chunked, [b])
    assert a.output_ids == b.output_ids
    for eng, s in ((whole, a), (chunked, b)):
        eng.release(s)
        assert _all_free(eng)


def test_mixed_batch_prefill_with_decodes(make_engine, prompts):
    eng = make_engine(max_batch_tokens=10, prefill_chunk_tokens=8)
    refs = [eng.generate([p], GREEDY, use_cache=False)[0] for p in prompts]
    seqs = []
    for i, p in enumerate(prompts):  # staggered arrivals: decodes mix with later prefills
        s = eng.new_sequence(i, p, GREEDY, use_cache=False)
        eng.add(s)
        seqs.append(s)
        eng.step()
    _run(eng, seqs)
    assert [s.output_ids for s in seqs] == refs
    for s in seqs:
        eng.release(s, cache=False)
    assert _all_free(eng)


def test_stop_rules(make_engine, prompts):
    eng = make_engine()
    (free_run,) = eng.generate([prompts[0]], SamplingParams(max_tokens=10, ignore_eos=True))
    stop_tok = free_run[3]
    s = eng.new_sequence("s", prompts[0], SamplingParams(max_tokens=10, stop_token_ids=[stop_tok]))
    eng.add(s)
    ev = _run(eng, [s])
    first = free_run.index(stop_tok)
    assert s.output_ids == free_run[: first + 1]
    assert ev[-1].finished and ev[-1].finish_reason == FinishReason.STOP and ev[-1].position == first
    assert s.status == SeqStatus.FINISHED and "s" not in eng.seqs
    eng.release(s)
    eng.release(s)  # idempotent
    # EOS stops unless ignore_eos
    eng.sampler.eos_token_ids = {free_run[2]}
    s = eng.new_sequence("e", prompts[0], SamplingParams(max_tokens=10))
    eng.add(s)
    ev = _run(eng, [s])
    assert ev[-1].finish_reason == FinishReason.STOP and s.output_ids[-1] == free_run[2]
    eng.release(s)
    eng.sampler.eos_token_ids = set()
    s = eng.new_sequence("m", prompts[0], SamplingParams(max_tokens=3))
    eng.add(s)
    ev = _run(eng, [s])
    assert [e.position for e in ev] == [0, 1, 2] and ev[-1].finish_reason == FinishReason.LENGTH
    eng.release(s)
    assert _all_free(eng)


def test_kv_export_import_between_engines(make_engine, prompts):
    """P prefills and exports pages; D imports them, appends the first token and decodes."""
    p_eng, d_eng = make_engine(page_size=4), make_engine(page_size=4)
    prompt = prompts[1]
    (ref,) = p_eng.generate([prompt], GREEDY, use_cache=False)
    sp1 = SamplingParams(max_tokens=1, ignore_eos=True)
    ps = p_eng.new_sequence("r", prompt, sp1, use_cache=False)
    p_eng.add(ps)
    (ev,) = p_eng.step()
    d = d_eng.new_sequence("r", prompt, GREEDY, use_cache=False)
    n_pages = len(d.page_table)
    half = n_pages // 2  # two frames, two layer ranges, like layer-wise streaming
    for pages_p, pages_d in ((ps.page_table[:half], d.page_table[:half]), (ps.page_table[half:n_pages], d.page_table[half:])):
        for layers in ((0, 1), (1, 2)):
            data = p_eng.pool.export_pages(pages_p, layers)
            assert len(data) == len(pages_p) * p_eng.pool.layer_page_bytes
            d_eng.pool.import_pages(pages_d, data, layers)
    p_eng.release(ps)
    assert d_eng.kv_imported(d, ev.token_id) is None
    d_eng.add(d)
    _run(d_eng, [d])
    assert d.output_ids == ref
    assert d_eng.runner.tokens_computed == len(ref) - 1  # decodes only
    d_eng.release(d)
    assert _all_free(p_eng) and _all_free(d_eng)


def test_out_of_pages_is_clean(make_engine, prompts):
    eng = make_engine(num_pages=8, page_size=4)
    with pytest.raises(OutOfPages):
        eng.new_sequence("big", list(range(5, 5 + 40)), GREEDY)
    assert eng.pool.num_free == 8
    # cached pages get evicted to make room
    eng.generate([prompts[1][:16]], SamplingParams(max_tokens=1, ignore_eos=True))
    assert eng.pool.num_free < 8 and eng.radix.num_nodes == 4
    s = eng.new_sequence("fits", list(range(5, 5 + 29)), GREEDY)  # 8 pages: needs eviction
    assert eng.radix.num_nodes == 0 and eng.pool.num_free == 0
    # growing past the pool during decode raises OutOfPages with the seq id, before the forward
    eng.add(s)
    s.sampling = SamplingParams(max_tokens=10, ignore_eos=True)
    calls = eng.runner.forward_calls
    with pytest.raises(OutOfPages) as ei:
        for _ in range(5):
            eng.step()
    assert ei.value.seq_id == "fits"
    assert eng.runner.forward_calls == calls + 4  # prefill (0..28) + decodes at 29, 30, 31; 32 needs page 9
    eng.release(eng.remove("fits"), cache=False)
    assert _all_free(eng)


def test_prefix_match_is_locked_against_eviction(make_engine, prompts):
    eng = make_engine(num_pages=10, page_size=4)
    base = prompts[1][:17]
    eng.generate([base], SamplingParams(max_tokens=1, ignore_eos=True))
    s = eng.new_sequence("a", base, GREEDY)  # matches 4 pages, locked
    assert s.num_cached_tokens == 16
    with pytest.raises(OutOfPages):
        eng.new_sequence("b", list(range(100, 100 + 21)), GREEDY)  # 6 pages > 5 free, 0 evictable
    assert eng.radix.num_nodes == 4
    eng.release(s)
    assert _all_free(eng)


def test_starved_sequence_waits_while_others_run(make_engine, prompts):
    eng = make_engine(num_pages=6, page_size=4, enable_prefix_cache=False)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    a = eng.new_sequence("a", list(range(10, 22)), sp)  # 12 tokens: 3 pages, full
    b = eng.new_sequence("b", list(range(30, 41)), SamplingParams(max_tokens=2, ignore_eos=True))  # 11: 3 pages
    assert eng.pool.num_free == 0
    eng.add(a)
    eng.add(b)
    eng.step()  # both prefills; a's first token, b's first token
    ev = eng.step()  # a needs page 4 for position 12: starved; b decodes and finishes
    assert eng.starved == ["a"] and [e.seq_id for e in ev] == ["b"] and ev[0].finished
    with pytest.raises(OutOfPages) as ei:
        eng.step()  # nobody can run
    assert ei.value.seq_id == "a"
    eng.release(b)
    ev = _run(eng, [a])
    assert a.num_outputs == 6 and eng.starved == []
    (ref,) = make_engine(num_pages=64, page_size=4).generate([list(range(10, 22))], sp, use_cache=False)
    assert a.output_ids == ref
    eng.release(a)
    assert eng.pool.num_free == eng.pool.num_pages


def test_deadlocked_decodes_preempt_the_youngest_and_both_finish_exactly(make_engine):
    """Two decodes that both need a page in a full pool: before, the step raised OutOfPages and
    the worker failed one of them after its work (a new user got such 503s under concurrent long
    requests). Now the youngest is preempted (its pages freed, recomputed later) and the older
    runs on; both outputs equal a roomy engine's."""
    eng = make_engine(num_pages=6, page_size=4, enable_prefix_cache=False)
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    pa, pb = list(range(10, 22)), list(range(40, 52))  # 12 tokens each: 3 pages each, pool full
    a, b = eng.new_sequence("a", pa, sp), eng.new_sequence("b", pb, sp)
    assert eng.pool.num_free == 0
    eng.add(a)
    eng.add(b)
    eng.step()  # both prefills, both first tokens
    ev = eng.step()  # both need page 4: b (younger) is preempted, a decodes
    assert eng.preemptions == 1 and [e.seq_id for e in ev] == ["a"]
    assert b.page_table == [] and b.num_computed == 0 and b.num_outputs == 1
    while a.status == SeqStatus.RUNNING:
        eng.step()  # b waits for pages (starved) while a finishes
    with pytest.raises(PagesHeld):
        eng.step()  # only b is left and a (finished) holds its pages: wait for them, fail nobody
    eng.release(a)
    _run(eng, [b])
    ref = make_engine(num_pages=64, page_size=4).generate([pa, pb], sp, use_cache=False)
    assert [a.output_ids, b.output_ids] == ref and eng.stats()["preemptions"] == 1
    eng.release(b)
    assert eng.pool.num_free == eng.pool.num_pages


def test_max_running_limits_the_batch(make_engine, prompts):
    eng = make_engine(max_running=2)
    assert eng.sched_cfg.max_running_seqs == 2
    seqs = [eng.new_sequence(i, p, GREEDY, use_cache=False) for i, p in enumerate(prompts[:3])]
    for s in seqs:
        eng.add(s)
    eng.step()
    assert [s.num_outputs for s in seqs] == [1, 1, 0]
    _run(eng, seqs)
    for s in seqs:
        eng.release(s)
    assert _all_free(eng)


def test_a_cancelled_sequence_holding_pages_makes_the_others_wait_not_fail(make_engine):
    """A request aborted on a decode tier is cancelled at once and released by a later engine
    command. A step in between used to preempt the live sequence (the cancelled one did not
    count as holding pages that come back) and then fail it with OutOfPages: a request lost to
    another's abort. Now the step raises PagesHeld (the worker waits), nothing is preempted, and
    once the cancelled one is released the other runs on to the roomy engine's tokens."""
    eng = make_engine(num_pages=4, page_size=4, enable_prefix_cache=False)
    sp = SamplingParams(max_tokens=4, ignore_eos=True)
    pa, pb = list(range(10, 17)), list(range(20, 27))  # 7 tokens each: 2 pages each, pool full
    a, b = eng.new_sequence("a", pa, sp), eng.new_sequence("b", pb, sp)
    eng.add(a)
    eng.add(b)
    eng.step()  # both prefills, both first tokens
    eng.cancel(a)
    assert [e.seq_id for e in eng.step()] == ["b"]  # b's token at position 7 fills its 2nd page
    with pytest.raises(PagesHeld) as ei:
        eng.step()  # b needs a 3rd page; a's come back once its owner releases it
    assert ei.value.seq_id == "b" and eng.preemptions == 0 and len(b.page_table) == 2
    eng.release(a, cache=False)
    _run(eng, [b])
    (ref,) = make_engine(num_pages=64, page_size=4).generate([pb], sp, use_cache=False)
    assert b.output_ids == ref and eng.preemptions == 0
    eng.release(b)
    assert eng.pool.num_free == eng.pool.num_pages


def test_generate_on_a_tight_pool_releases_each_as_it_finishes(make_engine):
    """``generate`` held every finished sequence until all had finished, so two prompts that
    deadlock a full pool (the younger preempted) raised PagesHeld once the older finished; now the
    finished one is released at once and both complete with a roomy engine's tokens."""
    sp = SamplingParams(max_tokens=6, ignore_eos=True)
    prompts = [list(range(10, 22)), list(range(40, 52))]  # 3 pages each of a 6-page pool
    eng = make_engine(num_pages=6, page_size=4, enable_prefix_cache=False)
    out = eng.generate(prompts, sp, use_cache=False)
    assert out == make_engine(num_pages=64, page_size=4).generate(prompts, sp, use_cache=False)
    assert eng.preemptions == 1 and eng.pool.num_free == eng.pool.num_pages
