"""Fixtures that start real process topologies (marked slow)."""

from __future__ import annotations

import contextlib
import os
import random
import json
from pathlib import Path

import pytest

from pdd.config import ClusterConfig
from pdd.faults import StreamClient
from pdd.launch import Topology
from pdd.topology import free_port_block


TEST_DEVICE = os.environ.get("PDD_TEST_DEVICE", "cpu")  # "cuda" runs every engine of a topology on the GPU


def greedy_oracle(model_dir: str, prompts: list[list[int]], max_tokens: int, **sampling):
    """The single-engine oracle: greedy outputs of ``prompts`` on one in-process engine
    (``max_tokens`` each, EOS ignored; ``sampling``: more SamplingParams fields, e.g.
    ``allowed_token_ids``) and ``margin(prompt, prefix)``, the top-2 logit gap of the next token
    after ``prompt + prefix`` (a small gap marks a numerical near-tie; unmasked logits)."""
    import torch

    from pdd.engine.engine import Engine
    from pdd.types import SamplingParams

    torch.set_num_threads(1)
    eng = Engine.from_pretrained(model_dir, num_pages=1024, page_size=16, device=TEST_DEVICE)

    def run(rid: str, ids: list[int], n: int, **extra) -> list[int]:
        s = eng.new_sequence(rid, ids, SamplingParams(max_tokens=n, ignore_eos=True, **extra), use_cache=False)
        eng.add(s)
        while eng.has_work():
            eng.step()
        out = list(s.output_ids)
        eng.release(s, cache=False)
        return out

    outs = [run(f"ref{i}", p, max_tokens, **sampling) for i, p in enumerate(prompts)]

    def margin(prompt: list[int], prefix: list[int]) -> float:
        eng.keep_logits = True
        run("probe", prompt + prefix, 1)
        top2 = torch.topk(eng.last_logits.pop("probe").float(), 2).values
        return float(top2[0] - top2[1])

    return outs, margin


def warm_then_cold_prompts(seed: int, n_first: int, n_cold: int) -> list[list[int]]:
    """Three prompts of token ids (5..3999, from ``random.Random(seed)``): one of ``n_first``
    tokens, the same plus ``[7, 8, 9]`` (it hits the first's cached pages) and an unrelated cold
    one of ``n_cold`` tokens."""
    rng = random.Random(seed)
    first = [rng.randrange(5, 4000) for _ in range(n_first)]
    cold = [rng.randrange(5, 4000) for _ in range(n_cold)]
    return [first, first + [7, 8, 9], cold]


def run_checking_wan_bytes(topo: Topology, prompts: list[list[int]], want: list[int],
                           max_tokens: int) -> tuple[list[dict], dict]:
    """Streams ``prompts`` through ``topo`` one at a time (greedy, ``max_tokens`` each, EOS
    ignored), each after the topology is idle again, and asserts: each output equals
    ``greedy_oracle``'s on the topology's model, request i's ``wan_bytes_expected`` is ``want[i]``
    bytes, the gateway's ``wan_bytes`` == ``wan_bytes_expected`` == ``sum(want)``, and after a
    flush no instance holds a leaked page. Returns the requests' summaries and the stats taken
    before the flush."""
    outs, _ = greedy_oracle(topo.cfg.model_path, prompts, max_tokens)
    summaries = []
    for prompt, nbytes, out in zip(prompts, want, outs):
        c = StreamClient(topo.url, {"model": topo.cfg.served_model_name, "prompt": prompt, "max_tokens": max_tokens,
                                    "temperature": 0, "ignore_eos": True}).start()
        assert c.wait(60) and c.error is None, c.error
        assert c.tokens == out
        assert c.summary["wan_bytes_expected"] == nbytes, json.dumps(
            {**c.summary, "instances_lost": topo.stats()["totals"].get("instances_lost", 0)})
        assert topo.wait_idle(timeout_s=30), topo.last_busy
        summaries.append(c.summary)
    st = topo.stats()
    assert st["wan_bytes"] == st["wan_bytes_expected"] == sum(want)
    fl = topo.flush()
    assert fl["leaked_pages"] == 0, fl
    return summaries, st


def settled_stats(topo: Topology, timeout_s: float = 60.0) -> dict:
    """``topo``'s stats once it is settled (``Topology.wait_idle``: no instance runs a request, no
    KV in flight or awaited; MD settles after the client's stream ends); raises AssertionError
    after ``timeout_s`` seconds."""
    assert topo.wait_idle(timeout_s=timeout_s), f"topology did not go idle: {topo.last_busy}"
    return topo.stats()


def make_cfg(model: str, mode: str, **over) -> ClusterConfig:
    """A config on a free port block. The relay is what most topology tests exercise, and their
    prompts are short enough to fit the default pipeline budget (P->MD): the budget is 0 (every
    pdd request relayed) unless the test's ``policy`` sets ``pipeline_ttft_budget_ms``."""
    base = free_port_block()
    data = {"mode": mode, "model_path": model, "base_port": base, "gateway_port": base + 95,
            "engine": {"device": TEST_DEVICE}}
    data.update(over)
    data["policy"] = {"pipeline_ttft_budget_ms": 0.0, **(data.get("policy") or {})}
    return ClusterConfig.model_validate(data)


@pytest.fixture
def topology_factory(tmp_path):
    started: list[Topology] = []

    def start(cfg: ClusterConfig) -> Topology:
        t = Topology(cfg, log_dir=Path(tmp_path) / f"logs-{cfg.mode}-{len(started)}")
        t.start()
        started.append(t)
        return t

    yield start
    for t in started:
        t.stop()


@contextlib.contextmanager
def handoff_topology(model: str, log_dir, k: int, **over):
    """A started pdd-mode topology whose handoff point is set by ``handoff_min_tokens`` = ``k``:
    a fast WAN, so MD's KV is there early, and RLD's step held to >= 20 ms, so its ``k`` tokens
    take far longer than MD's KV needs (RLD samples outputs 0..k-1, MD from k on); ``over``:
    more config keys. Stopped on exit."""
    cfg = make_cfg(model, "pdd", link={"wan_gbps": 5.0, "wan_rtt_ms": 1.0, "wan_jitter_ms": 0.0},
                   policy={"handoff_min_tokens": k}, tiers={"relay_decode": {"engine": {"min_step_ms": 20.0}}}, **over)
    topo = Topology(cfg, log_dir=log_dir)
    topo.start()
    try:
        yield topo
    finally:
        topo.stop()
