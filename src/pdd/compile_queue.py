"""The grammar compiler's queue: one thread with a large stack that runs the highest response ratio next.

Structured outputs compile on a thread of their own (``pdd.structured.compiler``): llguidance
compiles recursively and needs a 256 MiB stack, and llguidance's GBNF -> Lark conversion is
Python, so more threads would share one interpreter lock and finish no sooner. In arrival order a
small regex sent behind several clients' new large grammars waits for all of them (four clients'
26.7 KB GBNF grammars: seconds; ``scripts/compile_queue.py``), and compiles whose clients have
gone hold the thread as long.

:class:`CompileQueue` runs the queued job of the highest response ratio next, ``(waited +
cost) / cost`` (highest response ratio next, HRRN: Brinch Hansen, 1971),
ties in arrival order: a small job that has waited even a little overtakes large ones queued
before it, so it waits for little more than the compile running; a large job's ratio grows as it
waits and a new arrival starts at 1, so no job is overtaken for ever. A job cancelled before it
starts (``Future.cancel()``, as the gateway does when its client disconnects) never runs. With
equal costs the order is arrival order.

This module imports neither torch nor anything of pdd's runtime.
"""

from __future__ import annotations

import itertools
import threading
import time
from concurrent.futures import Executor, Future
from typing import Callable


MIN_COST_S = 0.001  # a job's cost estimate is at least this (seconds): the ratio's divisor


def next_job(queued: list[tuple[float, float]], now: float) -> int:
    """Index of the job to run next of ``queued`` (``(submit time s, cost estimate s)`` each, in
    arrival order) at ``now`` (s): the highest response ratio ``(now - submit + cost) / cost``,
    the earliest arrival of those tied; a cost below :data:`MIN_COST_S` counts as it. Pure.
    Raises ``ValueError`` for an empty ``queued``."""
    if not queued:
        raise ValueError("no job queued")
    best, best_ratio = 0, -1.0
    for i, (submit_s, cost_s) in enumerate(queued):
        c = max(MIN_COST_S, cost_s)
        ratio = (now - submit_s + c) / c
        if ratio > best_ratio:
            best, best_ratio = i, ratio
    return best


class CompileQueue(Executor):
    """An :class:`concurrent.futures.Executor` of ``threads`` threads, each started with a
    ``stack_bytes`` stack and named ``{name}_{i}``, that runs the queued job :func:`next_job`
    picks (each job's cost estimate from :meth:`submit_costed`; 0, i.e. :data:`MIN_COST_S`, for
    :meth:`submit`). ``clock``: monotonic seconds (tests pass their own). The threads are daemon
    threads; :meth:`shutdown` stops them after the jobs queued. Raises ``RuntimeError`` on a
    submit after shutdown, ``ValueError`` for ``threads`` < 1."""

    def __init__(self, threads: int = 1, stack_bytes: int = 0, name: str = "grammar-compile",
                 clock: Callable[[], float] = time.monotonic):
        if threads < 1:
            raise ValueError(f"threads must be >= 1, not {threads}")
        self._clock = clock
        self._queue: list = []  # [submit s, cost s, future, fn, args, kwargs], in arrival order
        self._cv = threading.Condition()
        self._closed = False
        self._threads = []
        old = threading.stack_size(stack_bytes) if stack_bytes else None
        try:
            for i in range(threads):
                t = threading.Thread(target=self._work, name=f"{name}_{i}", daemon=True)
                t.start()  # the stack size applies to threads started while it is set
                self._threads.append(t)
        finally:
            if old is not None:
                threading.stack_size(old)

    def submit(self, fn, /, *args, **kwargs) -> Future:
        """``fn(*args, **kwargs)`` at cost 0: :meth:`submit_costed`."""
        return self.submit_costed(0.0, fn, *args, **kwargs)

    def submit_costed(self, cost_s: float, fn, /, *args, **kwargs) -> Future:
        """Queue ``fn(*args, **kwargs)`` whose run is estimated at ``cost_s`` seconds; returns its
        Future. Raises ``RuntimeError`` after :meth:`shutdown`."""
        f: Future = Future()
        with self._cv:
            if self._closed:
                raise RuntimeError("cannot submit to a CompileQueue that was shut down")
            self._queue.append((self._clock(), float(cost_s), f, fn, args, kwargs))
            self._cv.notify()
        return f

    def pending(self) -> int:
        """Jobs queued and not started, cancelled ones not counted."""
        with self._cv:
            return sum(not item[2].cancelled() for item in self._queue)

    def shutdown(self, wait: bool = True, *, cancel_futures: bool = False) -> None:
        """Refuse new jobs; the threads end once the queue is empty (``cancel_futures``: the
        queued jobs are cancelled first). ``wait``: return once they have ended."""
        with self._cv:
            self._closed = True
            if cancel_futures:
                for item in self._queue:
                    item[2].cancel()
            self._cv.notify_all()
        if wait:
            for t in self._threads:
                if t is not threading.current_thread():
                    t.join()

    def _work(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._closed:
                    self._cv.wait()
                if not self._queue:
                    return
                self._queue = [item for item in self._queue if not item[2].cancelled()]
                if not self._queue:  # all cancelled: wait again (or end)
                    continue
                i = next_job([(item[0], item[1]) for item in self._queue], self._clock())
                _, _, f, fn, args, kwargs = self._queue.pop(i)
            if not f.set_running_or_notify_cancel():  # cancelled while queued: never run
                continue
            try:
                result = fn(*args, **kwargs)
            except BaseException as e:  # noqa: BLE001 - the caller's future carries it
                f.set_exception(e)
            else:
                f.set_result(result)
            del f, fn, args, kwargs
