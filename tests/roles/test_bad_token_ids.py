"""Token ids outside the model's vocabulary in an instance message (a ``prefill`` prompt, a
handed-over ``extend``, P's first token in ``kv_done``) fail that request alone, with an error naming the id; and a P whose engine
step fails answers the prefill calls of the requests it failed. Before, such an id reached the
forward pass: its IndexError failed the step, so every request batched with it failed too, and P's
prefill calls of the failed requests were never answered (whole mode: the first-token waiter was
only failed for a layer-wise stream, and a step failing before the call had put the request in
``reqs`` left it there, its pages freed). The gateway checks ids against the vocabulary itself;
this is the instances' own check. P / MD (the tiny model's engine, in process, no security) and
the gateway's connection; ordered by replies and one-way markers, not by a clock."""

from __future__ import annotations

import asyncio

import pytest

from pdd.transfer.client import connect
from pdd.transfer.messages import Expect, Extend, Kv, KvDone, Reserve
from pdd.transfer.peer import RemoteError
from pdd.types import SamplingParams
from tests.roles.md_tiny import PROMPT, start_instance

SP = SamplingParams(max_tokens=8, ignore_eos=True).to_dict()


def _prefill(rid: str, prompt: list[int]) -> dict:
    return {"t": "prefill", "rid": rid, "prompt_ids": prompt, "sampling": SP, "targets": []}


@pytest.mark.parametrize("bad, why", [([-5] + PROMPT, "prompt token id -5 at position 0"),
                                      (PROMPT + [1024], "prompt token id 1024 at position 18")])
async def test_a_prompt_id_outside_the_vocabulary_fails_only_its_prefill(tiny_model, bad, why):
    _, inst = await start_instance(tiny_model, "p0")
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: None}, role="gateway", instance="gateway")
    try:
        assert inst.engine.model_cfg.vocab_size == 1024
        refused, ok = await asyncio.wait_for(asyncio.gather(gw.call(_prefill("c0", bad)), gw.call(_prefill("g0", PROMPT)),
                                                            return_exceptions=True), 20)
        assert isinstance(refused, RemoteError)
        assert str(refused) == f"ValueError: {why} is outside the vocabulary [0, 1024)"
        assert (ok[0]["t"], ok[0]["rid"]) == ("prefill_ok", "g0")
        rep, _ = await gw.call({"t": "flush"})
        assert (rep["pages_free"], rep["live_requests"]) == (64, 0)
    finally:
        await gw.close()
        await inst.stop()


async def test_a_failed_engine_step_answers_the_prefill_calls_it_failed(tiny_model):
    _, inst = await start_instance(tiny_model, "p0")
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: None}, role="gateway", instance="gateway")
    step = inst.engine.step

    def failing_step():
        inst.engine.step = step  # once
        raise RuntimeError("device lost")

    try:
        inst.engine.step = failing_step
        got = await asyncio.wait_for(asyncio.gather(gw.call(_prefill("c0", PROMPT)), return_exceptions=True), 20)
        assert str(got[0]) == "RuntimeError: RuntimeError: device lost"
        assert inst.reqs == {} and inst.first_token_waiters == {}
        rep, _ = await gw.call(_prefill("c1", PROMPT))  # the next one is served
        assert rep["t"] == "prefill_ok"
        rep, _ = await gw.call({"t": "flush"})
        assert (rep["pages_free"], rep["live_requests"]) == (64, 0)
    finally:
        await gw.close()
        await inst.stop()


