"""``pdd.stop_signals.stop_waiter``: the first stop signal is the one an instance or the link
reports (its exit status), whatever arrives after it."""

from __future__ import annotations

import asyncio
import os
import signal

from pdd.stop_signals import stop_waiter


async def test_the_first_stop_signal_is_kept_and_later_ones_are_ignored():
    loop = asyncio.get_running_loop()
    got = stop_waiter()
    try:
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert await asyncio.wait_for(got, timeout=60) == signal.SIGTERM
    finally:
        loop.remove_signal_handler(signal.SIGTERM)
        loop.remove_signal_handler(signal.SIGINT)
        loop.remove_signal_handler(signal.SIGHUP)
