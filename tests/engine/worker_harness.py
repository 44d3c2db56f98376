"""Runs an ``EngineWorker`` over a fake engine until its events are in (the worker tests)."""

from __future__ import annotations

import asyncio
import time

from pdd.roles.worker import EngineWorker


async def run_worker(eng, n_events: int, **worker_kw) -> tuple[EngineWorker, list[tuple[object, float]]]:
    """Starts an ``EngineWorker(eng, loop, on_events, **worker_kw)``, waits (10 s at most, else
    ``asyncio.TimeoutError``) until ``n_events`` events have been released, stops it; returns
    the worker and each event with the ``time.perf_counter()`` it was released at."""
    got: list[tuple[object, float]] = []
    done = asyncio.Event()

    def on_events(ev):
        got.extend((e, time.perf_counter()) for e in ev)
        if len(got) == n_events:
            done.set()

    w = EngineWorker(eng, asyncio.get_running_loop(), on_events, **worker_kw)
    w.start()
    try:
        await asyncio.wait_for(done.wait(), 10)
    finally:
        w.stop()
    return w, got
