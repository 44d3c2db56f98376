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

With ``policy.kv_stream: layerwise`` the streams start with the prefill instead of after it: the
engine tells P after each layer of each prefill chunk how far that layer's K/V reaches
(``Engine.watch_kv``, paced to the emulated step by ``EngineWorker.layer_done``), and each
target's transfer (:class:`pdd.transfer.kv.LayeredTransfer`) sends a (layer group, page range)
unit as soon as every token of its pages is computed for those layers. The first token, known
after the last chunk, seals the transfers (``kv_done`` carries it); an abort or a failed prefill
cancels them, and the pages are freed once the streams and the engine's step are done.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque

from pdd.engine.sequence import SeqStatus
from pdd.policy.wan_order import WAN_LANES, express_max_bytes, send_buffer_bytes, wan_lane
from pdd.roles.base import ABORTED_MEMORY, EngineInstance, ReqCtx, first_token_finish, free_sequence
from pdd.roles.worker import log_failure_of
from pdd.security import link_security
from pdd.transfer.client import connect as connect_peer
from pdd.transfer.peer import CallFailed
from pdd.transfer.kv import KVSender, LayerProgress, layer_groups, prompt_kv_bytes, prompt_last_slots
from pdd.transfer.layout import KVLayout, kv_handshake_check, layout_of, wire_dtype, wire_slot_bytes
from pdd.transfer.messages import OMIT, Abort, AbortOk, Cancel, MessageError, Prefill, PrefillOk, Target, XferDone
from pdd.transfer.wire import limit_write_buffers, set_socket_buffer
from pdd.types import SamplingParams

log = logging.getLogger(__name__)

