"""MD (datacenter B): decode-side radix cache (DRC), delta KV receive, extend, decode.

Also serves as the decode instance of ``same_dc_pd`` (tier ``d``, in datacenter A) and, with
``generate``, as the single engine of ``colocated``.

Messages:
  ``reserve {rid, prompt_ids, sampling, relay, after, first_page}`` (call, gateway): with
  ``after`` (another choice of the same prompt, pdd.policy.siblings, or the request whose KV,
  still on its way here, holds this prompt's prefix: ``gateway.launch``), first wait until that
  request's KV has been imported here (or it is gone; a reservation waiting so counts as held,
  so a chain of them resolves in order); then match the prompt against the
  DRC, lock the matched pages, allocate the missing ones; reply ``{md_cached_tokens,
  md_cached_pages, n_pages, prompt_tokens, page_size, page_bytes, kv_dtype}`` (MD's own pages and
  pool dtype: the gateway predicts the WAN bytes with them, ``pdd.transfer.layout``). Only pages
  ``[md_cached_pages, n_pages)`` cross the WAN (the partial last page is never cached, so it
  always does, as its filled token slots only: ``pdd.transfer.kv.prompt_kv_bytes``).
  With ``first_page`` (a predicted send, ``policy.md_predicted_send``: P is already sending
  pages ``[first_page, n_pages)``) the match is capped at ``first_page`` pages; when the cache
  holds fewer, pages ``[md_cached_pages, first_page)`` come as a second transfer (``md_fill``)
  and the KV is complete after both ``kv_done`` messages. Frames that arrive before the reservation
  are held (:class:`pdd.roles.early_frames.EarlyFrames`) and imported when it admits the request.
  ``kv`` / ``kv_done {first_token, fin}`` (from P): import; when complete either start decoding
  (no relay) or tell the gateway ``kv_ready`` and wait for the handoff.
  ``extend {rid, token_ids}`` (gateway, after RLD's handoff): the relay's output ids; MD appends
  them and its next forward pass is one extend over all of them, then it decodes on. An extend
  that comes before the prompt's KV is complete (a handoff sent at the KV's predicted landing,
  ``policy.early_handoff``) waits for it.
  ``finish {rid}`` (gateway): the relay finished the request first; keep the prompt's KV in the
  DRC (so MD's hit rate tracks P's) and free the rest.
  ``generate {rid, prompt_ids, sampling}`` (colocated only): prefill + decode here.
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdd.roles.base import KV_PROGRESS_INTERVAL_S, EngineInstance, ReqCtx, free_sequence, shown_t
from pdd.roles.early_frames import EarlyFrames
from pdd.topology import ROLE_COLOCATED
from pdd.transfer.messages import (OMIT, Abort, Drop, Extend, ExtendOk, Finish, Generate, GenerateOk, Kv, KvCancel, KvDone,
                                   KvReady, Reserve, ReserveOk, ReqError, WanSample)
from pdd.types import SamplingParams

log = logging.getLogger(__name__)


class MainDecodeInstance(EngineInstance):
    kv_progress_interval_s = KV_PROGRESS_INTERVAL_S  # kv_progress to the gateway at most this often, s

    def __init__(self, cfg, spec, lay):
        super().__init__(cfg, spec, lay)
        self.role_state()

    def role_state(self) -> None:
        """This role's own state (also set when an instance takes this role at run time,
        ``pdd.roles.rerole``: an RLD in A on main-decode duty is tier ``d``, as same_dc_pd's)."""
        spec = self.spec
        if spec.role == ROLE_COLOCATED:
            self.tier = "colocated"
        else:
            self.tier = "md" if spec.dc == "B" else "d"
        self._kv_waits: dict[str, asyncio.Event] = {}  # rid -> set once its KV is imported or it is gone
        self._reserving: set[str] = set()  # rids whose reservation is being admitted (not yet in reqs)
        self.early = EarlyFrames()  # kv frames that came before their reservation (predicted send)

    def handlers(self) -> dict:
        return {**super().handlers(), "reserve": self.on_reserve, "kv": self.on_kv, "kv_done": self.on_kv_done,
                "extend": self.on_extend, "finish": self.on_finish, "generate": self.on_generate,
                "kv_cancel": self.on_kv_cancel, "drop": self.on_kv_cancel}

    def extra_stats(self) -> dict:
        return {**self.hit_stats(), "early_frames_held": self.early.held_frames,
                "early_frames_dropped": self.early.dropped_frames}

    async def _admit(self, peer, m: Reserve | Generate, min_uncached: int) -> ReqCtx:
        """A new request's sequence: its prompt matched against the radix cache (``min_uncached``
        prompt tokens always left to compute), the rest of its pages allocated, the hit counted."""
        rid = m.rid
        if rid in self.reqs:  # one sequence per rid: a second would leak the first's pages
            raise RuntimeError(f"request {rid} is already held here")
        sp = SamplingParams.from_dict(m.sampling)
        prompt = list(m.prompt_ids)
        seq = await self.worker.call_owned(lambda e: e.new_sequence(rid, prompt, sp, use_cache=True,
                                                                    min_uncached=min_uncached), free_sequence,
                                           overlap=True)
        ctx = ReqCtx(rid, seq, self.sink_for(peer), sp)
        self.reqs[rid] = ctx
        first = getattr(m, "first_page", OMIT)
        if first is not OMIT:  # a predicted send: P sends [first_page, n) already
            ctx.extra["kv_parts"] = 2 if seq.num_cached_tokens // self.engine.pool.page_size < first else 1
        self._replay_early(peer, ctx)
        self.counters["requests"] += 1
        self.record_hit(int(seq.num_cached_tokens), len(prompt))
        await self.admitted(ctx)
        if "kv_refused" in ctx.extra:  # a frame that came before the reservation was bad: refuse it
            h, why = ctx.extra["kv_refused"]
            self.note_kv_refused("refused a %s frame of %s: %s", shown_t(h), rid, why)
            await self.release(ctx, cache=False)
            raise RuntimeError(f"{self.spec.name}: refused a KV frame of {rid}: {why}")
        return ctx

    async def _kv_arrived(self, rid: str, timeout_s: float) -> None:
        """Return once request ``rid``'s prompt KV is imported here (its whole pages are in the
        DRC), or ``rid`` is not held (never was, finished, dropped, aborted), or after
        ``timeout_s`` seconds (then the caller just finds less cached). A reservation of ``rid``
        still being admitted here (its reply not sent yet) counts as held: a sibling's
        ``reserve {after}`` handled meanwhile waits for that KV too."""
        ctx = self.reqs.get(rid)
        if (ctx is None and rid not in self._reserving) or (ctx is not None and ctx.extra.get("kv_imported")):
            return
        ev = self._kv_waits.setdefault(rid, asyncio.Event())
        try:
            await asyncio.wait_for(ev.wait(), timeout_s)
        except asyncio.TimeoutError:
            pass

    def _kv_settled(self, rid: str) -> None:
        ev = self._kv_waits.pop(rid, None)
        if ev is not None:
            ev.set()

    async def release(self, ctx: ReqCtx, cache: bool) -> None:
        self.early.ended(ctx.rid)
        await super().release(ctx, cache)
        self._kv_settled(ctx.rid)

    async def on_abort(self, peer, h, payload):
        self.early.ended(Abort.decode(h).rid)  # frames still on their way (a predicted send) are dropped, not held
        return await super().on_abort(peer, h, payload)

    def _replay_early(self, peer, ctx: ReqCtx) -> None:
        """Import the frames held for ``ctx`` (they came before its reservation), at once and in
        order, before any later frame can; a held ``kv_done`` runs after them."""
        for kind, h, payload in self.early.take(ctx.rid):
            if kind == "kv":
                try:
                    self.import_frame(ctx, Kv.decode(h), payload)
                except ValueError as e:  # as a bad frame handled on arrival (MessageError included)
                    ctx.extra["kv_refused"] = (h, str(e))  # _admit refuses the request; the rest is dropped
                    return
            else:
                asyncio.get_running_loop().create_task(self.on_kv_done(peer, h, payload))
        if "kv_mark" in ctx.extra:  # kv_progress's rate counts the bytes that arrive from here on
            ctx.extra["kv_mark"] = (time.perf_counter(), ctx.extra["kv_total"])

    async def on_kv(self, peer, h, payload):
        rid = h.get("rid")
        if isinstance(rid, str) and rid not in self.reqs:  # before its reservation (held), or ended here (dropped)
            self.early.hold(rid, "kv", h, payload, time.monotonic())
            return None
        await super().on_kv(peer, h, payload)
        ctx = self.reqs.get(rid) if isinstance(rid, str) else None
        if ctx is not None and not ctx.released:  # the transfer's own rate, for the gateway's cut-off
            msg = self.kv_progress(ctx, self.kv_progress_interval_s)
            if msg is not None:
                ctx.sink.put(msg.wire())
        return None

    async def on_reserve(self, peer, h, payload):
        m = Reserve.decode(h)
        first = m.first_page
        rid = m.rid
        # held from now (a reserve {after} on this one waits for its KV too, while it waits itself)
        self._reserving.add(rid)
        try:
            if m.after:  # a sibling choice, or a prefix claimed by another request: reserve once its KV is in the DRC
                self.counters["sibling_waits"] = self.counters.get("sibling_waits", 0) + 1
                await self._kv_arrived(m.after, self.cfg.request_timeout_s)
            # MD may hold every whole page; a predicted send's pages [first_page, n) are on their way
            ctx = await self._admit(peer, m, min_uncached=0 if first is OMIT else
                                    len(m.prompt_ids) - first * self.engine.pool.page_size)
        except BaseException:
            self._kv_settled(rid)  # refused: a sibling waiting on it goes on
            raise
        finally:
            self._reserving.discard(rid)
        rid, prompt = ctx.rid, ctx.seq.prompt_ids
        ps = self.engine.pool.page_size
        cached = int(ctx.seq.num_cached_tokens)
        return ReserveOk(rid, cached, cached // ps, (len(prompt) + ps - 1) // ps, len(prompt), ps,
                         self.engine.pool.page_bytes, str(self.engine.pool.dtype_name)).wire(), b""

    async def on_kv_done(self, peer, h, payload):
        m = KvDone.decode(h)
        ctx = self.reqs.get(m.rid)
        if ctx is None:
            self.early.hold(m.rid, "kv_done", h, b"", time.monotonic())
            return None
        if ctx.extra.get("kv_complete"):  # a second kv_done: the first already started the request
            self.note_kv_refused("dropped a second kv_done of %s (its KV is already complete)", m.rid)
            return None
        parts = int(ctx.extra.get("kv_parts", 1)) - 1  # a predicted send with a fill: two transfers
        ctx.extra["kv_parts"] = parts
        if parts > 0:
            return None
        t0, fin = m.first_token, m.fin or None
        if await self.first_token_refused(ctx, h, t0):
            return None
        seq = ctx.seq
        relay = bool(m.relay)  # set by the gateway's plan, carried by P's kv_done
        start = fin is None and not relay

        def _imported(e):
            e.kv_imported(seq, t0, add=start)
            # the prompt's whole pages enter the DRC as soon as they are here, so a request
            # arriving meanwhile with the same prefix does not ship them again
            n = seq.prompt_len // e.page_size
            if n and e.radix is not None:
                e.radix.insert(seq.token_ids[: n * e.page_size], seq.page_table[:n])

        ctx.in_engine = start
        if not relay:
            # P's first token goes out at once, not after the engine thread's current step (the
            # import waits for it); MD's own tokens come from later steps, so the order holds
            self.emit(ctx, 0, t0, fin)
        done = self.worker.call(_imported, overlap=True)
        ctx.extra["kv_complete"] = True
        if relay:
            # tell the gateway at once: the engine thread runs commands in order, so the
            # handoff's extend (queued later) always finds the imported KV
            ctx.sink.put(KvReady(ctx.rid).wire())
        await done
        ctx.extra["kv_imported"] = True
        self._kv_settled(ctx.rid)
        wait = m.extra.get("kv_wait_s", 0.0)  # a layer-wise stream's time waiting for the prefill
        rate = self.kv_rate_sample_gbps(ctx, wait_s=float(wait) if isinstance(wait, (int, float)) else 0.0)
        if rate is not None:  # the gateway's live WAN estimate (pipeline choice) is made of these
            ctx.sink.put(WanSample(rate).wire())
        if not relay and fin is not None:
            await self.release(ctx, cache=True)
        return None

    async def _with_kv(self, ctx):
        """``ctx`` once its prompt's KV is complete, else None. A handoff sent at the KV's
        predicted landing (policy.early_handoff) may come first: the extend waits for the KV
        (then imported: the engine runs it after that). KV that never arrives within
        ``request_timeout_s`` fails the request (``req_error``) and releases it."""
        if ctx.extra.get("kv_complete"):
            return ctx
        rid = ctx.rid
        await self._kv_arrived(rid, self.cfg.request_timeout_s)
        ctx = self.reqs.get(rid)
        if ctx is None:
            return None
        if not ctx.extra.get("kv_imported"):
            error = f"{self.spec.name}: the prompt's KV did not arrive within {self.cfg.request_timeout_s:.0f} s"
            ctx.sink.put(ReqError(ctx.rid, error).wire())
            await self.release(ctx, cache=False)
            return None
        return ctx

    async def on_extend(self, peer, h, payload):
        """Handed-over output ids from RLD (``extend_message``): MD's next forward pass is one
        extend over the ids it lacks. ``final`` False (a catch-up round, sent as a call): compute
        their KV without sampling, holding the newest id back so the final round always has one
        to extend from, and reply when absorbed. ``final`` True: extend, sample, decode on."""
        m = Extend.decode(h)
        ctx = self.reqs.get(m.rid)
        if ctx is None:
            return ExtendOk(False).wire()
        ids, final = m.token_ids, m.final
        ctx = await self._with_kv(ctx)
        if ctx is None:
            return ExtendOk(False).wire()
        seq = ctx.seq

        def _extend(e):
            have = len(seq.token_ids) - seq.prompt_len
            new = ids[have:] if final else ids[have:-1]
            if new or final:
                e.append_tokens(seq, new, sample=final)
                e.add(seq)
            return len(seq.token_ids)

        try:
            self.engine.check_token_ids(ids, "output")  # RLD's outputs so far, from position 0
        except ValueError as e:  # the forward pass would fail every request batched with it
            log.warning("refused an extend of %s: %s", ctx.rid, e)
            ctx.sink.put(ReqError(ctx.rid, f"{self.spec.name}: refused an extend: {e}").wire())
            await self.release(ctx, cache=False)
            return ExtendOk(False).wire()
        ctx.in_engine = True
        self.counters["extends"] = self.counters.get("extends", 0) + 1
        target = await self.worker.call(_extend, overlap=True)
        if final:
            return ExtendOk(True).wire()
        # catch-up round: wait until MD's KV covers what it was sent (not final: no sampling)
        steps0 = self.worker.steps
        while ctx.rid in self.reqs:
            # overlap: a poll that waited for each held step's end would park every admission
            # behind it (the worker keeps command order); at most one step early
            if await self.worker.call(lambda e: seq.num_computed >= target, overlap=True):
                break
            await asyncio.sleep(0.002)
        base = sorted(self.worker.recent_steps_s)
        med = base[len(base) // 2] if base else 0.0
        return ExtendOk(True, steps=self.worker.steps - steps0,
                        extend_step_ms=round(self.worker.last_step_s * 1000, 3),
                        extra_step_ms=round(max(0.0, self.worker.last_step_s - med) * 1000, 3)).wire()

    async def on_kv_cancel(self, peer, h, payload):
        """The transfer was cut off (RLD finished first): ``kv_cancel`` from P, or ``drop`` from
        the gateway (which also covers a transfer P never started). Free what arrived, cache
        nothing; frames still in flight find no request and are dropped."""
        rid = (KvCancel if h.get("t") == KvCancel.T else Drop).decode(h).rid
        ctx = self.reqs.get(rid)
        if ctx is None:
            self.early.ended(rid)  # frames still on their way are dropped, not held
            if rid in self._reserving:  # its reservation still waits (reserve {after}): refused once
                self.note_aborted(rid)  # admitted, so no page stays held for an owner who gave it up
        elif not ctx.extra.get("kv_complete"):
            self.counters["dropped"] = self.counters.get("dropped", 0) + 1
            await self.release(ctx, cache=False)
        return None

    async def on_finish(self, peer, h, payload):
        ctx = self.reqs.get(Finish.decode(h).rid)
        if ctx is not None:
            await self.release(ctx, cache=True)
        return None

    async def on_generate(self, peer, h, payload):
        ctx = await self._admit(peer, Generate.decode(h), min_uncached=1)  # colocated: this engine prefills too
        seq = ctx.seq
        ctx.in_engine = True
        await self.worker.call(lambda e: e.add(seq), overlap=True)
        return GenerateOk(ctx.rid, int(seq.num_cached_tokens)).wire(), b""
