"""Client against a fake OpenAI-style SSE server (uvicorn in a thread on a free port)."""

import json

from pdd.bench.client import replay, run_one, run_one_sync
from pdd.bench.report import compute_modes
from pdd.workload.replay import ReplayRequest

from bench_fakes import HANG, HTTP_500, MID_ERROR, NO_DONE, ODD_CHUNKS, OK  # noqa: E402


def test_run_one_sync_ok(server_url):
    rec = run_one_sync(server_url, [OK, 7, 8], 5, model="m")
    assert rec.ok and rec.error is None and rec.http_status == 200
    assert rec.pos == [0, 1, 2, 3, 4] and rec.tiers == ["rld", "rld", "md", "md", "md"]
    assert rec.token_ids == [100, 101, 102, 103, 104] and rec.text == "t0 t1 t2 t3 t4 "
    assert rec.finish_reason == "length"
    assert rec.usage["completion_tokens"] == 5 and rec.pdd["pipeline"] == "p_rld_md" and rec.pdd["wan_bytes"] == 30
    assert rec.send_s <= rec.token_times_s[0] <= rec.token_times_s[-1] <= rec.end_s
    assert rec.ttft_ms > 0


async def test_failures_are_recorded(server_url):
    r500 = await run_one(server_url, [HTTP_500], 4)
    assert not r500.ok and r500.http_status == 500 and r500.error == "HTTP 500: boom"
    mid = await run_one(server_url, [MID_ERROR], 6)
    assert not mid.ok and mid.error == "server error: MD lost" and len(mid.token_times_s) == 2
    hang = await run_one(server_url, [HANG], 4, timeout_s=0.5)
    assert not hang.ok and hang.error.startswith("Timeout") and len(hang.token_times_s) == 1
    nodone = await run_one(server_url, [NO_DONE], 3)
    assert not nodone.ok and nodone.error.startswith("incomplete stream") and len(nodone.token_times_s) == 3
    # chunks that are JSON but not shaped as a completion chunk: named as the data the server sent
    # (it was "TypeError: argument of type 'int' is not iterable"); the record holds only real tokens
    odd = await run_one(server_url, [ODD_CHUNKS], 3)
    assert not odd.ok and odd.error == 'bad chunk: {"choices": {"a": 1}}'
    assert odd.text == "t0 t1 t2 " and len(odd.token_times_s) == len(odd.tiers) == 3
    refused = await run_one("http://127.0.0.1:9", [OK], 3, timeout_s=5)
    assert not refused.ok and refused.error.startswith("ConnectError")


async def test_replay_open_loop(server_url):
    kinds = [HANG, OK, HTTP_500, OK, MID_ERROR, OK]
    reqs = [ReplayRequest(idx=10 + i, arrival_s=0.05 * i, prompt_ids=[k, 5, 6, 7], max_tokens=4, trace_record={})
            for i, k in enumerate(kinds)]
    seen = []
    recs = await replay(server_url, reqs, model="m", mode="pdd", timeout_s=3, progress=False, on_record=seen.append)
    assert [r.idx for r in recs] == [10, 11, 12, 13, 14, 15] and len(seen) == 6
    assert [r.ok for r in recs] == [False, True, False, True, False, True]
    hung = recs[0]
    assert hung.error.startswith("Timeout")
    for q, r in zip(reqs, recs):
        assert r.send_s >= q.arrival_s  # never early
        assert r.mode == "pdd" and r.prompt_tokens == 4 and r.max_tokens == 4
    # open loop: every later request went out while the first still hung (a closed loop would wait for it)
    assert all(r.send_s < hung.end_s for r in recs[1:])
    modes = compute_modes([r.to_dict() for r in recs])
    m = modes["pdd"]
    assert m["completed"] == 3 and m["failed"] == 3
    assert m["errors"] == {"Timeout": 1, "HTTP 500": 1, "server error": 1}
    assert m["wan_bytes"] == 3 * 40 and m["rld_output_token_share"] == 0.5 and m["stream_errors"] == 0
    json.dumps([r.to_dict() for r in recs])
