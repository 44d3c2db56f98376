"""P (datacenter A): prefill with a prefix (radix) cache, first token, dual-path KV send.

``prefill {rid, prompt_ids, sampling, targets: [{"name", "first_page"}]}`` (a call from the
gateway): P matches its radix cache (at least one prompt token is always computed, so the first
token's logits exist), prefills the rest, samples the first output token, inserts the prompt's
whole pages into its cache, replies ``{first_token, fin, p_cached_tokens, n_pages}`` and then
streams pages ``[first_page, n_pages)`` to every target **at once** (the fast path to RLD, the WAN
to MD), each stream ending with ``kv_done {first_token, fin}``. A WAN target is reached over two
persistent connections, lanes: a transfer small enough takes the express one
(``pdd.policy.wan_order.wan_lane``), so it does not queue behind a large transfer's bytes. When
every stream has drained it releases its references and tells the gateway ``xfer_done {rid, bytes: {target: payload bytes}}``.
The partial last page is always sent: radix caches only hold whole pages.
"""

from __future__ import annotations

import asyncio
import logging

from pdd.engine.sequence import SeqStatus
from pdd.policy.wan_order import WAN_LANES, express_max_bytes, send_buffer_bytes, wan_lane
from pdd.roles.base import EngineInstance, ReqCtx, first_token_finish, free_sequence
from pdd.roles.worker import log_failure_of
from pdd.security import link_security
from pdd.transfer import rpc
from pdd.transfer.kv import KVSender, prompt_kv_bytes, prompt_last_slots
from pdd.transfer.messages import OMIT, Abort, AbortOk, Cancel, MessageError, Prefill, PrefillOk, Target, XferDone
from pdd.transfer.wire import limit_write_buffers, set_socket_buffer
from pdd.types import SamplingParams

log = logging.getLogger(__name__)

# the targets the gateway may plan after P started (``target``); ``md_fill``: the pages a predicted
# MD send skipped that MD turned out to lack (``policy.md_predicted_send``)
DEFERRED_SLOTS = {"rld", "md", "md_fill"}
EXPRESS = "+express"  # key suffix of a WAN target's express-lane sender


_log_failure = log_failure_of("caching a prompt's pages")


