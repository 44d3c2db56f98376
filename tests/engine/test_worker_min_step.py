"""EngineWorker's emulated accelerator step (``EngineConfig.min_step_ms``): a forward pass is held
until ``min_step_s`` after it started, and its token events are released only then. Lower bounds
only (a sleep never ends early); no upper bound is asserted on this shared machine."""

from __future__ import annotations

import asyncio
import time

from pdd.roles.worker import EngineWorker
from tests.engine.worker_harness import run_worker


class _Engine:
    """Three instant steps, each producing one event (its step index)."""

    def __init__(self, steps: int = 3):
        self.left = steps
        self.started: list[float] = []

    def pop_failed(self) -> list:
        return []  # (no sequence fails alone here)

    def has_work(self) -> bool:
        return self.left > 0

    def step(self) -> list:
        self.started.append(time.perf_counter())
        self.left -= 1
        return [len(self.started)]


async def _run(min_step_s: float):
    eng = _Engine()
    w, got = await run_worker(eng, 3, min_step_s=min_step_s)
    return eng, w, got


async def test_steps_are_held_to_the_minimum_and_events_released_after_it():
    eng, w, got = await _run(0.05)
    assert [e for e, _ in got] == [1, 2, 3]
    for (_, t_ev), t0 in zip(got, eng.started):
        assert t_ev - t0 >= 0.05  # released at the end of the emulated step
    for a, b in zip(eng.started, eng.started[1:]):
        assert b - a >= 0.05  # the next pass starts after the held one
    assert w.steps == 3 and w.held_s > 0 and w.busy_s >= 3 * 0.05


async def test_off_by_default_nothing_is_held():
    eng, w, got = await _run(0.0)
    assert [e for e, _ in got] == [1, 2, 3] and w.held_s == 0.0


class _Gated(_Engine):
    """One step whose events the test inspects, with commands submitted while it is held."""

    def __init__(self):
        super().__init__(steps=1)
        self.log: list[str] = []

    def step(self) -> list:
        self.log.append("step")
        return super().step()


async def test_overlap_commands_run_during_the_hold_others_after_it_in_order():
    loop = asyncio.get_running_loop()
    eng = _Gated()
    released = asyncio.Event()
    w = EngineWorker(eng, loop, lambda ev: (eng.log.append("events"), released.set()), min_step_s=0.3)
    w.start()
    try:
        while not eng.started:  # the step has run; the worker now holds it for 0.3 s
            await asyncio.sleep(0.001)
        a = w.call(lambda e: e.log.append("admit") or "a", overlap=True)
        assert await asyncio.wait_for(a, 5) == "a"
        assert not released.is_set()  # ran inside the hold, before the step's events
        b = w.call(lambda e: e.log.append("take") or "b")  # reads outputs: after the step
        c = w.call(lambda e: e.log.append("admit2") or "c", overlap=True)  # behind b: after it
        assert await asyncio.wait_for(b, 5) == "b" and await asyncio.wait_for(c, 5) == "c"
        await asyncio.wait_for(released.wait(), 5)
        assert eng.log.index("admit") < eng.log.index("take") < eng.log.index("admit2")
        assert eng.log[:2] == ["step", "admit"]
        assert time.perf_counter() - eng.started[0] >= 0.3
    finally:
        w.stop()


async def test_a_command_run_after_the_hold_that_adds_work_does_not_wait_for_more_commands():
    """A held step's engine had no more work; a command kept for after the hold adds some. The
    worker must step at once, not block on an empty queue (it waited up to 50 ms: new user)."""
    loop = asyncio.get_running_loop()
    eng = _Gated()
    log = eng.log
    w = EngineWorker(eng, loop, lambda ev: None, min_step_s=0.2)
    class _LoggedQueue:
        def __init__(self, q):
            self.q = q

        def put(self, item):
            self.q.put(item)

        def get(self, block=True, timeout=None):
            log.append(f"get block={bool(block)}")
            return self.q.get(block, timeout)

    w._cmds = _LoggedQueue(w._cmds)
    w.start()
    try:
        while not eng.started:
            await asyncio.sleep(0.001)

        def add_work(e):
            e.log.append("add")
            e.left = 1

        await asyncio.wait_for(w.call(add_work), 5)  # not overlap: kept until the hold ends
        while len(eng.started) < 2:
            await asyncio.sleep(0.001)
    finally:
        w.stop()
    i = log.index("add")
    assert "get block=True" not in log[i + 1: log.index("step", i)], log  # no blocking wait before the step
