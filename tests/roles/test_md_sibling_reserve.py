"""MD's ``reserve {after}`` (a sibling choice, pdd.policy.siblings) waits for the first choice's
KV whatever order the two reservations are handled in: one that comes while the first choice's
own reservation is still being admitted (its reply not sent) waits for that KV too, instead of
finding the first choice "not held" and reserving with nothing cached. The real MD role
(datacenter B, no security), a gateway connection and a P stream; the order is forced (both
reservations sent back to back on one connection), not raced."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from pdd.transfer.client import connect
from pdd.types import SamplingParams
from tests.roles.md_tiny import PROMPT, send_prompt_kv, start_md

SP = SamplingParams(max_tokens=2, ignore_eos=True).to_dict()


@contextlib.asynccontextmanager
async def md_and_gateway(tiny_model):
    """``(inst, gw, p)``: the MD, a gateway connection to it, and ``p.connect()`` opening P's
    (closed with the rest on exit)."""
    _, inst = await start_md(tiny_model)
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: None}, role="gateway", instance="gateway")
    opened = []

    async def p_connect():
        opened.append(await connect("127.0.0.1", inst.server.port, role="prefill", instance="p0"))
        return opened[-1]

    try:
        yield inst, gw, p_connect
    finally:
        for p in opened:
            await p.close()
        await gw.close()
        await inst.stop()


async def test_a_sibling_reserve_sent_beside_the_first_waits_for_its_kv(tiny_model):
    async with md_and_gateway(tiny_model) as (inst, gw, p_connect):
        first = asyncio.ensure_future(gw.call({"t": "reserve", "rid": "c0", "prompt_ids": PROMPT, "sampling": SP}))
        sib = asyncio.ensure_future(gw.call({"t": "reserve", "rid": "c1", "prompt_ids": PROMPT, "sampling": SP,
                                             "after": "c0"}))
        r0, _ = await first
        assert r0["md_cached_pages"] == 0 and r0["n_pages"] == 5
        assert not sib.done()  # c0's KV has not arrived: c1 waits for it
        p = await p_connect()
        send_prompt_kv(p, inst, "c0", r0["page_bytes"])
        r1, _ = await asyncio.wait_for(sib, 30)
        assert (r1["md_cached_tokens"], r1["md_cached_pages"]) == (16, 4)  # c0's whole pages, from the DRC


async def test_a_reserve_after_one_that_is_itself_waiting_waits_for_its_kv(tiny_model):
    """A chain (the gateway's claim waits: each turn of a conversation reserves after the one whose
    KV brings its prefix): c2's ``reserve {after: c1}`` comes while c1's own ``reserve {after:
    c0}`` waits for c0's KV. c1 counts as held then, so c2 waits for c1's KV (or for c1 to go)
    instead of reserving at once with nothing cached."""
    async with md_and_gateway(tiny_model) as (inst, gw, p_connect):
        first = asyncio.ensure_future(gw.call({"t": "reserve", "rid": "c0", "prompt_ids": PROMPT, "sampling": SP}))
        c1 = asyncio.ensure_future(gw.call({"t": "reserve", "rid": "c1", "prompt_ids": PROMPT, "sampling": SP,
                                            "after": "c0"}))
        c2 = asyncio.ensure_future(gw.call({"t": "reserve", "rid": "c2", "prompt_ids": PROMPT, "sampling": SP,
                                            "after": "c1"}))
        # one more reservation behind them on the connection: once it is answered, MD has handled both waits
        await gw.call({"t": "reserve", "rid": "x", "prompt_ids": [1, 2, 3], "sampling": SP})
        r0, _ = await first
        assert not c1.done() and not c2.done()
        p = await p_connect()
        send_prompt_kv(p, inst, "c0", r0["page_bytes"])
        r1, _ = await asyncio.wait_for(c1, 30)
        assert r1["md_cached_pages"] == 4
        assert not c2.done()  # c1's KV has not come: c2 still waits for it
        await gw.send({"t": "drop", "rid": "c1"})  # c1's transfer cut off: it goes, c2 goes on
        r2, _ = await asyncio.wait_for(c2, 30)
        assert r2["md_cached_pages"] == 4  # c0's whole pages, from the DRC


async def test_a_drop_while_a_reservation_waits_frees_it_when_it_would_be_admitted(tiny_model):
    """Found in review: a ``drop`` (the gateway gave MD's leg up: cut off, or its reserve call timed
    out) for a reservation still waiting on another request's KV found no request and was
    ignored; once that KV came the reservation was admitted and held its pages with nobody left
    to free them (the gateway drops again only when it still reads the reply). It is refused at
    admission now, and every page is free once the others end."""
    async with md_and_gateway(tiny_model) as (inst, gw, p_connect):
        free0 = inst.engine.pool.num_free
        r0, _ = await gw.call({"t": "reserve", "rid": "c0", "prompt_ids": PROMPT, "sampling": SP})
        c1 = asyncio.ensure_future(gw.call({"t": "reserve", "rid": "c1", "prompt_ids": PROMPT + [40, 41, 42, 43, 44],
                                            "sampling": SP, "after": "c0"}))
        # a reservation behind c1's on the connection: once answered, MD is in c1's wait
        await gw.call({"t": "reserve", "rid": "x", "prompt_ids": [1, 2, 3], "sampling": SP})
        await gw.send({"t": "drop", "rid": "c1"})
        await gw.call({"t": "abort", "rid": "x"})  # after the drop on the same connection: it was handled
        p = await p_connect()
        send_prompt_kv(p, inst, "c0", r0["page_bytes"])
        with pytest.raises(Exception, match="c1 was aborted"):
            await asyncio.wait_for(c1, 30)
        assert "c1" not in inst.reqs
        await gw.call({"t": "abort", "rid": "c0"})
        assert list(inst.reqs) == []
        await gw.call({"t": "flush"})
        assert inst.engine.pool.num_free == free0
