"""Trace replay: determinism, exact prefix sharing, scaling math, ideal hit rate."""

import json
from pathlib import Path

import pytest

from pdd.workload.replay import (
    DEFAULT_TRACE,
    Scale,
    TokenSpace,
    build_requests,
    ideal_prefix_hit_rate,
    ideal_prefix_hits,
    load_trace,
    workload_summary,
)

TS = TokenSpace(vocab_size=5000, first_normal_id=10, avoid_ids=frozenset({100, 200}))


def rec(ts, inp, out, hids):
    return {"timestamp": ts, "input_length": inp, "output_length": out, "hash_ids": hids}


def common_prefix(a, b):
    n = 0
    for x, y in zip(a, b):
        if x != y:
            break
        n += 1
    return n


def test_deterministic_and_seeded():
    recs = load_trace(DEFAULT_TRACE, 0, 20)
    a = build_requests(recs, Scale(), TS, seed=0)
    b = build_requests(recs, Scale(), TS, seed=0)
    c = build_requests(recs, Scale(), TS, seed=1)
    assert [r.prompt_ids for r in a] == [r.prompt_ids for r in b]
    assert [r.prompt_ids for r in a] != [r.prompt_ids for r in c]
    allowed = set(TS.allowed().tolist())
    for r in a:
        assert set(r.prompt_ids) <= allowed
        assert all(10 <= t < 5000 and t not in (100, 200) for t in r.prompt_ids)


def test_exact_prefix_sharing_synthetic():
    recs = [rec(0, 2048, 10, [1, 2, 3, 4]), rec(0, 1300, 10, [1, 2, 5]), rec(0, 600, 10, [9, 2])]
    a, b, c = build_requests(recs, Scale(block_tokens=16), TS)
    assert len(a.prompt_ids) == 64 and len(b.prompt_ids) == round(1300 * 16 / 512) == 41
    assert common_prefix(a.prompt_ids, b.prompt_ids) == 32
    assert common_prefix(a.prompt_ids, c.prompt_ids) == 0


def test_exact_prefix_sharing_real_trace():
    bt = 8
    reqs = build_requests(DEFAULT_TRACE, Scale(block_tokens=bt, count=300), TS)
    checked = 0
    for i in range(len(reqs)):
        for j in range(i + 1, min(len(reqs), i + 60)):
            ha, hb = reqs[i].hash_ids, reqs[j].hash_ids
            k = common_prefix(ha, hb)
            la, lb = len(reqs[i].prompt_ids), len(reqs[j].prompt_ids)
            if k < min(len(ha), len(hb)) and la > k * bt and lb > k * bt:
                assert common_prefix(reqs[i].prompt_ids, reqs[j].prompt_ids) == k * bt
                checked += 1
    assert checked > 1000


def test_scaling_math():
    s = Scale(block_tokens=16)
    assert s.input_tokens(6758, 14) == 211  # round(6758 / 32)
    assert s.input_tokens(513, 2) == 17  # rounds to 16, but the last block keeps one token
    assert s.input_tokens(1, 1) == 1
    assert s.input_tokens(1024, 2) == 32
    assert Scale(block_tokens=16, max_input_tokens=100).input_tokens(6758, 14) == 96  # whole blocks
    assert Scale(block_tokens=16, max_input_tokens=10).input_tokens(6758, 14) == 10
    assert s.output_tokens(500) == 62 and s.output_tokens(3) == 8 and s.output_tokens(10_000) == 96
    assert Scale(output_scale=1.0, min_output_tokens=1, max_output_tokens=4).output_tokens(3) == 3

    recs = [rec(1000, 512, 8, [1]), rec(2000, 512, 8, [2]), rec(4000, 512, 8, [3])]
    arr = [r.arrival_s for r in build_requests(recs, Scale(time_scale=2.0), TS)]
    assert arr == [0.0, 0.5, 1.5]
    rate = build_requests(recs, Scale(target_rate_rps=2.0), TS)
    assert [r.arrival_s for r in rate] == pytest.approx([0.0, 1 / 3, 1.0])
    assert Scale(target_rate_rps=2.0).effective_time_scale([1000, 2000, 4000]) == pytest.approx(3.0)


