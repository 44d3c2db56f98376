"""Layer-wise KV streaming on the sender (``KVSender.submit_layered``, ``LayerProgress``).

A 4-layer request of 14 tokens in pages of 4 (3 whole pages and a partial one of 2 slots); the
receiver lacks pages 1..3 (it holds page 0). Per layer a token slot is 10 bytes, so one page of
one layer is 40 bytes, and the whole transfer is (14 - 4) x 4 x 10 = 400 bytes, the same as a
whole-mode transfer of those pages (``prompt_kv_bytes``). The tests wait on the receiver's
frames (events), never on time.
"""

from __future__ import annotations

import asyncio

import pytest

from pdd.transfer.kv import KVReceiver, KVSender, LayerProgress, layer_groups, prompt_kv_bytes
from pdd.transfer.client import connect
from pdd.transfer.server import Server
from tests.transfer.kv_sink import EventSink

LAYERS, PT, PROMPT, SLOT_L = 4, 4, 14, 10  # layers, tokens per page, prompt tokens, bytes per slot per layer
FIRST, NPG = 1, 3  # pages [1, 4) cross
LAST_SLOTS = PROMPT % PT  # 2
WHOLE_BYTES = prompt_kv_bytes(PROMPT, FIRST, PT, LAYERS * SLOT_L * PT)  # 400


def slot_bytes(page: int, slot: int, layer: int) -> bytes:
    return bytes([page, slot, layer]) + bytes(SLOT_L - 3)


def read(i: int, n: int, layers) -> bytes:
    """Pages [i, i+n) for layers [l0, l1): [page, layer, slot] order, the prompt's last page to its
    filled slots only."""
    out = b""
    for p in range(i, i + n):
        k = LAST_SLOTS if p == FIRST + NPG - 1 else PT
        for layer in range(*layers):
            out += b"".join(slot_bytes(p, s, layer) for s in range(k))
    return out


class Sink(EventSink):
    wait_s = 5.0  # until(): a hung sender fails after 5 s

    def __init__(self):
        super().__init__()
        self.frames: list = []  # (first_page, n, layers, payload)
        self.rids: list = []  # the request of each frame

    def on_pages(self, rid, first, n, layers, payload):
        self.frames.append((first, n, layers, bytes(payload)))
        self.rids.append(rid)
        self.changed.set()

    def bytes(self) -> int:
        return sum(len(f[3]) for f in self.frames)


async def _pair():
    sink = Sink()
    recv = KVReceiver(sink.on_pages, sink.on_done, sink.on_cancel)
    server = Server("127.0.0.1", 0, recv.handlers())
    await server.start()
    peer = await connect("127.0.0.1", server.port)
    return sink, server, peer


def _submit(snd: KVSender, prog: LayerProgress, group: int = 1, chunk_pages: int | None = None):
    groups = layer_groups(LAYERS, group)
    return snd.submit_layered("r", FIRST, read, NPG, prog, groups, [(l1 - l0) * SLOT_L * PT for l0, l1 in groups],
                              PT, last_slots=LAST_SLOTS, chunk_pages=chunk_pages, done_fields={"relay": True})


def test_layer_groups():
    assert layer_groups(4, 1) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    assert layer_groups(4, 3) == [(0, 3), (3, 4)]
    assert layer_groups(4, 8) == [(0, 4)]
    with pytest.raises(ValueError, match="layer group >= 1"):
        layer_groups(4, 0)


async def test_units_go_as_layers_are_computed_and_end_with_the_seal():
    sink, server, peer = await _pair()
    try:
        prog = LayerProgress(LAYERS, PROMPT, start_tokens=4)  # page 0 was cached before the prefill
        tr = _submit(KVSender(peer), prog)
        # chunk 1 (tokens [4, 8)) computes layer by layer: page 1 of each layer goes as it is done
        for layer in range(LAYERS):
            prog.advance(layer, 8)
            await sink.until(lambda: len(sink.frames) == layer + 1)
            assert sink.frames[-1][:3] == (1, 1, (layer, layer + 1))
        # chunk 2 (tokens [8, 14), the prompt's end): pages 2 and 3 (partial) of each layer
        for layer in range(LAYERS):
            prog.advance(layer, PROMPT)
        await sink.until(lambda: sink.bytes() == WHOLE_BYTES)
        assert [f[:3] for f in sink.frames[LAYERS:]] == [(2, 2, (layer, layer + 1)) for layer in range(LAYERS)]
        assert sink.done is None  # every byte is there, but the first token is not known yet
        prog.seal({"first_token": 42, "fin": None})
        res = await asyncio.wait_for(tr, 5)
        await sink.until(lambda: sink.done is not None)
        # the bytes are exactly whole mode's, and each (page, layer) is the sender's
        assert res.bytes_sent == tr.total_bytes == WHOLE_BYTES == 400 and not res.cancelled
        got = {}
        for first, n, (l0, l1), payload in sink.frames:
            assert payload == read(first, n, (l0, l1))
            for p in range(first, first + n):
                got[(p, l0)] = True
        assert sorted(got) == [(p, layer) for p in range(1, 4) for layer in range(LAYERS)]
        d = sink.done
        assert (d["first_token"], d["relay"], d["bytes"], d["first_page"], d["n_pages"], d["layers"]) == \
            (42, True, 400, 1, 3, [0, 4])
        assert d["page_bytes"] == LAYERS * SLOT_L * PT and d["last_page_bytes"] == LAYERS * SLOT_L * LAST_SLOTS
        assert d["kv_wait_s"] >= 0
    finally:
        await peer.close()
        await server.close()