# the targets the gateway may plan after P started (``target``); ``md_fill``: the pages a predicted
# MD send skipped that MD turned out to lack (``policy.md_predicted_send``)
DEFERRED_SLOTS = {"rld", "md", "md_fill"}
EXPRESS = "+express"  # key suffix of a WAN target's express-lane sender
PREFILL_CANCELS_KEPT = 64  # recent aborted prefills listed in stats (prefill_cancels)


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
        self._streamed: dict[str, None] = {}  # rids whose KV streams started (recent ABORTED_MEMORY)
        # the last PREFILL_CANCELS_KEPT requests aborted here before their KV streamed: rid, prefill
        # chunks run, chunks run after the abort arrived (at most the one in flight), tokens done
        self.prefill_cancels: deque[dict] = deque(maxlen=PREFILL_CANCELS_KEPT)


    def handlers(self) -> dict:
        return {**super().handlers(), "prefill": self.on_prefill, "target": self.on_target,
                "cancel": self.on_cancel}

    async def on_cancel(self, peer, h, payload):
        """Cut-off: stop sending request ``rid``'s pages to target ``name`` (sends kv_cancel).
        ``name`` None (an MD leg lost before an MD was chosen): no stream went to a named target,
        so only the request's deferred slots are cancelled."""
        m = Cancel.decode(h)
        rid, name = m.rid, m.name
        if rid not in self.reqs:
            return None  # already drained and released: nothing left to cut
        if name is None:  # the slots keep their own names (a None key would not encode in xfer_done)
            self._cancel_deferred(rid, {"cancelled": True})
            return None
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
            elif m.first_page < 0:
                raise MessageError(f"message 'target': first_page {m.first_page} is negative ({m})")
            else:
                fut.set_result({"name": m.name, "first_page": m.first_page, "relay": bool(m.relay),
                                **({"last_page": m.last_page} if m.last_page is not OMIT else {})})
        return None

    async def on_abort(self, peer, h, payload):
        """Abort: a request still prefilling stops at the next chunk boundary (its sequence is
        cancelled in the engine, so at most the chunk in flight still runs), fails its prefill
        call and frees its pages once; one whose KV is streaming has its transfers cancelled,
        and its pages are freed only once they have drained (the stream's own clean-up), never
        while a sender may still read them. The reply's ``streams``: whether this P started
        streaming the request's KV (it then reports the transfer in ``xfer_done``; else never)."""
        rid = Abort.decode(h).rid
        self.note_aborted(rid)
        fut = self.first_token_waiters.pop(rid, None)
        if fut is not None and not fut.done():
            fut.set_exception(RuntimeError(f"request {rid} aborted"))
        ctx = self.reqs.get(rid)
        streams = rid in self._streamed
        if ctx is not None and ctx.extra.get("streaming"):
            prog = ctx.extra.get("progress")
            prefilling = prog is not None and not prog.settled  # layerwise: the streams run beside the prefill
            if prefilling:
                seq = ctx.seq
                at_cancel = seq.prefill_chunks
                self.engine.cancel(seq)  # no chunk of it is scheduled after the one in flight
                prog.fail(RuntimeError(f"request {rid} aborted"))
            self._cancel_deferred(rid, {"cancelled": True})
            n = sum(s.cancel(rid) for s in self.senders.values())
            self.counters["aborted"] += 1
            if prefilling:  # the same record as a prefill aborted before streaming (once the step is over)
                await self.worker.call(lambda e: None)
                after = seq.prefill_chunks - at_cancel
                self.counters["prefill_chunks_after_cancel"] = self.counters.get("prefill_chunks_after_cancel", 0) + after
                if seq.num_computed < seq.prompt_len:
                    self.counters["prefill_cancelled"] = self.counters.get("prefill_cancelled", 0) + 1
                self.prefill_cancels.append({"rid": rid, "chunks": seq.prefill_chunks, "chunks_after_cancel": after,
                                             "prefilled_tokens": min(seq.num_computed, seq.prompt_len),
                                             "prompt_tokens": seq.prompt_len})
            return AbortOk(rid, True, cancelled_transfers=n, streams=True).wire(), b""
        self._deferred.pop(rid, None)
        if ctx is None or ctx.released:
            rep, _ = await super().on_abort(peer, h, payload)
            return self._abort_reply(rep, streams), b""
        seq = ctx.seq
        prefilling = seq.num_computed < seq.prompt_len
        at_cancel = seq.prefill_chunks
        self.engine.cancel(seq)  # no chunk of it is scheduled after the one in flight
        rep, _ = await super().on_abort(peer, h, payload)  # the release runs at the step's end
        after = seq.prefill_chunks - at_cancel
        self.counters["prefill_chunks_after_cancel"] = self.counters.get("prefill_chunks_after_cancel", 0) + after
        if prefilling:
            self.counters["prefill_cancelled"] = self.counters.get("prefill_cancelled", 0) + 1
        self.prefill_cancels.append({"rid": rid, "chunks": seq.prefill_chunks, "chunks_after_cancel": after,
                                     "prefilled_tokens": min(seq.num_computed, seq.prompt_len),
                                     "prompt_tokens": seq.prompt_len})
        return self._abort_reply(rep, streams), b""

    @staticmethod
    def _abort_reply(rep: dict, streams: bool) -> dict:
        """The base abort reply (:class:`AbortOk`) with P's ``streams``: whether this P started
        streaming the request's KV (the gateway writes off its planned WAN bytes if not)."""
        ok = AbortOk.decode(rep)
        ok.streams = streams
        return ok.wire()

    def extra_stats(self) -> dict:
        live = [c for c in list(self.reqs.values()) if not c.released and
                (not c.extra.get("streaming") or not getattr(c.extra.get("progress"), "settled", True))]
        return {
            "prefill_chunks_run": self.engine.prefill_chunks,
            # requests prefilling now (or queued for it): rid -> chunks run so far, prompt tokens computed
            "prefill_live": {c.rid: {"chunks": c.seq.prefill_chunks,
                                     "prefilled_tokens": min(c.seq.num_computed, c.seq.prompt_len),
                                     "prompt_tokens": c.seq.prompt_len} for c in live},
            "prefill_cancels": list(self.prefill_cancels),
            "kv_bytes_sent": dict(self.bytes_sent),
            "wan_bytes_sent": self.wan_bytes_sent,
            "wan_lane_transfers": dict(self.lane_transfers),
            # link.wan_connections > 1: payload bytes each connection of a striped lane carried
            "wan_stripe_bytes": {k: list(s.bytes_by_connection) for k, s in list(self.senders.items()) if s.striped},
            # KV payload bytes queued to each target and not yet written (its lanes together)
            "kv_backlog_bytes": {n: sum(s.backlog_bytes for s in self._senders_of(n))
                                 for n in {k.removesuffix(EXPRESS) for k in list(self.senders)}},
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
        if s is not None and s.connection_closed:
            await s.close()  # its transfers already failed with the connection
        if s is None or s.connection_closed:
            # the fingerprint refuses an instance of another model (architecture, layers, KV heads,
            # head dim, weights: HandshakeError, never retried) and tells the target's KV layout
            # (page size, dtype: pdd.transfer.layout); a dead target is not retried for long (the
            # gateway recovers the request elsewhere)
            async def connect_one():
                return await connect_peer(host, port, {}, role=self.spec.role, instance=self.spec.name, retries=5,
                                         fingerprint=self.kv_fingerprint(), handshake_check=kv_handshake_check,
                                         **self.liveness_kw(),
                                         **link_security(self.cfg, self.spec.name).client(name, fast=not wan))
            peer = await connect_one()
            # the bulk lane of a WAN target may be striped over link.wan_connections connections
            # (pdd.transfer.kv.KVSender(peers=...), docs/LINK.md "Parallel connections")
            n_extra = self.cfg.link.wan_connections - 1 if wan and key == name else 0
            extra = [await connect_one() for _ in range(n_extra)]
            rate = None if wan else self.cfg.link.fast_gbps
            # over the WAN, what the socket already holds (and the frame being written) goes first
            # whatever the send order: the socket's buffer is kept to ~1 BDP, frames to half of it
            cap = send_buffer_bytes(self.cfg.link.wan_gbps, self.cfg.link.wan_rtt_ms,
                                    self.cfg.policy.wan_send_buffer_bdp) if wan else None
            s = KVSender(peer, rate_gbps=rate, order=self.cfg.policy.wan_order if wan else "fifo",
                         max_frame_bytes=cap // 2 if cap is not None else None,
                         stall_timeout_s=self.cfg.liveness.kv_stall_timeout_s, peers=extra)
            if cap is not None:
                for pe in s.peers:
                    set_socket_buffer(pe.writer, cap)
                    # and nothing waits in user space: TLS alone would hold 512 KiB ahead of the order
                    limit_write_buffers(pe.writer.transport)
            self.senders[key] = s
        return s, wan

    def on_seq_failed(self, seq_id, error: str, client_error: bool = False) -> None:
        """The engine dropped a request (its pages are already freed there): a layer-wise stream of
        it is cancelled (no frame reads those pages again) and its prefill call fails (with
        ``detail.client_error`` when it is the request's own failure: ``client_error``)."""
        ctx = self.reqs.get(seq_id)
        super().on_seq_failed(seq_id, error, client_error)
        prog = ctx.extra.get("progress") if ctx is not None else None
        if prog is not None:
            prog.fail(RuntimeError(error))
            for s in self.senders.values():
                s.cancel(seq_id)
        # its prefill call fails (whole mode too), also when it failed before ``on_prefill`` put it
        # in ``reqs`` (the engine's first step can end before the loop resumes that call)
        fut = self.first_token_waiters.pop(seq_id, None)
        if fut is not None and not fut.done():
            fut.set_exception(CallFailed(error, client_error=True) if client_error else RuntimeError(error))

    def _watch(self, e, seq, progress: LayerProgress) -> None:
        """Engine thread: hand each layer's progress of ``seq``'s prefill to ``progress`` on the loop
        (``EngineWorker.layer_done`` paces it to an emulated step's layers)."""
        loop = self.worker.loop
        num_layers = e.model_cfg.num_hidden_layers

        def on_layer(layer: int, tokens: int, ready) -> None:
            if layer < 0:  # preempted: its pages are gone
                loop.call_soon_threadsafe(progress.fail, RuntimeError(f"request {seq.seq_id}: KV preempted"))
                return
            self.worker.layer_done(layer, num_layers, lambda: progress.advance(layer, tokens, ready))

        e.watch_kv(seq.seq_id, on_layer)

    def on_events(self, events: list) -> None:
        for ev in events:
            fut = self.first_token_waiters.pop(ev.seq_id, None)
            if fut is not None and not fut.done():
                fut.set_result(ev)

    def _check_targets(self, targets: list) -> None:
        """Raise MessageError naming the first of a ``prefill``'s ``targets`` that is neither a
        planned target (``name`` of an instance of this topology, ``first_page`` >= 0, optional
        ``relay`` bool and ``last_page`` int) nor a deferred slot (``slot`` str, ``deferred``
        true), before any work is done for the request."""
        for i, t in enumerate(targets):
            where = f"message 'prefill': targets[{i}]"
            if not isinstance(t, dict):
                raise MessageError(f"{where} must be a map, got {type(t).__name__}")
            if t.get("deferred") is True:
                if not isinstance(t.get("slot"), str):
                    raise MessageError(f"{where}: a deferred slot needs a str 'slot'")
                continue
            name, first = t.get("name"), t.get("first_page")
            if not isinstance(name, str) or not isinstance(first, int) or isinstance(first, bool):
                raise MessageError(f"{where}: a planned target needs a str 'name' and an int 'first_page' "
                                   f"(or 'slot' with 'deferred': true)")
            try:
                self.layout.get(name)
            except KeyError as e:
                raise MessageError(f"{where}: {e.args[0]}") from None
            if first < 0:
                raise MessageError(f"{where}: first_page {first} is negative")
            for k, tp in (("relay", bool), ("last_page", int)):
                if k in t and not isinstance(t[k], tp):
                    raise MessageError(f"{where}: '{k}' must be {tp.__name__}, got {type(t[k]).__name__}")

    async def on_prefill(self, peer, h, payload):
        m = Prefill.decode(h)
        rid = m.rid
        prompt = list(m.prompt_ids)
        sp = SamplingParams.from_dict(m.sampling)
        p_sp = SamplingParams.from_dict({**sp.to_dict(), "max_tokens": 1, "ignore_eos": True})
        if rid in self._aborted:
            raise RuntimeError(f"request {rid} was aborted")
        self._check_targets(m.targets)
        if rid in self.reqs or rid in self.first_token_waiters:
            # one sequence per rid: a second would take the first's first-token waiter (its prefill
            # call would never answer) and its place in ``reqs`` (its pages released by rid)
            raise RuntimeError(f"request {rid} is already held here")
        # the waiter exists before the sequence can run, so its first token is never missed
        fut = asyncio.get_running_loop().create_future()
        self.first_token_waiters[rid] = fut
        layerwise = self.cfg.policy.kv_stream == "layerwise"
        box: dict = {}

        def _new_and_add(e):
            # one engine-thread call: a second call would wait for the forward pass the engine
            # starts meanwhile (a whole prefill step on a busy P) before the request joins a batch
            s = e.new_sequence(rid, prompt, p_sp, use_cache=True, min_uncached=1)
            if layerwise:  # watched before it can run: no layer's progress is missed
                box["progress"] = LayerProgress(e.model_cfg.num_hidden_layers, len(prompt), s.num_computed)
                self._watch(e, s, box["progress"])
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
        ps = self.engine.pool.page_size
        n_pages = (len(prompt) + ps - 1) // ps
        progress: LayerProgress | None = box.get("progress")
        first_tok: dict = {}  # layerwise: the first token's t0 / fin once known (the streams read it)
        if progress is not None:
            # the streams start with the prefill: each layer group's pages go as they are computed
            ctx.extra["progress"] = progress
            self._start_streams(ctx, m.targets, n_pages, progress, first_tok)
        try:
            ev = await fut
        except BaseException as e:
            if seq.status == SeqStatus.RELEASED and self.reqs.get(rid) is ctx:
                # the engine failed it (its pages are freed there) before on_seq_failed found it here
                ctx.released = True
                self.reqs.pop(rid, None)
                self._req_gone(ctx)
            if progress is not None:  # aborted or failed while prefilling: the streams are cut
                progress.fail(RuntimeError(f"request {rid} aborted"))
                if isinstance(e, Exception):  # they started: P reports them in xfer_done
                    raise CallFailed(str(e), streams=True, **(e.detail if isinstance(e, CallFailed) else {})) from e
            raise
        ctx.in_engine = False
        if ctx.released:
            if progress is not None:
                raise CallFailed(f"request {rid} aborted", streams=True)
            raise RuntimeError(f"request {rid} aborted")
        t0 = int(ev.token_id)
        fin = first_token_finish(t0, sp, self.eos_ids)
        if getattr(ev, "logprobs", None) is not None:
            ctx.extra["lp0"] = ev.logprobs  # travels to RLD / MD in kv_done
        cached = int(seq.num_cached_tokens)
        self.record_hit(cached, len(prompt))
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
        if progress is not None:
            first_tok.update(t0=t0, fin=fin)
            # the overlap: KV bytes already written to the links when the prefill ended
            early = sum(tr.bytes_sent for snd in list(self.senders.values()) for tr in snd.transfers(rid))
            self.counters["kv_bytes_before_first_token"] = self.counters.get("kv_bytes_before_first_token", 0) + early
            if fin is not None:
                # a relayed request finished by its first token: MD never decodes it, so its WAN
                # stream stops here (as in whole mode, where it never starts); before the seal, so
                # no kv_done goes to MD
                for tr in ctx.extra.get("relay_transfers", ()):
                    if tr.cancel():
                        self.counters["cancelled_transfers"] = self.counters.get("cancelled_transfers", 0) + 1
            progress.seal({"first_token": t0, "fin": fin, **({"lp": ctx.extra["lp0"]} if "lp0" in ctx.extra else {})})
            return PrefillOk(rid, t0, fin, cached, n_pages, self.engine.pool.page_bytes).wire(), b""
        if ctx.released:  # aborted meanwhile (freed by on_abort): its pages must not be streamed
            raise RuntimeError(f"request {rid} aborted")
        ctx.extra["streaming"] = True  # from here on an abort cancels the streams (on_abort)
        self._streamed[rid] = None
        while len(self._streamed) > ABORTED_MEMORY:
            self._streamed.pop(next(iter(self._streamed)))
        asyncio.get_running_loop().create_task(self._stream(ctx, m.targets, t0, fin, n_pages))
        return PrefillOk(rid, t0, fin, cached, n_pages, self.engine.pool.page_bytes).wire(), b""

    def _start_streams(self, ctx: ReqCtx, targets: list[dict], n_pages: int, progress: LayerProgress,
                       first_tok: dict) -> None:
        """Layerwise: start ``ctx``'s KV streams now, while it prefills (``first`` gets the first
        token's ``t0`` and ``fin`` when it is sampled)."""
        ctx.extra["streaming"] = True  # from here on an abort cancels the streams (on_abort)
        self._streamed[ctx.rid] = None
        while len(self._streamed) > ABORTED_MEMORY:
            self._streamed.pop(next(iter(self._streamed)))
        asyncio.get_running_loop().create_task(self._stream(ctx, targets, None, None, n_pages, progress, first_tok))

    async def _stream(self, ctx: ReqCtx, targets: list[dict], t0: int | None, fin: str | None, n_pages: int,
                      progress: LayerProgress | None = None, first_tok: dict | None = None) -> None:
        """Stream ``ctx``'s prompt KV to every target, then free its pages and report ``xfer_done``.
        Whole mode: after the prefill, with its first token ``t0`` / ``fin``. Layerwise
        (``progress``): from the prefill's start, each layer group as it is computed; the first
        token comes in ``first_tok`` and ``progress``'s seal."""
        ctx.extra["streaming"] = True
        pool = self.engine.pool
        table = list(ctx.seq.page_table[:n_pages])
        result: dict[str, int] = {}
        unsent: dict[str, int] = {}
        errors: dict[str, str] = {}

        n_prompt = len(ctx.seq.prompt_ids)
        whole = self.cfg.policy.kv_whole_pages  # ablation: the partial last page goes whole
        own = KVLayout(pool.page_size, pool.dtype_name)

        def plan_of(rl: KVLayout):
            """(pages of the prompt, partial last page's slots, wire dtype, bytes of a token on the
            wire, page reader) for a receiver of layout ``rl``: page indices and the partial last
            page are the receiver's; the elements cross in ``wire_dtype`` (pdd.transfer.layout)."""
            npg = -(-n_prompt // rl.page_size)
            ls = None if whole else prompt_last_slots(n_prompt, rl.page_size)  # its filled slots only
            wdt = wire_dtype(own.dtype, rl.dtype)
            slot = wire_slot_bytes(pool.slot_bytes(), own.dtype, wdt)
            if rl.page_size == own.page_size and wdt == own.dtype:
                def reader(i: int, n: int):
                    return pool.export_pages(table[i : i + n], last_slots=ls if i + n == npg else None)
            else:  # re-chunked to the receiver's pages, cast to the wire dtype
                def reader(i: int, n: int):
                    return pool.export_tokens(table, i * rl.page_size, min((i + n) * rl.page_size, n_prompt),
                                              rl.page_size, wdt, whole_last=whole)
            return npg, ls, wdt, slot, reader

        async def layer_reader_of(rl: KVLayout, npg: int, ls, wdt: str):
            """Layerwise: ``reader(i, n, (l0, l1))`` of the receiver's pages for one layer group; on
            CUDA it waits for the group's last write (its event) and copies on a side stream, so a
            copy never waits for the later layers the engine has queued."""
            same = rl.page_size == own.page_size and wdt == own.dtype

            async def reader(i: int, n: int, layers):
                for ev in progress.events(*layers):
                    while not ev.query():
                        await asyncio.sleep(0.0002)
                with pool.copy_stream():
                    if same:
                        return pool.export_pages(table[i : i + n], layers=layers,
                                                 last_slots=ls if i + n == npg else None)
                    return pool.export_tokens(table, i * rl.page_size, min((i + n) * rl.page_size, n_prompt),
                                              rl.page_size, wdt, layers=layers, whole_last=whole)
            return reader

        def planned(rl: KVLayout, first: int, last: int | None = None) -> int:
            """Payload bytes of the receiver's pages ``[first, last)`` of the prompt (default: to its end)."""
            npg, _, _, slot, _ = plan_of(rl)
            last = npg if last is None else last
            ps = rl.page_size
            return (prompt_kv_bytes(n_prompt, first, ps, slot * ps, whole)
                    - prompt_kv_bytes(n_prompt, last, ps, slot * ps, whole))

        def book(into: dict[str, int], name: str, nbytes: int) -> None:
            # a target may get two transfers (md and md_fill): their bytes add up; -1 ("the whole
            # planned transfer") is only ever booked alone, by a main slot cut before its plan
            into[name] = nbytes if nbytes < 0 or into.get(name, 0) < 0 else into.get(name, 0) + nbytes

        async def one(t: dict) -> None:
            name = t.get("name", t.get("slot"))
            tr = first = last = None
            wan = False
            rl = own
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
                # the target's layout as configured (the gateway plans with the same): the byte
                # counts below and the lane; the handshake's fingerprint confirms it
                ec = self.cfg.engine_for(name)
                rl = KVLayout(ec.page_size, ec.dtype)
                first = int(t["first_page"])  # the receiver's pages
                npg = plan_of(rl)[0]
                last = min(npg, int(t.get("last_page", npg)))
                # layerwise: the first token may be known by now (first_tok), or not yet
                fin_now = first_tok.get("fin") if progress is not None else fin
                if fin_now is not None and t.get("relay"):
                    # a relayed request finished by its first token (EOS, a stop id, max_tokens 1):
                    # RLD emits it and MD never decodes, so its WAN stream never starts (the
                    # gateway cuts that leg too, but its cancel may come after MD's plan did)
                    book(result, name, 0)
                    book(unsent, name, planned(rl, first, last))
                    self.counters["cancelled_transfers"] = self.counters.get("cancelled_transfers", 0) + 1
                    return
                lane = wan_lane(planned(rl, first, last), self.express_max_bytes)  # sender_for: bulk off the WAN
                sender, wan = await self.sender_for(name, lane)
                got = layout_of(sender.peer.remote_fingerprint)
                if got is not None and got != rl:
                    raise ValueError(f"{name}'s KV layout is page_size {got.page_size} {got.dtype} in its handshake, "
                                     f"page_size {rl.page_size} {rl.dtype} in this topology's config: start every "
                                     "instance from the same config")
                if ctx.rid in self._aborted:  # aborted before it started (on_abort cancelled none)
                    book(result, name, 0)
                    book(unsent, name, planned(rl, first, last))
                    return
                npg, last_slots, wdt, slot, reader = plan_of(rl)
                if progress is not None:
                    groups = layer_groups(self.engine.model_cfg.num_hidden_layers, self.cfg.policy.kv_stream_layer_group)
                    tr = sender.submit_layered(
                        ctx.rid, first, await layer_reader_of(rl, npg, last_slots, wdt), last - first, progress,
                        groups, [wire_slot_bytes(pool.slot_bytes(g), own.dtype, wdt) * rl.page_size for g in groups],
                        rl.page_size, last_slots=None if last_slots is None or last < npg else last_slots,
                        dtype=wdt if wdt != rl.dtype else None, done_fields={"relay": bool(t.get("relay"))})
                    self.counters["layerwise_transfers"] = self.counters.get("layerwise_transfers", 0) + 1
                    if t.get("relay"):
                        ctx.extra.setdefault("relay_transfers", []).append(tr)
                        if first_tok.get("fin") is not None and tr.cancel():  # sampled while it connected
                            self.counters["cancelled_transfers"] = self.counters.get("cancelled_transfers", 0) + 1
                else:
                    tr = sender.submit(ctx.rid, first, reader, last - first, slot * rl.page_size,
                                       last_page_bytes=None if last_slots is None or last < npg
                                       else last_slots * slot,
                                       dtype=wdt if wdt != rl.dtype else None,  # the receiver widens
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
                     else planned(rl, first, last) if first is not None else -1)
                self.bytes_sent[name] = self.bytes_sent.get(name, 0) + sent
                if wan:
                    self.wan_bytes_sent += sent

        try:
            await asyncio.gather(*(one(t) for t in targets))
        finally:
            self._deferred.pop(ctx.rid, None)
            if progress is not None and not progress.settled:
                # layerwise: every stream may end (cut, refused) while the prefill still runs; its
                # pages are freed once it has ended too (first token, abort or failure)
                ended = asyncio.get_running_loop().create_future()
                progress.listen(lambda: progress.settled and not ended.done() and ended.set_result(None))
                await ended
            await self.release(ctx, cache=progress is None or progress.sealed)
            ctx.sink.put(XferDone(ctx.rid, result, unsent, errors).wire())