def test_truncation_keeps_whole_blocks_and_shares():
    recs = [rec(0, 5000, 10, list(range(10))), rec(0, 5000, 10, list(range(10)))]
    a, b = build_requests(recs, Scale(block_tokens=16, max_input_tokens=50), TS)
    assert len(a.prompt_ids) == 48 and a.hash_ids == (0, 1, 2)
    assert a.prompt_ids == b.prompt_ids


def test_slice_indices_and_summary():
    reqs = build_requests(DEFAULT_TRACE, Scale(start=5, count=7, target_rate_rps=1.5), TS)
    assert [r.idx for r in reqs] == list(range(5, 12))
    assert reqs[0].arrival_s == 0.0
    assert all(r.trace_record["hash_ids"][: len(r.hash_ids)] == list(r.hash_ids) for r in reqs)
    summ = workload_summary(reqs, Scale(start=5, count=7, target_rate_rps=1.5), DEFAULT_TRACE, page_size=16)
    assert summ["requests"] == 7 and summ["trace"].endswith("mooncake_conversation_trace.jsonl")
    assert summ["rate_rps"] == pytest.approx(1.5)
    json.dumps(summ)


def test_ideal_hit_rate():
    recs = [
        rec(0, 1024, 8, [1, 2]),  # 32 tokens, cold
        rec(0, 1500, 8, [1, 2, 3]),  # 47 tokens, 32 hit
        rec(0, 600, 8, [1, 4]),  # 19 tokens, 16 hit
        rec(0, 100, 8, [5]),  # 3 tokens, cold
        rec(0, 1000, 8, [5, 6]),  # 31 tokens: block 5 seen only 3 tokens long -> 3 hit
    ]
    reqs = build_requests(recs, Scale(block_tokens=16), TS)
    assert [len(r.prompt_ids) for r in reqs] == [32, 47, 19, 3, 31]
    assert ideal_prefix_hits(reqs) == [0, 32, 16, 0, 3]
    assert ideal_prefix_hits(reqs, page_size=16, min_uncached=1) == [0, 32, 16, 0, 0]
    assert ideal_prefix_hit_rate(reqs) == pytest.approx(51 / 132)
    # a repeated identical prompt: everything but min_uncached hits
    again = build_requests([recs[1], recs[1]], Scale(block_tokens=16), TS)
    assert ideal_prefix_hits(again, min_uncached=1) == [0, 46]


def test_token_space_from_model(tmp_path: Path):
    (tmp_path / "config.json").write_text(json.dumps({"vocab_size": 1000, "bos_token_id": 1, "eos_token_id": 2}))
    tok = {
        "added_tokens": [{"id": i, "content": f"<s{i}>"} for i in (0, 1, 2, 3, 950)],
        "model": {"vocab": {f"t{i}": i for i in range(900)}},
    }
    (tmp_path / "tokenizer.json").write_text(json.dumps(tok))
    ts = TokenSpace.from_model(tmp_path)
    assert ts.first_normal_id == 4 and ts.vocab_size == 951 and 950 in ts.avoid_ids
    reqs = build_requests([rec(0, 4096, 8, list(range(8)))], Scale(block_tokens=64), ts)
    assert all(4 <= t < 950 for t in reqs[0].prompt_ids)


