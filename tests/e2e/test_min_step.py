"""pdd with an emulated accelerator step (``engine.min_step_ms``): every forward pass of every
engine is held to at least 20 ms, and admission-type commands run during the hold (``EngineWorker``).

Concurrent relayed requests sharing a prefix (so reservations, KV imports, catch-up extends and
releases arrive while steps are held) each produce a single engine's greedy output, the WAN bytes
sent equal the bytes planned, every page is free afterwards, and a request takes at least its
decode steps' held time (a lower bound: a held step never ends early). RLD's steps are held to
``RLD_STEP_MS`` (40 ms): a catch-up round (RLD's ids, then MD's extend over a held step) takes about
two of MD's steps, so RLD, slower, lets the gap close within the round cap long before its 48th
token even on a busy machine (at 20 ms RLD made about as many tokens per round as the threshold,
so a handoff could run to the 8-round cap: ~0.5 s of the ~0.96 s RLD had, more when busy).
"""

from __future__ import annotations

import random
import time

import pytest

from pdd.faults import StreamClient
from tests.e2e.conftest import greedy_oracle, make_cfg

pytestmark = pytest.mark.slow

STEP_MS = 20.0
RLD_STEP_MS = 40.0


def _ids(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(5, 4000) for _ in range(n)]


@pytest.mark.parametrize("handoff_mode", ["catch_up", "one_shot"])
def test_held_steps_keep_outputs_bytes_and_pages_exact(small_model, topology_factory, handoff_mode):
    cfg = make_cfg(small_model, "pdd", engine={"device": "cpu", "min_step_ms": STEP_MS},
                   policy={"pipeline_ttft_budget_ms": 0.0, "handoff_mode": handoff_mode,
                           "catchup_threshold_tokens": 2, "cutoff": False},
                   link={"wan_gbps": 0.05, "wan_rtt_ms": 20.0, "wan_jitter_ms": 0.0},
                   limits={"max_inflight_requests": 0, "max_queued_prompt_tokens": 0}, request_timeout_s=60.0,
                   tiers={"relay_decode": {"engine": {"min_step_ms": RLD_STEP_MS}}})
    topo = topology_factory(cfg)
    shared = _ids(1, 64)
    prompts = [shared + _ids(10 + i, 20 + 7 * i) for i in range(4)]
    max_tokens = 48
    t0 = time.perf_counter()
    clients = []
    for p in prompts:
        clients.append(StreamClient(topo.url, {"model": cfg.served_model_name, "prompt": p, "max_tokens": max_tokens,
                                               "temperature": 0, "ignore_eos": True}).start())
        time.sleep(0.005)  # arrivals inside one another's held steps
    for c in clients:
        assert c.wait(60) and c.error is None, c.error
    elapsed = time.perf_counter() - t0
    assert elapsed >= (max_tokens - 1) * STEP_MS / 1000  # each decode step was held
    outs, _ = greedy_oracle(small_model, prompts, max_tokens)
    assert [c.tokens for c in clients] == outs
    assert all(c.summary["pipeline"] == "p_rld_md" and c.summary["handoff_pos"] is not None for c in clients), \
        [c.summary for c in clients]
    assert {c.summary["handoff_mode"] for c in clients} == {handoff_mode}
    assert topo.wait_idle(timeout_s=30), topo.last_busy
    st = topo.stats()
    assert st["wan_bytes"] == st["wan_bytes_expected"] > 0, st
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl
