"""EngineWorker.call_owned: a result created on the engine thread for a coroutine that was
cancelled meanwhile is undone there (found by a new user: MD and P frozen past the heartbeat
leaked the pages of the reservations their gateway connection had queued)."""

from __future__ import annotations

import asyncio
import threading

import pytest

from pdd.roles.worker import EngineWorker


class _Engine:
    def __init__(self):
        self.created: list[str] = []
        self.freed: list[str] = []

    def has_work(self) -> bool:
        return False


async def _start():
    eng = _Engine()
    w = EngineWorker(eng, asyncio.get_running_loop(), on_events=lambda ev: None)
    w.start()
    return eng, w


async def _settle(w: EngineWorker) -> None:
    for _ in range(3):  # the undo is queued from a done-callback: let it reach the thread and back
        await w.call(lambda e: None)
        await asyncio.sleep(0)


def _create(gate: threading.Event | None, name: str, running: threading.Event | None = None):
    def fn(e):
        if running is not None:
            running.set()
        if gate is not None:
            assert gate.wait(60)
        e.created.append(name)
        return name
    return fn


def _undo(e, name):
    e.freed.append(name)


async def test_cancelled_while_the_engine_thread_runs_it_is_undone():
    eng, w = await _start()
    try:
        gate, running = threading.Event(), threading.Event()
        task = asyncio.ensure_future(w.call_owned(_create(gate, "s1", running), _undo))
        assert await asyncio.to_thread(running.wait, 60)  # fn runs on the engine thread, blocked on the gate
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        gate.set()
        await _settle(w)
        assert eng.created == ["s1"] and eng.freed == ["s1"]
    finally:
        w.stop()


async def test_cancelled_after_the_result_arrived_but_before_the_caller_resumed_is_undone():
    """The engine thread's result is set, and the handler is cancelled in the same loop turn
    (before it resumes): asyncio then raises CancelledError at the await although the result
    exists. The worker's queue is replaced so the order is exact."""
    eng = _Engine()
    w = EngineWorker(eng, asyncio.get_running_loop(), on_events=lambda ev: None)
    first = asyncio.get_running_loop().create_future()
    calls: list = []

    def call(fn, overlap=False):
        calls.append(fn)
        if len(calls) == 1:
            return first  # the creation: resolved by hand below
        f = asyncio.get_running_loop().create_future()
        f.set_result(fn(eng))  # the undo: run at once on the fake engine
        return f

    w.call = call
    task = asyncio.ensure_future(w.call_owned(lambda e: "s2", _undo))
    await asyncio.sleep(0)  # the task is awaiting
    first.set_result("s2")
    task.cancel()  # same turn: the task has not resumed with the result
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(3):
        await asyncio.sleep(0)
    assert eng.freed == ["s2"] and len(calls) == 2


async def test_not_cancelled_nothing_is_undone_and_errors_propagate():
    eng, w = await _start()
    try:
        assert await w.call_owned(_create(None, "s3"), _undo) == "s3"

        def boom(e):
            raise ValueError("no pages")

        with pytest.raises(ValueError, match="no pages"):
            await w.call_owned(boom, _undo)
        await _settle(w)
        assert eng.created == ["s3"] and eng.freed == []
    finally:
        w.stop()


class _HeldEngine:
    """step() raises PagesHeld ``held`` times (pages held outside the batch), then succeeds."""

    def __init__(self, held: int):
        self.held, self.steps, self.released = held, 0, []
        self.seqs = {"s": object()}

    def pop_failed(self) -> list:
        return []  # (no sequence fails alone here)

    def has_work(self) -> bool:
        return self.steps < self.held + 1 and bool(self.seqs)

    def step(self):
        from pdd.engine.kv_pool import PagesHeld

        self.steps += 1
        if self.steps <= self.held:
            raise PagesHeld(1, 0, "s")
        return []

    def release(self, seq, cache=False):
        self.released.append(seq)
        self.seqs.clear()


@pytest.mark.parametrize("wait_s,failed", [(60.0, []), (0.0, ["s"])])
async def test_pages_held_outside_the_batch_are_waited_for_not_failed(wait_s, failed):
    """The engine thread waits (and keeps serving commands) while the pages a starved sequence
    needs are held by sequences outside the batch; only a wait past its limit fails it."""
    eng = _HeldEngine(held=5)
    got: list = []
    w = EngineWorker(eng, asyncio.get_running_loop(), on_events=lambda ev: None,
                     on_seq_failed=lambda sid, err: got.append(sid))
    w.pages_wait_s = wait_s
    w.start()
    try:
        assert await w.call(lambda e: "served") == "served"  # commands go on meanwhile
        # until the sequence stepped (waited through the PagesHeld) or failed: a condition, not a time
        for _ in range(60_000):
            if eng.steps > 5 or got:
                break
            await asyncio.sleep(0.001)
        await w.call(lambda e: None)  # the step that ended the wait has returned to the loop
    finally:
        w.stop()
    assert got == failed
    if not failed:
        assert eng.steps == 6 and eng.released == []  # waited through 5 PagesHeld, then stepped