def test_session_sampling_keeps_whole_conversations():
    s = Scale(session_sample=50, count=40, target_rate_rps=2.0)
    reqs = build_requests(DEFAULT_TRACE, s, TS)
    assert len(reqs) == 40 and reqs == build_requests(DEFAULT_TRACE, s, TS)
    assert [r.idx for r in reqs] == sorted(r.idx for r in reqs) and reqs[0].arrival_s == 0.0
    keys = {r.trace_record["hash_ids"][1] for r in reqs if len(r.trace_record["hash_ids"]) > 1}
    # every request of the trace up to the last kept one with a kept conversation key is kept
    recs = load_trace(DEFAULT_TRACE, 0, reqs[-1].idx + 1)
    expect = [i for i, r in enumerate(recs) if (r["hash_ids"][1] in keys if len(r["hash_ids"]) > 1 else s.keeps_session(r, i))]
    assert expect == [r.idx for r in reqs]
    contiguous = ideal_prefix_hit_rate(build_requests(DEFAULT_TRACE, Scale(count=40), TS))
    assert contiguous < 0.06 < ideal_prefix_hit_rate(reqs)
    whole_hour = build_requests(DEFAULT_TRACE, Scale(session_sample=50), TS)
    assert 200 < len(whole_hour) < 260 and ideal_prefix_hit_rate(whole_hour) > 0.25
    other = build_requests(DEFAULT_TRACE, Scale(session_sample=50, session_seed=1, count=40), TS)
    assert [r.idx for r in other] != [r.idx for r in reqs]


def test_arrivals_count_from_the_slice_earliest_timestamp_not_its_first():
    """Found by a new user: a trace whose first record was not its earliest (an outlier, an
    unsorted file) gave the earlier records negative arrivals and the summary "0.0 s of arrivals
    (all at once)" for a replay that then waited on its latest record."""
    recs = [rec(5000, 600, 10, [1]), rec(0, 600, 10, [2]), rec(2500, 600, 10, [3])]
    reqs = build_requests(recs, Scale(session_sample=1), TS)
    assert [r.arrival_s for r in reqs] == [5.0, 0.0, 2.5]
    assert workload_summary(reqs, Scale(session_sample=1), "t.jsonl")["duration_s"] == 5.0
    # a target rate spans the earliest to the latest: 2 gaps over 5 s at 1 req/s is 2.5x faster
    fast = build_requests(recs, Scale(session_sample=1, target_rate_rps=1.0), TS)
    assert [r.arrival_s for r in fast] == [2.0, 0.0, 1.0]


def test_sim_counts_a_trace_from_its_earliest_timestamp(tmp_path):
    """`pdd sim run` on a trace of epoch-millisecond timestamps simulated 1,733,443,206 s of
    traffic (instance-seconds of 1.7e10) before its first request: it starts at the earliest, as
    pdd bench does."""
    from pdd.cli import main as pdd_main
    from pdd.workload.records import from_earliest

    epoch = 1_733_443_200_000
    recs = [rec(epoch + 1000 * i, 600, 10, [i]) for i in range(3)]
    assert [r["timestamp"] for r in from_earliest(recs)] == [0, 1000, 2000]
    assert from_earliest([rec(0, 1, 1, [])])[0]["timestamp"] == 0
    runs = []
    for name, rs in (("epoch", recs), ("zero", [dict(r, timestamp=r["timestamp"] - epoch) for r in recs])):
        trace, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.json"
        trace.write_text("".join(json.dumps(r) + "\n" for r in rs))
        assert pdd_main(["sim", "run", "--trace", str(trace), "--json", str(out)]) == 0
        # (arguments: the command's flags, which name each run's own files)
        runs.append({k: v for k, v in json.loads(out.read_text()).items()
                     if k not in ("wall_s", "peak_rss_mb", "arguments")})
    assert runs[0] == runs[1]  # the same simulation: duration_s was 1.7e9 s for the epoch trace
    assert runs[0]["duration_s"] < 10


def test_output_scale_past_floats_range_is_clamped_not_an_overflow():
    # --output-scale 1e308: output_length x scale was inf, and round(inf) raised OverflowError
    assert Scale(output_scale=1e308).output_tokens(40) == 96
    assert Scale(output_scale=1e308).output_tokens(0) == 8


