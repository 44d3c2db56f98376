"""The signals that stop a pdd process cleanly: SIGTERM, SIGINT and SIGHUP (its terminal closed:
an ssh session ended, a terminal window shut), SIGHUP left alone when it was ignored at start
(``nohup``, a service manager that ignores it), so the process outlives its terminal as asked
(docs/SERVE.md "Stop it"). One place for the asyncio processes a topology runs: an engine
instance (``roles.base.serve_instance``), the gateway (``gateway.api.serve_gateway``) and the WAN
link (``transfer.link.serve_link``). Imports nothing of pdd."""

from __future__ import annotations

import asyncio
import signal
from typing import Callable

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)


def add_stop_handlers(loop: asyncio.AbstractEventLoop, on_stop: Callable[[int], None]) -> None:
    """Call ``on_stop(signum)`` on the event loop for each of :data:`STOP_SIGNALS` received, but a
    SIGHUP ignored when this is called (it stays ignored). Where the loop cannot take signal
    handlers (not the main thread, or a platform without them) nothing is installed."""
    for sig in STOP_SIGNALS:
        if sig == signal.SIGHUP and signal.getsignal(sig) is signal.SIG_IGN:
            continue
        try:
            loop.add_signal_handler(sig, on_stop, sig)
        except (NotImplementedError, RuntimeError):
            pass


def stop_waiter() -> "asyncio.Future[int]":
    """Install :func:`add_stop_handlers` on the running loop now and return a future holding the
    first stop signal's number once one arrives (later ones are ignored). Call it before
    printing a ``READY`` line, so a signal sent on READY stops the process cleanly."""
    loop = asyncio.get_running_loop()
    fut: asyncio.Future[int] = loop.create_future()

    def _first(sig: int) -> None:
        if not fut.done():
            fut.set_result(sig)

    add_stop_handlers(loop, _first)
    return fut