async def test_groups_of_layers_and_frame_cap_keep_the_bytes():
    sink, server, peer = await _pair()
    try:
        prog = LayerProgress(LAYERS, PROMPT)
        tr = _submit(KVSender(peer, max_frame_bytes=130), prog, group=3)  # groups [0,3) and [3,4)
        for layer in range(LAYERS):
            prog.advance(layer, PROMPT)
        prog.seal({"first_token": 1})
        res = await asyncio.wait_for(tr, 5)
        await sink.until(lambda: sink.done is not None)
        assert res.bytes_sent == WHOLE_BYTES
        # a page of [0, 3) is 120 bytes: one page a frame; of [3, 4) 40 bytes: three pages a frame
        assert [f[:3] for f in sink.frames] == [(1, 1, (0, 3)), (2, 1, (0, 3)), (3, 1, (0, 3)), (1, 3, (3, 4))]
        assert [len(f[3]) for f in sink.frames] == [120, 120, 60, 100]
    finally:
        await peer.close()
        await server.close()


async def test_cancel_between_layer_groups_sends_kv_cancel_and_counts_exactly():
    sink, server, peer = await _pair()
    try:
        prog = LayerProgress(LAYERS, PROMPT)
        tr = _submit(KVSender(peer), prog)
        prog.advance(0, PROMPT)  # layer 0 computed for the whole prompt, layer 1 not yet
        await sink.until(lambda: sink.bytes() == 100)  # 40 + 40 + 2 slots x 10 of layer 0
        assert tr.cancel()
        res = await asyncio.wait_for(tr, 5)
        await sink.until(lambda: sink.cancelled)
        assert res.cancelled and res.bytes_sent == 100 and tr.total_bytes - res.bytes_sent == 300
        prog.advance(1, PROMPT)
        prog.seal({"first_token": 1})
        assert sink.done is None and sink.bytes() == 100  # nothing after the cancel
    finally:
        await peer.close()
        await server.close()


async def test_a_failed_prefill_cancels_the_transfer():
    sink, server, peer = await _pair()
    try:
        prog = LayerProgress(LAYERS, PROMPT)
        tr = _submit(KVSender(peer), prog)
        prog.advance(0, 8)
        await sink.until(lambda: len(sink.frames) == 1)
        prog.fail(RuntimeError("aborted"))
        res = await asyncio.wait_for(tr, 5)
        await sink.until(lambda: sink.cancelled)
        assert res.cancelled and res.bytes_sent == 40 and sink.done is None
    finally:
        await peer.close()
        await server.close()


async def test_a_waiting_layered_transfer_does_not_hold_up_another():
    """FIFO order: a transfer submitted later goes while the first waits for its layers."""
    sink, server, peer = await _pair()
    try:
        snd = KVSender(peer, order="fifo")
        prog = LayerProgress(LAYERS, PROMPT)
        tr = _submit(snd, prog)
        other = snd.submit("o", 0, lambda i, n: bytes(n * 8), 2, 8)
        res = await asyncio.wait_for(other, 5)
        assert res.bytes_sent == 16 and not tr.finished and tr.bytes_sent == 0
        prog.seal({})
        assert (await asyncio.wait_for(tr, 5)).bytes_sent == WHOLE_BYTES
    finally:
        await peer.close()
        await server.close()


async def test_a_finished_transfer_goes_before_a_running_prefills_units():
    """FIFO order, the layered transfer submitted first with every layer ready but its prefill not
    ended (no first token): the other request's KV, complete, goes first; the layered one's units
    follow (they filled the gap) and its kv_done waits for the seal."""
    sink, server, peer = await _pair()
    try:
        snd = KVSender(peer, order="fifo")
        prog = LayerProgress(LAYERS, PROMPT)
        for layer in range(LAYERS):
            prog.advance(layer, PROMPT)
        tr = _submit(snd, prog)
        other = snd.submit("o", 0, lambda i, n: bytes(n * 8), 2, 8, chunk_pages=1)
        await asyncio.wait_for(other, 5)
        await sink.until(lambda: sink.bytes() == 16 + WHOLE_BYTES)
        assert sink.rids == ["o", "o"] + ["r"] * LAYERS and sink.done is not None and sink.done["rid"] == "o"
        prog.seal({})
        assert (await asyncio.wait_for(tr, 5)).bytes_sent == WHOLE_BYTES
    finally:
        await peer.close()
        await server.close()