class PrefillInstance(EngineInstance):
    tier = "p"

    def __init__(self, *a, **kw):
        super().__init__(*a, **kw)
        self.first_token_waiters: dict[str, asyncio.Future] = {}
        self.senders: dict[str, KVSender] = {}  # target name (bulk lane) or name + EXPRESS -> sender
        self._sender_locks: dict[str, asyncio.Lock] = {}
        self.lane_transfers = dict.fromkeys(WAN_LANES, 0)  # WAN transfers started, by lane
        lk = self.cfg.link
        self.express_max_bytes = express_max_bytes(lk.wan_gbps, lk.wan_rtt_ms, self.cfg.policy.wan_express_lane_bdp)
        self._deferred: dict[str, dict[str, asyncio.Future]] = {}  # rid -> target name -> plan
        self.bytes_sent: dict[str, int] = {}  # target name -> KV payload bytes
        self.wan_bytes_sent = 0


    def handlers(self) -> dict:
        return {**super().handlers(), "prefill": self.on_prefill, "target": self.on_target,
                "cancel": self.on_cancel}

    async def on_cancel(self, peer, h, payload):
        """Cut-off: stop sending request ``rid``'s pages to target ``name`` (sends kv_cancel)."""
        m = Cancel.decode(h)
        rid, name = m.rid, m.name
        if rid not in self.reqs:
            return None  # already drained and released: nothing left to cut
        self._cancel_deferred(rid, {"name": name, "cancelled": True})  # not planned yet: never start it
        n = sum(s.cancel(rid) for s in self._senders_of(name))
        self.counters["cancelled_transfers"] = self.counters.get("cancelled_transfers", 0) + n
        return None

    def _deferred_target(self, rid: str, name: str) -> asyncio.Future:
        return self._deferred.setdefault(rid, {}).setdefault(name, asyncio.get_running_loop().create_future())

    def _cancel_deferred(self, rid: str, plan: dict) -> None:
        """Resolve every deferred target of ``rid`` not planned yet (any of DEFERRED_SLOTS, so a
        stream task that has not run yet finds its slots resolved too) with ``plan``, a
        ``cancelled`` plan: nothing is sent to them."""
        for slot in set(self._deferred.get(rid, {})) | DEFERRED_SLOTS:
            fut = self._deferred_target(rid, slot)
            if not fut.done():
                fut.set_result(plan)

    async def on_target(self, peer, h, payload):
        """The plan of a target sent ``deferred`` in ``prefill`` (MD's cached pages arrive a WAN
        round trip after P could start prefilling): ``{rid, name, first_page, relay}`` (pages
        ``[first_page, last_page)`` with ``last_page``, default the prompt's last), ``{rid, slot,
        cancelled: true}`` when that target cannot be reached (never sent), or ``{rid, slot, name,
        skip: true}`` when the slot has nothing to send (a predicted MD send that MD's cache
        confirmed: no ``md_fill``)."""
        m = Target.decode(h)
        if m.rid in self._aborted:
            return None  # aborted already: nothing will be sent
        fut = self._deferred_target(m.rid, m.slot)
        if not fut.done():
            if m.cancelled or m.skip:
                fut.set_result({"name": m.name or m.slot, **({"skip": True} if m.skip else {"cancelled": True})})
            elif m.name is OMIT or m.first_page is OMIT:
                raise MessageError(f"message 'target': a planned slot needs 'name' and 'first_page' ({m})")
            else:
                fut.set_result({"name": m.name, "first_page": m.first_page, "relay": bool(m.relay),
                                **({"last_page": m.last_page} if m.last_page is not OMIT else {})})
        return None

    async def on_abort(self, peer, h, payload):
        """Abort: a request still prefilling fails its prefill call; one whose KV is streaming
        has its transfers cancelled, and its pages are freed only once they have drained (the
        stream's own clean-up), never while a sender may still read them."""
        rid = Abort.decode(h).rid
        self.note_aborted(rid)
        fut = self.first_token_waiters.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(RuntimeError(f"request {rid} aborted"))
        ctx = self.reqs.get(rid)
        if ctx is not None and ctx.extra.get("streaming"):
            self._cancel_deferred(rid, {"cancelled": True})
            n = sum(s.cancel(rid) for s in self.senders.values())
            self.counters["aborted"] += 1
            return AbortOk(rid, True, cancelled_transfers=n).wire(), b""
        self._deferred.pop(rid, None)
        return await super().on_abort(peer, h, payload)

    def extra_stats(self) -> dict:
        return {
            "kv_bytes_sent": dict(self.bytes_sent),
            "wan_bytes_sent": self.wan_bytes_sent,
            "wan_lane_transfers": dict(self.lane_transfers),
            **self.hit_stats(),
        }

    def _senders_of(self, name: str) -> list[KVSender]:
        """Every connection's sender to target ``name`` (its lanes)."""
        return [s for k in (name, name + EXPRESS) if (s := self.senders.get(k)) is not None]

    async def sender_for(self, name: str, lane: str = "bulk") -> tuple[KVSender, bool]:
        """The sender of target ``name``'s ``lane`` (connected on first use), and whether it crosses
        the WAN. Only WAN targets have an express lane (a fast-path target gets its one sender).
        Opening one lane of a WAN target opens the other in the background, so a latency-critical
        increment never pays a connection's handshake (TLS: two round trips)."""
        host, port, wan = self.layout.address_from_a(name)
        key = name + EXPRESS if wan and lane == "express" else name
        lock = self._sender_locks.setdefault(key, asyncio.Lock())
        async with lock:
            fresh = key not in self.senders
            s, _ = await self._sender_locked(key, name, host, port, wan)
        if fresh and wan and self.express_max_bytes > 0:
            other = name if key != name else name + EXPRESS
            if other not in self.senders and not self._sender_locks.setdefault(other, asyncio.Lock()).locked():
                asyncio.get_running_loop().create_task(self._warm(name, "bulk" if other == name else "express"))
        return s, wan

    async def _warm(self, name: str, lane: str) -> None:
        try:
            await self.sender_for(name, lane)
        except Exception as e:  # the transfer that needs it will connect (and fail) on its own
            log.info("warming the %s lane to %s failed: %s", lane, name, e)

    async def _sender_locked(self, key: str, name: str, host: str, port: int, wan: bool) -> tuple[KVSender, bool]:
        s = self.senders.get(key)
        if s is not None and s.peer.closed:
            await s.close()  # its transfers already failed with the connection
        if s is None or s.peer.closed:
            # the fingerprint refuses an instance whose page size, KV dtype/layout or weights differ
            # (HandshakeError, never retried); a dead target is not retried for long (the gateway
            # recovers the request elsewhere)
            peer = await rpc.connect(host, port, {}, role=self.spec.role, instance=self.spec.name, retries=5,
                                     fingerprint=self.kv_fingerprint(), **self.liveness_kw(),
                                     **link_security(self.cfg, self.spec.name).client(name, fast=not wan))
            rate = None if wan else self.cfg.link.fast_gbps
            # over the WAN, what the socket already holds (and the frame being written) goes first
            # whatever the send order: the socket's buffer is kept to ~1 BDP, frames to half of it
            cap = send_buffer_bytes(self.cfg.link.wan_gbps, self.cfg.link.wan_rtt_ms,
                                    self.cfg.policy.wan_send_buffer_bdp) if wan else None
            s = KVSender(peer, rate_gbps=rate, order=self.cfg.policy.wan_order if wan else "fifo",
                         max_frame_bytes=cap // 2 if cap is not None else None,
                         stall_timeout_s=self.cfg.liveness.kv_stall_timeout_s)
            if cap is not None:
                set_socket_buffer(peer.writer, cap)
                # and nothing waits in user space: TLS alone would hold 512 KiB ahead of the order
                limit_write_buffers(peer.writer.transport)
            self.senders[key] = s
        return s, wan

    def on_events(self, events: list) -> None:
        for ev in events:
            fut = self.first_token_waiters.pop(ev.seq_id, None)
            if fut is not None and not fut.done():
                fut.set_result(ev)

    async def on_prefill(self, peer, h, payload):
        m = Prefill.decode(h)
        rid = m.rid
        prompt = list(m.prompt_ids)
        sp = SamplingParams.from_dict(m.sampling)
        p_sp = SamplingParams.from_dict({**sp.to_dict(), "max_tokens": 1, "ignore_eos": True})
        if rid in self._aborted:
            raise RuntimeError(f"request {rid} was aborted")
        # the waiter exists before the sequence can run, so its first token is never missed
        fut = asyncio.get_running_loop().create_future()
        self.first_token_waiters[rid] = fut

        def _new_and_add(e):
            # one engine-thread call: a second call would wait for the forward pass the engine
            # starts meanwhile (a whole prefill step on a busy P) before the request joins a batch
            s = e.new_sequence(rid, prompt, p_sp, use_cache=True, min_uncached=1)
            e.add(s)
            return s

        try:
            seq = await self.worker.call_owned(_new_and_add, free_sequence, overlap=True)
        except BaseException:
            self.first_token_waiters.pop(rid, None)
            raise
        ctx = ReqCtx(rid, seq, self.sink_for(peer), sp)
        ctx.in_engine = True
        self.reqs[rid] = ctx
        self.counters["requests"] += 1
        try:
            await self.admitted(ctx)  # aborted while it was being added: freed, raises
        except BaseException:
            self.first_token_waiters.pop(rid, None)
            if fut.done() and not fut.cancelled():
                fut.exception()  # retrieved (on_abort may have failed it)
            raise
        ev = await fut
        ctx.in_engine = False
        if ctx.released:
            raise RuntimeError(f"request {rid} aborted")
        t0 = int(ev.token_id)
        fin = first_token_finish(t0, sp, self.eos_ids)
        if getattr(ev, "logprobs", None) is not None:
            ctx.extra["lp0"] = ev.logprobs  # travels to RLD / MD in kv_done
        cached = int(seq.num_cached_tokens)
        self.record_hit(cached, len(prompt))
        ps = self.engine.pool.page_size
        n_pages = (len(prompt) + ps - 1) // ps
        # P's own cache gets the prompt's whole pages at the engine's next step boundary, so
        # requests arriving while this one is still streaming already hit it (the sequence keeps
        # its own refs until release; the engine thread runs calls in order, so the insert
        # precedes the release and any later request's lookup). Not awaited: the first token and
        # the KV streams do not wait for a busy P's next forward pass.
        def _cache_prefix(e):
            n = len(prompt) // ps
            if n and e.radix is not None and seq.status != SeqStatus.RELEASED and len(seq.page_table) >= n:
                e.radix.insert(prompt[: n * ps], seq.page_table[:n])

        self.worker.call(_cache_prefix, overlap=True).add_done_callback(_log_failure)
        if ctx.released:  # aborted meanwhile (freed by on_abort): its pages must not be streamed
            raise RuntimeError(f"request {rid} aborted")
        ctx.extra["streaming"] = True  # from here on an abort cancels the streams (on_abort)
        asyncio.get_running_loop().create_task(self._stream(ctx, m.targets, t0, fin, n_pages))
        return PrefillOk(rid, t0, fin, cached, n_pages, self.engine.pool.page_bytes).wire(), b""

    async def _stream(self, ctx: ReqCtx, targets: list[dict], t0: int, fin: str | None, n_pages: int) -> None:
        ctx.extra["streaming"] = True
        pool = self.engine.pool
        table = list(ctx.seq.page_table[:n_pages])
        result: dict[str, int] = {}
        unsent: dict[str, int] = {}
        errors: dict[str, str] = {}

        n_prompt = len(ctx.seq.prompt_ids)
        whole = self.cfg.policy.kv_whole_pages  # ablation: the partial last page goes whole
        last_slots = None if whole else prompt_last_slots(n_prompt, pool.page_size)  # its filled slots only

        def reader(i: int, n: int):
            return pool.export_pages(table[i : i + n], last_slots=last_slots if i + n == n_pages else None)

        def planned(first: int, last: int = n_pages) -> int:
            """Payload bytes of pages ``[first, last)`` of the prompt."""
            return (prompt_kv_bytes(n_prompt, first, pool.page_size, pool.page_bytes, whole)
                    - prompt_kv_bytes(n_prompt, last, pool.page_size, pool.page_bytes, whole))

        def book(into: dict[str, int], name: str, nbytes: int) -> None:
            # a target may get two transfers (md and md_fill): their bytes add up; -1 ("the whole
            # planned transfer") is only ever booked alone, by a main slot cut before its plan
            into[name] = nbytes if nbytes < 0 or into.get(name, 0) < 0 else into.get(name, 0) + nbytes

        async def one(t: dict) -> None:
            name = t.get("name", t.get("slot"))
            tr = first = None
            last = n_pages
            wan = False
            try:
                if t.get("deferred"):
                    plan = await asyncio.wait_for(self._deferred_target(ctx.rid, t["slot"]), self.cfg.request_timeout_s)
                    t = {**t, **plan}
                    name = t.get("name", name)
                    if t.get("skip"):  # nothing to send on this slot (a confirmed prediction's fill)
                        return
                    if t.get("cancelled"):  # cut off before it started: nothing of it was sent
                        if t["slot"] != "md_fill":  # a fill cut before its plan was never planned
                            book(result, name, 0)
                            book(unsent, name, -1)  # -1: the whole planned transfer (only the gateway knows its size)
                        return
                first = int(t["first_page"])
                last = min(n_pages, int(t.get("last_page", n_pages)))
                if fin is not None and t.get("relay"):
                    # a relayed request finished by its first token (EOS, a stop id, max_tokens 1):
                    # RLD emits it and MD never decodes, so its WAN stream never starts (the
                    # gateway cuts that leg too, but its cancel may come after MD's plan did)
                    book(result, name, 0)
                    book(unsent, name, planned(first, last))
                    self.counters["cancelled_transfers"] = self.counters.get("cancelled_transfers", 0) + 1
                    return
                lane = wan_lane(planned(first, last), self.express_max_bytes)  # sender_for: bulk off the WAN
                sender, wan = await self.sender_for(name, lane)
                if ctx.rid in self._aborted:  # aborted before it started (on_abort cancelled none)
                    book(result, name, 0)
                    book(unsent, name, planned(first, last))
                    return
                tr = sender.submit(ctx.rid, first, reader, last - first, pool.page_bytes,
                                   last_page_bytes=None if last_slots is None or last < n_pages
                                   else last_slots * pool.slot_bytes(),
                                   layers=(0, self.engine.model_cfg.num_hidden_layers),
                                   done_fields={"first_token": t0, "fin": fin, "relay": bool(t.get("relay")),
                                                **({"lp": ctx.extra["lp0"]} if "lp0" in ctx.extra else {})})
                if wan:
                    self.lane_transfers[lane] += 1
                res = await tr
                book(result, name, res.bytes_sent)
                if res.cancelled:
                    book(unsent, name, tr.total_bytes - res.bytes_sent)
                self.bytes_sent[name] = self.bytes_sent.get(name, 0) + tr.bytes_sent
                if wan:
                    self.wan_bytes_sent += tr.bytes_sent
            except Exception as e:
                if isinstance(e, (ConnectionError, asyncio.TimeoutError, TimeoutError)):
                    # the peer went away or stalled (a fault the gateway recovers from): one line
                    log.warning("KV stream %s -> %s failed: %s", ctx.rid, name, e)
                else:
                    log.exception("KV stream %s -> %s failed", ctx.rid, name)
                errors[name] = str(e)
                # what crossed before the failure counts as sent, the rest as not sent, so the
                # gateway's planned = sent + unsent holds for failed streams too
                sent = tr.bytes_sent if tr is not None else 0
                book(result, name, sent)
                book(unsent, name, tr.total_bytes - sent if tr is not None
                     else planned(first, last) if first is not None else -1)
                self.bytes_sent[name] = self.bytes_sent.get(name, 0) + sent
                if wan:
                    self.wan_bytes_sent += sent

        try:
            await asyncio.gather(*(one(t) for t in targets))
        finally:
            self._deferred.pop(ctx.rid, None)
            await self.release(ctx, cache=True)
            ctx.sink.put(XferDone(ctx.rid, result, unsent, errors).wire())
