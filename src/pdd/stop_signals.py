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
