"""A client that goes away before its first byte: the start of its request is aborted on every tier.

An HTTP request's choices start (``Orchestrator.start_request``: RLD's and MD's reservations,
P's prefill up to the first token) before anything is written to the client, so neither
Starlette's streaming response nor the non-streamed ``collect`` watch is there yet to see a
disconnect. :func:`unless_gone` watches the connection (the ASGI receive channel's
``http.disconnect``) while the start runs; if the client goes first, every choice being started
is aborted with ``ABORT_CLIENT`` (``Orchestrator.abort``: counted cancelled once, dropped by
every tier that holds it, P at its next prefill chunk boundary, its WAN plan written off when P
never streamed it), the start then fails at once (P refuses an aborted prefill) and
:class:`ClientGone` answers 499 to nobody. ``policy.cancel_on_disconnect: false`` turns the
watch off (the baseline of ``scripts/bench_cancel.py``: the start runs to P's first token, and
the disconnect is only seen once the response begins).

The same abort, with its own reason, stops the other choices of a request one of whose choices a
tier refused while starting (``ABORT_REJECTED``) or that failed (``ABORT_FAILED``):
:func:`abort_starting`.
"""

from __future__ import annotations

import asyncio
import logging
from typing import Awaitable, Callable, Iterable, TypeVar

from pdd.gateway.openai_schemas import ApiError

log = logging.getLogger(__name__)

T = TypeVar("T")

_BACKGROUND: set = set()  # strong refs to the abort tasks


class ClientGone(ApiError):
    """HTTP 499: the client disconnected before the response began (nobody reads it)."""

    def __init__(self):
        super().__init__("client disconnected", None, status=499, code="client_disconnected")


async def client_gone(request) -> None:
    """Return once the client has disconnected: the ASGI receive channel yields
    ``{"type": "http.disconnect"}`` (the body was read already, so nothing else is pending). A
    receive channel that fails stops the watch (never returns): a request is aborted only when
    its client is known to be gone."""
    try:
        while True:
            msg = await request.receive()
            if msg.get("type") == "http.disconnect":
                return
    except Exception as e:  # noqa: BLE001
        log.debug("not watching for the client's disconnect: %r", e)
    await asyncio.Event().wait()


def abort_starting(orch, rids: Iterable[str], reason: str) -> int:
    """Abort (``orch.abort(st, reason)``, in tasks of their own) every live request of ``orch``
    whose rid is in ``rids``, wherever it is (starting or streaming); returns how many. A
    request already ended is left alone (its outcome stays the first one counted)."""
    want = set(rids)
    n = 0
    for st in list(getattr(orch, "reqs", {}).values()):
        if st.rid in want and not st.finished:
            task = asyncio.get_running_loop().create_task(orch.abort(st, reason))
            _BACKGROUND.add(task)
            task.add_done_callback(_BACKGROUND.discard)
            n += 1
    return n


async def unless_gone(request, starting: Awaitable[T], on_gone: Callable[[], None], enabled: bool = True) -> T:
    """Await ``starting`` (the start of an HTTP request's choices) while watching ``request``'s
    connection. The client disconnecting first: ``on_gone()`` (abort every choice being started,
    :func:`abort_starting`), then wait for the start to end (it fails fast once aborted; its
    result or error is dropped), ``on_gone()`` again (a choice that started meanwhile) and
    raise :class:`ClientGone`. ``enabled`` False or no
    ``request``: plain ``await starting``. Raises what ``starting`` raises otherwise; the
    handler cancelled meanwhile aborts the start too and re-raises CancelledError."""
    if not enabled or request is None:
        return await starting
    loop = asyncio.get_running_loop()
    task = asyncio.ensure_future(starting)
    watch = loop.create_task(client_gone(request))
    try:
        await asyncio.wait((task, watch), return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        on_gone()
        task.add_done_callback(lambda f: f.cancelled() or f.exception())  # retrieved: no warning
        raise
    finally:
        gone = watch.done() and not watch.cancelled()
        if not watch.done():
            watch.cancel()
        await asyncio.gather(watch, return_exceptions=True)
    if not gone:
        return task.result()
    on_gone()  # the client went away while its request was starting (or just as it started)
    await asyncio.gather(task, return_exceptions=True)
    on_gone()  # and whatever started meanwhile (idempotent)
    raise ClientGone()