async def test_a_handed_over_id_outside_the_vocabulary_fails_that_request_on_md(tiny_model, caplog):
    _, inst = await start_instance(tiny_model, "md0")
    got = asyncio.Queue()
    marked = asyncio.Event()
    inst.server.on("test_mark", lambda p, h, b: marked.set())
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: got.put_nowait(h)}, role="gateway",
                       instance="gateway")
    p = await connect("127.0.0.1", inst.server.port, role="prefill", instance="p0")
    pb = inst.engine.pool.page_bytes
    try:
        await gw.call(Reserve("r0", PROMPT, SP).wire())
        await p.send(Kv("r0", 0, 5, None, pb).wire(), bytes(5 * pb))
        await p.send(KvDone("r0", 0, 5, None, pb, None, 5 * pb, first_token=5, fin=None, relay=True).wire())
        assert (await asyncio.wait_for(got.get(), 20))["t"] == "kv_ready"
        await gw.send(Extend("r0", [5, 1024], True).wire())  # RLD's ids: the second is no token
        await gw.send({"t": "test_mark"})
        await marked.wait()
        h = await asyncio.wait_for(got.get(), 20)
        assert (h["t"], h["rid"], h["error"]) == ("req_error", "r0", "md0: refused an extend: output token id "
                                                  "1024 at position 1 is outside the vocabulary [0, 1024)")
        assert inst.reqs == {} and "Traceback" not in caplog.text
        assert await inst.worker.call(lambda e: (e.flush_cache(), e.pool.num_free)[1]) == 64
    finally:
        await p.close()
        await gw.close()
        await inst.stop()


@pytest.mark.parametrize("name", ["md0", "rld0"])
async def test_a_first_token_outside_the_vocabulary_in_kv_done_fails_only_its_request(tiny_model, caplog, name):
    """P's first token comes in ``kv_done``; an id outside the vocabulary refuses that frame (as a
    bad ``kv`` frame is: docs/LINK.md "What a receiver refuses"). Before, it was streamed as the
    request's first token and appended, and the next decode step's forward pass raised IndexError,
    which fails every running request: here r0, decoding since before r1's ``kv_done`` came."""
    _, inst = await start_instance(tiny_model, name)
    got = asyncio.Queue()
    gw = await connect("127.0.0.1", inst.server.port, {"*": lambda p, h, b: got.put_nowait(h)}, role="gateway",
                       instance="gateway")
    p = await connect("127.0.0.1", inst.server.port, role="prefill", instance="p0")
    pb = inst.engine.pool.page_bytes
    admit = Reserve if name == "md0" else Expect
    sp = SamplingParams(max_tokens=64, ignore_eos=True).to_dict()
    msgs = []

    async def read_until(done) -> None:
        while not any(done(m) for m in msgs):
            h = await asyncio.wait_for(got.get(), 30)
            msgs.extend([(m["t"], m.get("rid"), m.get("pos"), m.get("fin")) for m in h.get("msgs", [h])]
                        if h["t"] in ("tok", "toks") else [(h["t"], h["rid"], h.get("error"), None)])

    try:
        for rid in ("r0", "r1"):
            await gw.call(admit(rid, PROMPT, sp).wire())
            await p.send(Kv(rid, 0, 5, None, pb).wire(), bytes(5 * pb))
        # P->MD at MD (it decodes at once, as RLD does)
        await p.send(KvDone("r0", 0, 5, None, pb, None, 5 * pb, first_token=5, fin=None, relay=False).wire())
        await read_until(lambda m: m[:3] == ("tok", "r0", 1))  # r0 decodes
        # r1's first token is no token of the model
        await p.send(KvDone("r1", 0, 5, None, pb, None, 5 * pb, first_token=1024, fin=None, relay=False).wire())
        await read_until(lambda m: m[1] == "r0" and (m[0] == "req_error" or m[3] is not None))
        assert [m for m in msgs if m[1] == "r1"] == [
            ("req_error", "r1", f"{name}: refused a KV frame: kv_done of 'r1': output token id 1024 at position 0 "
                                "is outside the vocabulary [0, 1024)", None)]
        assert [(m[0], m[2], m[3]) for m in msgs if m[1] == "r0"] == \
            [("tok", i, None) for i in range(63)] + [("tok", 63, "length")]
        assert inst.counters["kv_refused"] == 1 and inst.counters.get("failed", 0) == 0
        assert "Traceback" not in caplog.text and "refused a 'kv_done' frame of r1" in caplog.text
        rep, _ = await gw.call({"t": "flush"})
        assert (rep["pages_free"], rep["live_requests"]) == (64, 0)
    finally:
        await p.close()
        await gw.close()
        await inst.stop()
