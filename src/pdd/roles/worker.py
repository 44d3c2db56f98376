"""Runs an :class:`~pdd.engine.engine.Engine` on its own thread beside an asyncio event loop.

The engine's state (running sequences, page tables, radix cache) is only ever touched on the
engine thread: the event loop hands it work with :meth:`EngineWorker.call`, which runs a
function between two forward passes and returns its result as an awaitable. Token events of
each forward pass are handed back to the loop with ``call_soon_threadsafe``. So networking
(KV frames, token streams) goes on while a forward pass runs, and no lock is needed.
"""

from __future__ import annotations

import asyncio
import logging
import queue
import threading
from collections import deque
from typing import Any, Callable

log = logging.getLogger(__name__)

PAGES_POLL_S = 0.005  # engine thread's retry interval while the pages it needs are held outside its batch
PAGES_WAIT_S = 60.0  # longest such wait before the starved sequence fails with OutOfPages


class EngineWorker:
    """Owns the engine thread.

    ``on_events(events)`` runs on the event loop after every forward pass that produced
    token events (a list of ``TokenEvent``). ``on_seq_failed(seq_id, error)`` runs there for a
    sequence a step failed (released here already); ``on_seq_failed(seq_id, error, True)`` when
    the failure is the request's own (``Engine.pop_failed``: a client error, the gateway's 400).
    The engine has ``pop_failed()``.

    ``min_step_s`` (seconds, 0 = off) emulates an accelerator's step time: a forward pass that
    finishes sooner is held until that long after it started, and only then are its token events
    released, as a GPU's step would return (``EngineConfig.min_step_ms``). While a step is held,
    commands submitted with ``overlap=True`` run at once: admission-type work (a new sequence,
    its pages, a KV import, adding a sequence to the next batch, releasing one that is out of the
    batch, a radix insert or peek) that a production scheduler does on the CPU while the GPU
    computes (SGLang's overlap scheduler). A command that reads or stops a sequence's outputs (a
    handoff's ids, releasing a sequence still in the batch) keeps the default and waits for the
    step's end, when its outputs exist; so do all commands behind it, so commands still run in
    submission order. The held time counts in ``busy_s`` and
    ``last_step_s`` (the emulated device is busy).

    ``step_time_s(items) -> seconds`` (None = off) emulates a whole chip's cost curve: each forward
    pass is held the same way to the time it predicts for the step's batch, ``items`` being
    ``(cached tokens, new tokens)`` per sequence (``Engine.last_step_items``; an engine tier's
    ``profile``: ``pdd.step_profile.MeasuredStepModel.step_time``), and to at least ``min_step_s``.
    """

    def __init__(self, engine, loop: asyncio.AbstractEventLoop, on_events: Callable[[list], None],
                 on_seq_failed: Callable[..., None] | None = None, min_step_s: float = 0.0,
                 step_time_s: Callable[[list], float] | None = None):
        self.engine = engine
        self.loop = loop
        self.on_events = on_events
        self.on_seq_failed = on_seq_failed
        self._cmds: queue.SimpleQueue = queue.SimpleQueue()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="engine", daemon=True)
        self.steps = 0
        self.busy_s = 0.0
        self.last_step_s = 0.0
        self.recent_steps_s: deque[float] = deque(maxlen=64)
        self.pages_wait_s = PAGES_WAIT_S
        self.min_step_s = float(min_step_s)
        self.step_time_s = step_time_s
        self.held_s = 0.0  # time steps were held to min_step_s (seconds)
        self._pending: deque = deque()  # commands taken off the queue during a hold, run after it
        self._step_t0 = 0.0  # perf_counter at the start of the step in flight
        self._step_floor: float | None = None  # its emulated time (s), computed on first need
        self._layer_due: list = []  # (due perf_counter, fn): layer news held to the emulated step's pace

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._cmds.put(None)
        self._thread.join(timeout=5)

    def call(self, fn: Callable[[Any], Any], overlap: bool = False) -> "asyncio.Future[Any]":
        """Run ``fn(engine)`` on the engine thread; the returned future resolves on the loop.

        Exceptions raised by ``fn`` are set on the future. ``overlap``: ``fn`` may run while a
        step is held to ``min_step_s`` (it does not read outputs of the step in flight).
        """
        fut = self.loop.create_future()
        self._cmds.put((fn, fut, overlap))
        return fut

    async def call_owned(self, fn: Callable[[Any], Any], undo: Callable[[Any, Any], Any],
                         overlap: bool = False) -> Any:
        """``await call(fn)`` for a result that owns engine resources (a new sequence and its
        pages): if the awaiting coroutine is cancelled before it has the result (its peer's
        connection closed, and the RPC layer cancelled the handler), ``fn`` still runs on the
        engine thread, and ``undo(engine, result)`` then runs there too, so nothing is left
        allocated with no owner. That holds whether the cancellation comes before or after the
        engine thread finished ``fn``. Raises what ``fn`` raised, or CancelledError."""
        fut = self.call(fn, overlap)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            def _undo(f: asyncio.Future) -> None:
                if f.cancelled() or f.exception() is not None:
                    return  # nothing was created (the exception is retrieved: no warning)
                res = f.result()
                self.call(lambda e: undo(e, res)).add_done_callback(_log_undo_failure)

            fut.add_done_callback(_undo)  # at once (next loop turn) when fn already finished
            raise

    def layer_done(self, layer: int, num_layers: int, fn: Callable[[], Any]) -> None:
        """Engine thread, inside a forward pass (``Engine.kv_listeners``): run ``fn()`` on the loop
        once layer ``layer`` of ``num_layers`` of this step is done. Without step emulation that
        is now. With ``min_step_s`` / ``step_time_s`` the emulated device spends the step's time
        evenly over its layers: ``fn`` runs at ``step start + floor * (layer + 1) / num_layers``
        (seconds; the last layer's at the step's end, with its tokens), never before the real
        compute wrote the layer."""
        import time

        if self._step_floor is None:
            floor = self.min_step_s
            if self.step_time_s is not None:
                items = getattr(self.engine, "last_step_items", None)
                if items:
                    floor = max(floor, float(self.step_time_s(items)))
            self._step_floor = floor
        due = self._step_t0 + self._step_floor * (layer + 1) / max(1, num_layers)
        if self._step_floor <= 0 or due <= time.perf_counter():
            self.loop.call_soon_threadsafe(fn)
        else:
            self._layer_due.append((due, fn))

    def _release_layers(self, now: float | None) -> None:
        """Hand the held layer news due by ``now`` (perf_counter; None: all) to the loop."""
        if not self._layer_due:
            return
        keep = []
        for due, fn in self._layer_due:
            if now is None or due <= now:
                self.loop.call_soon_threadsafe(fn)
            else:
                keep.append((due, fn))
        self._layer_due = keep

    def _resolve(self, fut: asyncio.Future, ok: bool, value: Any) -> None:
        if fut.cancelled():
            return
        if ok:
            fut.set_result(value)
        else:
            fut.set_exception(value)

    def _exec(self, item: tuple) -> None:
        fn, fut, _ = item
        try:
            res = fn(self.engine)
            self.loop.call_soon_threadsafe(self._resolve, fut, True, res)
        except BaseException as e:  # delivered to the awaiting coroutine
            self.loop.call_soon_threadsafe(self._resolve, fut, False, e)

    def _drain(self, block: bool) -> None:
        while self._pending:  # taken off the queue during the last hold, in order
            item = self._pending.popleft()
            if item is None:
                return
            self._exec(item)
            block = False  # it may have added work: the next step must not wait for more commands
        while True:
            try:
                item = self._cmds.get(block=block, timeout=0.05 if block else None)
            except queue.Empty:
                return
            block = False
            if item is None:
                return
            self._exec(item)

    def _hold(self, until: float) -> None:
        """Hold the step until ``until`` (``time.perf_counter()``), running ``overlap`` commands
        meanwhile; the first other command (or the stop sentinel) is kept for after the hold."""
        import time

        while not self._stop.is_set():
            now = time.perf_counter()
            self._release_layers(now)
            rem = until - now
            if rem <= 0:
                return
            if self._layer_due:  # wake for the next layer's news too
                rem = min(rem, max(0.0, min(d for d, _ in self._layer_due) - now))
            if self._pending:  # a command waits for the step's end: nothing runs before it
                self._stop.wait(rem)
                continue
            try:
                item = self._cmds.get(timeout=rem)
            except queue.Empty:
                continue
            if item is not None and item[2]:
                self._exec(item)
            else:
                self._pending.append(item)

    def _run(self) -> None:
        import time

        from pdd.engine.kv_pool import PagesHeld

        held_since = None  # when the engine started waiting for pages held outside its batch
        while not self._stop.is_set():
            has_work = self.engine.has_work()
            self._drain(block=not has_work)
            if self._stop.is_set() or not self.engine.has_work():
                continue
            t0 = time.perf_counter()
            self._step_t0, self._step_floor = t0, None
            try:
                events = self.engine.step()
                held_since = None
            except PagesHeld as e:
                # pages come back when a sequence outside the batch runs or is released: wait for
                # them (commands keep being served) instead of failing a request after its work
                held_since = held_since if held_since is not None else t0
                if t0 - held_since < self.pages_wait_s:
                    self._stop.wait(PAGES_POLL_S)
                    continue
                held_since = None
                events = []
                self._fail_step(e)
            except Exception as e:
                events = []
                self._fail_step(e)
            dt = time.perf_counter() - t0
            floor = self.min_step_s
            if self.step_time_s is not None:
                items = getattr(self.engine, "last_step_items", None)
                if items:
                    floor = max(floor, float(self.step_time_s(items)))
            if dt < floor:
                self._hold(t0 + floor)
                held = time.perf_counter() - t0 - dt  # overlap work may run past the deadline
                self.held_s += held
                dt += held
            self._release_layers(None)  # the step is over: every layer's news is due
            self.busy_s += dt
            self.last_step_s = dt
            self.recent_steps_s.append(dt)
            self.steps += 1
            if events:
                self.loop.call_soon_threadsafe(self.on_events, events)
            for seq, why in self.engine.pop_failed():
                self._fail_seq(seq, why)  # failed alone (a structured output's grammar)

    def _fail_seq(self, seq, why: str) -> None:
        """Release ``seq`` (out of the engine's batch already) and fail its request with ``why``,
        as the client's (``on_seq_failed(seq_id, why, True)``: ``Engine.pop_failed`` holds only
        a request's own failures)."""
        log.warning("request %s failed: %s", seq.seq_id, why)
        self.engine.release(seq, cache=False)
        if self.on_seq_failed is not None:
            self.loop.call_soon_threadsafe(self.on_seq_failed, seq.seq_id, why, True)

    def _fail_step(self, e: Exception) -> None:
        """A step that raised fails the sequence it names (OutOfPages carries ``seq_id``), or
        every running sequence otherwise, so the loop never spins on the same error."""
        seq_id = getattr(e, "seq_id", None)
        victims = [seq_id] if seq_id is not None and seq_id in self.engine.seqs else list(self.engine.seqs)
        log.error("engine step failed (%s: %s); failing %d request(s)", type(e).__name__, e, len(victims))
        for sid in victims:
            seq = self.engine.seqs.get(sid)
            if seq is None:
                continue
            self.engine.release(seq, cache=False)
            if self.on_seq_failed is not None:
                self.loop.call_soon_threadsafe(self.on_seq_failed, sid, f"{type(e).__name__}: {e}")


def log_failure_of(what: str):
    """A done-callback that logs the exception of a future nobody awaits (``what`` failed)."""

    def done(f: asyncio.Future) -> None:
        if not f.cancelled() and f.exception() is not None:
            log.error("%s failed: %r", what, f.exception())
    return done


_log_undo_failure = log_failure_of("freeing the result of a cancelled engine call")
