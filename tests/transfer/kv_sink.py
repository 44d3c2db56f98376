"""The receiving end the KV stream tests share: a ``KVReceiver``'s close callbacks and a wait on
its events (never on time). Each test module adds its own ``on_pages``."""

from __future__ import annotations

import asyncio


class EventSink:
    """``done``: the ``kv_done`` header once it arrived; ``cancelled``: a ``kv_cancel`` arrived;
    ``changed``: set on every receiver event. ``wait_s``: how long :meth:`until` waits."""

    wait_s = 10.0

    def __init__(self):
        self.done: dict | None = None
        self.cancelled = False
        self.changed = asyncio.Event()

    def on_done(self, rid, h):
        self.done = h
        self.changed.set()

    def on_cancel(self, rid):
        self.cancelled = True
        self.changed.set()

    async def until(self, pred) -> None:
        """Wait for the receiver's next events until ``pred()`` holds (``asyncio.TimeoutError``
        after ``wait_s`` seconds: a hung sender fails)."""
        async def loop():
            while not pred():
                self.changed.clear()
                await self.changed.wait()
        await asyncio.wait_for(loop(), self.wait_s)
