"""The engine's per-layer KV hand-off (``Engine.watch_kv``, layer-wise streaming) and the worker's
pacing of it over an emulated step (``EngineWorker.layer_done``)."""

from __future__ import annotations

import asyncio
import time

import pytest
import torch

from pdd.engine.engine import Engine
from pdd.roles.worker import EngineWorker
from pdd.types import SamplingParams
from tests.engine.conftest import DEVICES


@pytest.mark.parametrize("device", DEVICES)
def test_each_layer_of_each_prefill_chunk_is_announced_once_written(tiny_model, device):
    eng = Engine.from_pretrained(tiny_model, num_pages=64, page_size=4, device=device, prefill_chunk_tokens=8)
    n_layers = eng.model_cfg.num_hidden_layers
    prompt = [(7 * i) % 200 + 3 for i in range(21)]  # chunks end at 8, 16, 21
    seq = eng.new_sequence("r", prompt, SamplingParams(max_tokens=1, ignore_eos=True), use_cache=False)
    calls, snaps = [], {}

    def on_layer(layer, tokens, ready):
        calls.append((layer, tokens))
        assert (ready is not None) == (device == "cuda")
        if ready is not None:
            ready.synchronize()
        # what a sender would read now: this layer's K/V of tokens [0, tokens)
        snaps[(layer, tokens)] = eng.pool.buffer[seq.page_table[: -(-tokens // 4)], layer].clone()

    eng.watch_kv("r", on_layer)
    eng.add(seq)
    while eng.has_work():
        eng.step()
    assert calls == [(layer, end) for end in (8, 16, 21) for layer in range(n_layers)]
    for (layer, tokens), snap in snaps.items():  # already final when announced
        final = eng.pool.buffer[seq.page_table[: -(-tokens // 4)], layer]
        k = tokens % 4 or 4  # the last page's filled slots
        assert torch.equal(snap[:-1], final[:-1]) and torch.equal(snap[-1][:, :k], final[-1][:, :k])
    eng.release(seq, cache=False)
    assert "r" not in eng.kv_listeners  # released: no listener left behind


class _LayeredEngine:
    """One instant step that announces its 4 layers through the worker, then yields an event."""

    def __init__(self):
        self.worker = None
        self.left = 1
        self.t0 = None
        self.last_step_items = [(0, 8)]

    def pop_failed(self) -> list:
        return []  # (no sequence fails alone here)

    def has_work(self):
        return self.left > 0

    def step(self):
        self.left -= 1
        self.t0 = time.perf_counter()
        for layer in range(4):
            self.worker.layer_done(layer, 4, lambda layer=layer: self.news.append((layer, time.perf_counter())))
        return ["tok"]


@pytest.mark.parametrize("min_step_s", [0.0, 0.2])
async def test_layer_news_is_paced_over_the_emulated_step(min_step_s):
    loop = asyncio.get_running_loop()
    eng = _LayeredEngine()
    eng.news = []
    got = asyncio.Event()
    times = {}

    def on_events(ev):
        times["events"] = time.perf_counter()
        got.set()

    w = EngineWorker(eng, loop, on_events, min_step_s=min_step_s)
    eng.worker = w
    w.start()
    try:
        await asyncio.wait_for(got.wait(), 10)
        while len(eng.news) < 4:  # queued on the loop before the events: a few turns at most
            await asyncio.sleep(0)
    finally:
        w.stop()
    assert [layer for layer, _ in eng.news] == [0, 1, 2, 3]
    for layer, t in eng.news:  # lower bounds only: layer l is done a (l + 1) / 4 share into the step
        assert t - eng.t0 >= min_step_s * (layer + 1) / 4
        assert t <= times["events"] or min_step_s == 0.0
