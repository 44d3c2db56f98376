"""EngineWorker emulating a chip's cost curve (an engine tier's ``profile``): each forward pass
is held to the time ``step_time_s`` predicts for its batch (``Engine.last_step_items``), and to
at least ``min_step_s``. Lower bounds only (a sleep never ends early)."""

from __future__ import annotations

import time

from pdd.step_profile import load_step_model
from tests.engine.worker_harness import run_worker


class _Engine:
    """Instant steps over given batches ((cached, new) tokens per item), one event each."""

    def __init__(self, batches):
        self.batches = list(batches)
        self.started: list[float] = []
        self.last_step_items: list = []

    def pop_failed(self) -> list:
        return []  # (no sequence fails alone here)

    def has_work(self) -> bool:
        return bool(self.batches)

    def step(self) -> list:
        self.started.append(time.perf_counter())
        self.last_step_items = self.batches.pop(0)
        return [len(self.started)]


async def _run(batches, step_time_s, min_step_s=0.0):
    """Each batch's event release time (one event a step), with the engine and the worker."""
    eng = _Engine(batches)
    w, got = await run_worker(eng, len(eng.batches), min_step_s=min_step_s, step_time_s=step_time_s)
    return eng, w, [t for _, t in got]


async def test_each_step_is_held_to_the_time_predicted_for_its_batch():
    seen = []

    def predict(items):
        seen.append(list(items))
        return 0.01 * sum(n for _, n in items)  # 10 ms per new token

    batches = [[(0, 8)], [(8, 1), (30, 1)], [(0, 3)]]
    eng, w, got = await _run(batches, predict)
    assert seen == batches
    for t_ev, t0, want in zip(got, eng.started, (0.08, 0.02, 0.03)):
        assert t_ev - t0 >= want
    assert w.steps == 3 and w.held_s > 0


async def test_the_floor_still_holds_under_a_cheaper_prediction():
    eng, w, got = await _run([[(0, 1)]], lambda items: 0.001, min_step_s=0.05)
    assert got[0] - eng.started[0] >= 0.05


def test_a_measured_profile_predicts_more_for_a_longer_prefill():
    m = load_step_model("data/profiles/this-machine.json")
    short, long_ = m.step_time([(0, 16)]), m.step_time([(0, 512)])
    assert 0 < short < long_
