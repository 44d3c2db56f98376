"""RLD (datacenter A): eager decode on KV from P's fast path; hands over token ids to MD.

Messages:
  ``expect {rid, prompt_ids, sampling}`` (call, gateway): allocate the prompt's pages.
  ``kv`` / ``kv_done {first_token, fin}`` (from P): import pages; on done emit the first token
  and start decoding at once ("eager output tokens", PDD report).
  ``kv_cancel`` (from P: the fast-path transfer was cancelled or failed before its ``kv_done``,
  e.g. the request aborted mid-prefill): free what arrived; the request cannot decode here.
  ``handoff {rid}`` (call, gateway, one-shot): stop decoding the request, reply with every output
  token id so far (ids only: MD recomputes their KV in one extend), free its pages.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import asdict

from pdd.policy.handoff import HandoffInputs, decide_handoff, rld_load
from pdd.roles.base import EngineInstance, ReqCtx, free_sequence
from pdd.transfer.messages import Expect, ExpectOk, Handoff, HandoffOk, KvCancel, KvDone
from pdd.types import SamplingParams


class RelayDecodeInstance(EngineInstance):
    tier = "rld"
    cache_on_finish = False  # RLD keeps no prefix cache: its KV is transient

    def handlers(self) -> dict:
        return {**super().handlers(), "expect": self.on_expect, "kv": self.on_kv, "kv_done": self.on_kv_done,
                "kv_cancel": self.on_kv_cancel, "handoff": self.on_handoff}

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.role_state()

    def role_state(self) -> None:
        """This role's own state (also set when an instance takes this role at run time,
        ``pdd.roles.rerole``)."""
        self.tier = "rld"
        # the mode auto is in now (hysteresis state); a fixed mode starts in itself
        self.current_mode = "one_shot" if self.cfg.policy.handoff_mode == "one_shot" else "catch_up"

    def extra_stats(self) -> dict:
        return {"handoff_mode_now": self.current_mode}

    async def on_expect(self, peer, h, payload):
        m = Expect.decode(h)
        rid = m.rid
        if rid in self.reqs:  # one sequence per rid: a second would leak the first's pages
            raise RuntimeError(f"request {rid} is already held here")
        sp = SamplingParams.from_dict(m.sampling)
        prompt = list(m.prompt_ids)
        seq = await self.worker.call_owned(lambda e: e.new_sequence(rid, prompt, sp, use_cache=False), free_sequence,
                                           overlap=True)
        self.reqs[rid] = ReqCtx(rid, seq, self.sink_for(peer), sp)
        self.counters["requests"] += 1
        await self.admitted(self.reqs[rid])
        return ExpectOk(rid, len(seq.page_table)).wire(), b""

    async def on_kv_done(self, peer, h, payload):
        m = KvDone.decode(h)
        ctx = self.reqs.get(m.rid)
        if ctx is None:
            return None
        if ctx.extra.get("kv_done"):  # a second kv_done: the first already started decoding
            self.note_kv_refused("dropped a second kv_done of %s (its KV is already complete)", m.rid)
            return None
        t0, fin = m.first_token, m.fin or None
        if await self.first_token_refused(ctx, h, t0):
            return None
        seq = ctx.seq

        def _start(e):
            e.kv_imported(seq, t0, add=fin is None)

        ctx.in_engine = fin is None
        ctx.extra["kv_done"] = True  # decoding starts (or the request ended at P's token): on_handoff tells them apart
        # P's first token goes out at once, not after the engine thread's current step (the
        # import waits for it); RLD's own tokens come from later steps, so the order holds
        self.emit(ctx, 0, t0, fin)
        await self.worker.call(_start, overlap=True)
        if fin is not None:
            await self.release(ctx, cache=False)
        return None

    async def on_kv_cancel(self, peer, h, payload):
        """P's transfer of the request's prompt KV ended without ``kv_done`` (docs/LINK.md: on a
        cancel, abort or failed prefill "the receivers free what arrived"): free the request's
        pages, cache nothing. One already decoding (its ``kv_done`` came) or gone is left alone."""
        ctx = self.reqs.get(KvCancel.decode(h).rid)
        if ctx is not None and not ctx.in_engine:
            await self.release(ctx, cache=False)
        return None

    async def on_handoff(self, peer, h, payload):
        """One handoff round, decided here by ``policy.handoff`` on RLD's live load.

        Request: ``{rid, sent}`` (ids MD already holds), ``round``. Reply: ``{mode, final,
        token_ids (all outputs so far), finished}``. One-shot final: RLD stops and frees the
        request at once. Catch-up: RLD keeps decoding and streaming (also after the final round,
        until the gateway sees MD's stream live and sends ``abort``), so the client never waits
        on the switch. ``finished``: RLD holds the request no more, or no more in its engine (it
        ended, or a one-shot final round stopped it). ``not_started`` (``finished`` false, no
        ids, no round): RLD holds the request but has not started decoding it (P's ``kv_done``
        has not come); the gateway asks again once RLD streams its first token.
        """
        m = Handoff.decode(h)
        rid = m.rid
        t_in = time.perf_counter()
        ctx = self.reqs.get(rid)
        done = HandoffOk(rid, True, [], None, True).wire()
        if ctx is not None and not ctx.in_engine and not ctx.extra.get("kv_done"):
            return HandoffOk(rid, False, [], None, False, not_started=True).wire(), b""
        if ctx is None or not ctx.in_engine:
            return done, b""
        seq = ctx.seq
        pol = self.cfg.policy
        e = self.engine
        inp = HandoffInputs(
            tokens_pending=max(0, seq.num_outputs - m.sent),
            rld_running=len(e.seqs), rld_capacity=self.engine_cfg.max_running,
            rld_pages_used=e.pool.num_pages - e.pool.num_free, rld_pages_total=e.pool.num_pages,
            threshold=pol.catchup_threshold_tokens, mode_config=pol.handoff_mode, current_mode=self.current_mode,
            round_index=m.round)
        dec = decide_handoff(inp)
        switched = dec.mode != inp.current_mode  # a round deciding meanwhile reads the new mode
        if switched:
            self.counters["mode_switches"] = self.counters.get("mode_switches", 0) + 1
            self.current_mode = dec.mode
        stop = dec.final and dec.mode == "one_shot"

        def _take(e):
            if seq.is_finished or e.seqs.get(rid) is not seq:
                return None  # finished in the step that just ran; its events are on their way
            if stop:
                e.remove(rid)
            return list(seq.token_ids[seq.prompt_len :])

        tokens = await self.worker.call(_take)
        if tokens is None:
            # the request finished first: no round was applied, so no switch happened (the gateway
            # counts switches from the applied rounds' inputs, pdd.gateway.live_counters, and this
            # reply carries none); the mode goes back unless a later round moved it since
            if switched:
                self.counters["mode_switches"] -= 1
                if self.current_mode == dec.mode:
                    self.current_mode = inp.current_mode
            return done, b""
        if stop:
            ctx.in_engine = False
            # tokens emitted before the removal are queued on the sink ahead of this reply;
            # flush so the gateway has all of them before MD takes over
            await ctx.sink.flush()
            # freeing the pages is off the switch's critical path (one engine step later)
            asyncio.get_running_loop().create_task(self.release(ctx, cache=False))
        key = f"handoffs_{dec.mode}" if dec.final else "catchup_rounds"
        self.counters[key] = self.counters.get(key, 0) + 1
        return HandoffOk(rid, False, tokens, dec.mode, dec.final, load=round(rld_load(inp), 4), inputs=asdict(inp),
                         rld_ms=round((time.perf_counter() - t_in) * 1000, 2)).wire(), b""