def test_fit_scale_refuses_no_prompt_room_and_blocks_longer_than_the_cap():
    from pdd.config import ClusterConfig, EngineConfig
    from pdd.workload.replay import fit_scale

    cfg = ClusterConfig(engine=EngineConfig(max_model_len=1000, max_input_len=950))
    assert fit_scale(Scale(block_tokens=1, max_output_tokens=999), cfg, 5, 0).max_input_tokens == 1
    # --max-output 1000 (or 10**9) cut every prompt to 1 token, silently
    with pytest.raises(ValueError, match=r"^--max-output 1000 leaves no prompt token within the engine's "
                                         r"max_model_len 1000 \(prompt \+ output\)"):
        fit_scale(Scale(max_output_tokens=1000), cfg, 5, 0)
    assert fit_scale(Scale(block_tokens=904, max_output_tokens=96), cfg, 5, 0).max_input_tokens == 904
    with pytest.raises(ValueError, match=r"^--block-tokens 905 exceeds the prompt cap of 904 tokens"):
        fit_scale(Scale(block_tokens=905, max_output_tokens=96), cfg, 5, 0)
    with pytest.raises(ValueError, match=r"^--block-tokens 10 exceeds the prompt cap of 9 tokens"):
        fit_scale(Scale(block_tokens=10, max_input_tokens=9), cfg, 5, 0)


def test_ids_up_to_one_per_block_load_and_replay_at_their_length(tmp_path):
    """One id per 512-token block (the last partial) or none load, and replay at
    ``input_length`` scaled (16 tokens a block); the whole shared trace has one id per block
    (12,031 records) and loads. More ids than blocks are refused at load
    (tests/bench/test_bench_cli_errors.py, ``pdd sim run`` alike: ``records.read_trace``)."""
    t = tmp_path / "t.jsonl"
    recs = [rec(0, 513, 10, [1, 2]), rec(0, 1024, 10, [1, 2]), rec(0, 100, 10, [3]), rec(0, 64, 10, [])]
    t.write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert load_trace(t) == recs
    reqs = build_requests(t, Scale(block_tokens=16), TS)
    # 513 tokens: 16 + 1 (one token of the second block, so its id is represented)
    assert [len(r.prompt_ids) for r in reqs] == [17, 32, 3, 2]
    assert len(load_trace(DEFAULT_TRACE)) == 12031


def test_more_ids_than_blocks_are_refused_naming_the_file_line_and_field(tmp_path):
    t = tmp_path / "t.jsonl"
    t.write_text(json.dumps(rec(0, 600, 10, [1, 2])) + "\n" + json.dumps(rec(5, 100, 10, [1, 2, 3, 4, 5])) + "\n")
    with pytest.raises(ValueError) as e:
        build_requests(t, Scale(block_tokens=16), TS)
    assert str(e.value) == (f"{t}, line 2: 'hash_ids' has 5 ids, more than the 1 512-token block(s) of its "
                            f"'input_length' 100 (one id per block)")


def test_fewer_ids_than_blocks_keep_the_prompt_length_with_a_tail_of_its_own():
    """A record with fewer hash ids than 512-token blocks replays at ``input_length`` scaled (the
    simulator counts it so too: ``sim.request.SimRequest.prompt``); its ids' blocks are shared,
    the blocks past them its own. It was cut to its ids' blocks: 2,048 tokens with one id
    replayed 16 tokens instead of 64."""
    recs = [rec(0, 2048, 10, [7]), rec(0, 2048, 10, [7]), rec(0, 512, 10, [7])]
    a, b, c = build_requests(recs, Scale(block_tokens=16), TS)
    assert [len(r.prompt_ids) for r in (a, b, c)] == [64, 64, 16]
    assert a.hash_ids == (7,) and a.prompt_ids[:16] == b.prompt_ids[:16] == c.prompt_ids
    assert common_prefix(a.prompt_ids, b.prompt_ids) < 17  # the tails are each record's own
    assert ideal_prefix_hits([a, b, c], page_size=1) == [0, 16, 16]
