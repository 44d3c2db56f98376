"""What every engine instance (P, RLD, MD, colocated) shares: the engine thread, the RPC server,
ordered token streams to the gateway, and the ``stats`` / ``flush`` / ``abort`` handlers.

Message types handled here (all from the gateway):
  ``stats`` -> instance counters; ``flush`` -> evict every unlocked radix-cache page and report
  free pages; ``wait_idle {timeout_s}`` -> answer once the requests held when it arrived are
  all gone, their pages freed (or once ``timeout_s`` ran out); ``abort {rid}`` -> stop the
  request and free its pages (exactly once).
"""

from __future__ import annotations

import asyncio
import logging
import resource
import time
from collections import deque
from dataclasses import dataclass, field

from pdd.config import ClusterConfig
from pdd.metrics import kv_pages
from pdd.policy.wan_estimate import KV_PROGRESS_INTERVAL_S, progress_report
from pdd.roles.worker import EngineWorker
from pdd.topology import InstanceSpec, Layout
from pdd.security import link_security
from pdd.transfer.server import Server
from pdd.transfer.kv import KVReorder
from pdd.transfer.layout import DTYPE_BYTES, kv_handshake_check, wire_slot_bytes
from pdd.transfer.messages import (OMIT, Abort, AbortOk, FlushOk, IdleOk, Kv, KvProgress, MessageError, Peek, PeekOk,
                                   ReqError, StatsOk, Tok, Toks, WaitIdle)
from pdd.types import FinishReason, SamplingParams

log = logging.getLogger(__name__)


def shown_t(h: dict) -> str:
    """A frame header's kind for a log line (``?`` when it has none that is a short str)."""
    t = h.get("t") if isinstance(h, dict) else None
    return repr(t) if isinstance(t, str) and len(t) <= 32 else "?"

HIT_WINDOW_REQUESTS = 200  # window of the windowed prefix-hit-rate gauge
ABORTED_MEMORY = 4096  # recently aborted rids remembered (refuses their late-arriving requests)


def free_sequence(engine, seq) -> None:
    """Free a new sequence nobody will own (its request's handler was cancelled while the engine
    thread created it: ``EngineWorker.call_owned``'s undo); runs on the engine thread."""
    engine.release(seq, cache=False)


def first_token_finish(token_id: int, sp: SamplingParams, eos_ids: set[int]) -> str | None:
    """Finish reason after the first output token (sampled by P), or None to keep decoding."""
    if not sp.ignore_eos and token_id in eos_ids:
        return FinishReason.STOP.value
    if token_id in set(sp.stop_token_ids):
        return FinishReason.STOP.value
    if sp.max_tokens <= 1:
        return FinishReason.LENGTH.value
    return None


class OrderedSender:
    """One-way messages to one peer, sent strictly in the order they were put.

    Token messages queued back to back (every running request's token of one engine step) go
    as one ``toks {msgs: [...]}`` frame: one write instead of one per request and token.
    """

    def __init__(self, peer):
        self.peer = peer
        self.q: asyncio.Queue = asyncio.Queue()
        self.task = asyncio.get_running_loop().create_task(self._run())

    def put(self, header: dict, payload: bytes = b"") -> None:
        self.q.put_nowait((header, payload))

    async def flush(self) -> None:
        await self.q.join()

    async def _send(self, header: dict, payload) -> None:
        try:
            await self.peer.send(header, payload)
        except Exception as e:  # the peer went away; the request owner times out / aborts
            log.warning("send %s to peer failed: %s", header.get("t"), e)

    async def _run(self) -> None:
        while True:
            items = [await self.q.get()]
            while not self.q.empty():
                items.append(self.q.get_nowait())
            batch: list[dict] = []
            for header, payload in items:
                if header.get("t") == "tok" and not payload:
                    batch.append(header)
                    continue
                if batch:
                    await self._send(Toks(batch).wire(), b"")
                    batch = []
                await self._send(header, payload)
            if batch:
                await self._send(Toks(batch).wire(), b"")
            for _ in items:
                self.q.task_done()


@dataclass
class ReqCtx:
    """Per-request state on one instance."""

    rid: str
    seq: object  # engine Sequence
    sink: OrderedSender  # where this request's tokens go (the gateway)
    sampling: SamplingParams
    released: bool = False
    in_engine: bool = False
    extra: dict = field(default_factory=dict)
    # set on the engine thread once :meth:`EngineInstance.release` freed the pages there: a
    # ``flush`` (run on that thread too) reads it to count the requests still holding pages
    pages_freed: bool = False


class EngineInstance:
    """Base for the engine roles. Subclasses add handlers in :meth:`handlers`."""

    tier = "?"

    def __init__(self, cfg: ClusterConfig, spec: InstanceSpec, lay: Layout):
        self.cfg, self.spec, self.layout = cfg, spec, lay
        self.reqs: dict[str, ReqCtx] = {}
        self.sinks: dict[int, OrderedSender] = {}
        self.server = None
        self.engine = None
        self.worker: EngineWorker | None = None
        self.started_at = time.time()
        self.engine_cfg = cfg.engine_for(spec.name)  # this instance's own hardware (cfg.tiers over cfg.engine)
        self.counters: dict[str, int] = {"requests": 0, "aborted": 0, "finished": 0}
        self.prefix_hit_tokens = 0
        self.prompt_tokens = 0
        self.hit_window: deque[tuple[int, int]] = deque(maxlen=HIT_WINDOW_REQUESTS)
        # rids aborted here recently: a request message that arrives after its abort (calls run
        # concurrently; an abort can overtake a reservation still being allocated) is refused
        self._aborted: dict[str, None] = {}
        # requests taken out of ``reqs`` whose pages are being freed (id -> ctx), and the
        # ``wait_idle`` calls waiting for requests to go: (the requests still awaited, by id;
        # the future set once none is left)
        self._freeing: dict[int, ReqCtx] = {}
        self._idle_waiters: list[tuple[dict[int, ReqCtx], asyncio.Future]] = []

    def record_hit(self, cached_tokens: int, prompt_tokens: int) -> None:
        """One request's prefix-cache lookup (for the token-weighted hit-rate gauges)."""
        self.prefix_hit_tokens += cached_tokens
        self.prompt_tokens += prompt_tokens
        self.hit_window.append((cached_tokens, prompt_tokens))

    def hit_stats(self) -> dict:
        """Token-weighted prefix hit rates: since start, and over the last HIT_WINDOW_REQUESTS."""
        wh = sum(h for h, _ in self.hit_window)
        wt = sum(t for _, t in self.hit_window)
        return {"prefix_hit_tokens": self.prefix_hit_tokens, "prompt_tokens": self.prompt_tokens,
                "prefix_hit_rate": self.prefix_hit_tokens / self.prompt_tokens if self.prompt_tokens else 0.0,
                "prefix_hit_rate_window": wh / wt if wt else 0.0, "hit_window_requests": len(self.hit_window)}

    # ------------------------------------------------------------------ set-up
    def load_engine(self):
        from pdd.engine.engine import Engine

        e = self.engine_cfg
        return Engine.from_pretrained(
            self.cfg.model_path,
            num_pages=e.num_pages,
            page_size=e.page_size,
            dtype=e.dtype,
            device=e.device,
            max_batch_tokens=e.max_batch_tokens,
            prefill_chunk_tokens=e.prefill_chunk_tokens,
            prefill_order=e.prefill_order,
            max_running_seqs=e.max_running,
            max_waiting=self.cfg.limits.waiting(e.max_running),  # bounded queue: TierBusy beyond it
        )

    def handlers(self) -> dict:
        hs = {"stats": self.on_stats, "flush": self.on_flush, "abort": self.on_abort, "peek": self.on_peek,
              "wan_probe": self.on_wan_probe, "wait_idle": self.on_wait_idle}
        if self.spec.name in self.cfg.rerole:  # may change role at run time (pdd.roles.rerole)
            from pdd.roles.rerole import SET_ROLE, on_set_role

            hs[SET_ROLE] = lambda peer, h, payload: on_set_role(self, peer, h, payload)
        return hs

    async def on_wan_probe(self, peer, h, payload):
        """The gateway's WAN probe (``pdd.policy.wan_estimate.probe_due``): answered at once."""
        return None

    async def on_peek(self, peer, h, payload):
        """Routing probe: how many of the prompt's tokens this instance's radix cache holds
        (whole pages; no lock, no ref, no stats)."""
        prompt = Peek.decode(h).prompt_ids

        def _peek(e):
            return e.radix.peek(prompt) * e.page_size if e.radix is not None else 0

        return PeekOk(await self.worker.call(_peek, overlap=True)).wire(), b""

    async def start(self) -> None:
        import torch

        ec = self.engine_cfg
        torch.set_num_threads(ec.torch_threads)
        self.engine = self.load_engine()
        self.engine.warm_structured()  # structured outputs' tokenizer, off the engine thread
        self.eos_ids = set(self.engine.eos_token_ids)
        loop = asyncio.get_running_loop()
        step_time = None
        if ec.profile is not None:  # emulate that chip's prefill/decode cost curve
            from pdd.step_profile import load_step_model

            step_time = load_step_model(ec.profile).step_time
        self.worker = EngineWorker(self.engine, loop, self.on_events, self.on_seq_failed,
                                   min_step_s=ec.min_step_ms / 1000.0, step_time_s=step_time)
        self.worker.start()
        hs = self.handlers()
        if "kv_done" in hs:
            hs["kv_done"] = self._first_token_logprobs(hs["kv_done"])
        # a striped sender's frames (link.wan_connections > 1) are handed on in their order
        self.kv_reorder = KVReorder()
        hs = self.kv_reorder.wrap(hs)
        self.server = Server(self.cfg.host, self.spec.port, hs, role=self.spec.role, instance=self.spec.name,
                             fingerprint=self.kv_fingerprint(), handshake_check=kv_handshake_check,
                             **self.liveness_kw(),
                             **link_security(self.cfg, self.spec.name).server())  # mTLS / fast-path MAC
        await self.server.start()
        from pdd.metrics import start_instance_metrics

        start_instance_metrics(self, self.spec.metrics_port, self.cfg.host)

    def liveness_kw(self) -> dict:
        """Heartbeat settings for this instance's connections (``cfg.liveness``; ``pdd.transfer.peer`` module docs)."""
        lv = self.cfg.liveness
        return {"heartbeat_s": lv.heartbeat_interval_s, "dead_after_s": lv.dead_after_s}

    def kv_fingerprint(self) -> dict:
        """What two instances exchanging KV pages announce in the connection handshake
        (``pdd.transfer.layout.kv_handshake_check``): the model, which must be equal (a mismatch
        refuses the connection, naming the field): architecture (HF model_type), layers, KV heads,
        head dim and a digest of the weights (file names, sizes and their first and last MiB: cheap
        for any size); and the KV layout, page size (tokens) and KV dtype, which may differ (the
        sender converts to the receiver's, ``pdd.transfer.layout``)."""
        pool = self.engine.pool
        return {"page_size": int(pool.page_size), "kv_dtype": str(pool.dtype_name),
                "architecture": str(pool.model_cfg.model_type), "num_layers": int(pool.num_layers),
                "num_kv_heads": int(pool.num_kv_heads), "head_dim": int(pool.head_dim),
                "weights": weights_digest(self.cfg.model_path)}

    async def stop(self) -> None:
        if self.worker:
            self.worker.stop()
        if self.server:
            await self.server.close()

    def sink_for(self, peer) -> OrderedSender:
        s = self.sinks.get(id(peer))
        if s is None or s.peer is not peer:
            s = OrderedSender(peer)
            self.sinks[id(peer)] = s
            peer.on_close(self._owner_gone)
        return s

    async def _owner_gone(self, peer) -> None:
        """The connection to a requests' owner (the gateway) closed, e.g. its heartbeat found it
        dead behind a WAN outage: nobody will finish or abort those requests, so abort them here
        (pages freed once; P's transfers cancelled and drained first)."""
        s = self.sinks.pop(id(peer), None)
        if s is not None:
            s.task.cancel()
        for rid in [r for r, c in list(self.reqs.items()) if c.sink.peer is peer]:
            self.counters["orphaned"] = self.counters.get("orphaned", 0) + 1
            try:
                await self.on_abort(peer, Abort(rid).wire(), b"")
            except Exception:
                log.exception("%s: abort of orphaned %s failed", self.spec.name, rid)

    # ------------------------------------------------------------------ tokens
    def emit(self, ctx: ReqCtx, pos: int, token_id: int, fin: str | None, lp: dict | None = None) -> None:
        """``lp``: the token's logprob info from the logits that chose it (``{"lp", "top"}``), when
        the request asked for logprobs; the first token's comes from P inside ``kv_done``."""
        if lp is None and pos == 0:
            lp = ctx.extra.pop("lp0", None)
        ctx.sink.put(Tok(ctx.rid, pos, int(token_id), fin, self.tier, OMIT if lp is None else lp).wire())

    def _first_token_logprobs(self, handler):
        """Wrap a ``kv_done`` handler: keep the first token's logprob info that P sampled it with
        (``kv_done {lp}``) for the ``emit`` of position 0."""

        async def on_kv_done(peer, h, payload):
            ctx = self.reqs.get(h.get("rid"))
            if ctx is not None and h.get("lp") is not None:
                ctx.extra["lp0"] = h["lp"]
            return await handler(peer, h, payload)

        return on_kv_done

    def on_events(self, events: list) -> None:
        """Engine thread -> loop: stream each new token to its request's sink."""
        for ev in events:
            ctx = self.reqs.get(ev.seq_id)
            if ctx is None:
                continue
            fin = ev.finish_reason.value if (ev.finished and ev.finish_reason is not None) else None
            if ev.finished and fin is None:
                fin = FinishReason.STOP.value
            self.emit(ctx, ev.position, ev.token_id, fin, getattr(ev, "logprobs", None))
            if ev.finished:
                ctx.in_engine = False
                self.counters["finished"] += 1
                asyncio.get_running_loop().create_task(self.release(ctx, cache=self.cache_on_finish))

    cache_on_finish = True

    def on_seq_failed(self, seq_id, error: str, client_error: bool = False) -> None:
        """The engine dropped a request (e.g. out of KV pages): tell its owner, forget it.
        ``client_error``: the request's own failure (``ReqError.client_error``)."""
        ctx = self.reqs.pop(seq_id, None)
        if ctx is None:
            return
        ctx.released = True  # the engine thread already released its pages
        self._req_gone(ctx)
        self.counters["failed"] = self.counters.get("failed", 0) + 1
        ctx.sink.put(ReqError(ctx.rid, f"{self.spec.name}: {error}", True if client_error else OMIT).wire())

    async def release(self, ctx: ReqCtx, cache: bool) -> None:
        """Free the request's pages exactly once (inserting whole pages into the radix cache)."""
        if ctx.released:
            return
        ctx.released = True
        self.reqs.pop(ctx.rid, None)
        self._freeing[id(ctx)] = ctx
        seq = ctx.seq

        def _rel(e):
            e.release(seq, cache=cache)  # also takes it out of the running batch
            ctx.pages_freed = True

        try:
            await self.worker.call(_rel, overlap=not ctx.in_engine)  # out of the batch: not the step's outputs
        finally:
            self._freeing.pop(id(ctx), None)
            self._req_gone(ctx)

    def _req_gone(self, ctx: ReqCtx) -> None:
        """``ctx`` is gone from this instance, its pages freed: answer the ``wait_idle`` calls
        that waited for nothing else."""
        for held, fut in self._idle_waiters:
            held.pop(id(ctx), None)
            if not held and not fut.done():
                fut.set_result(None)

    async def on_wait_idle(self, peer, h, payload):
        """``wait_idle {timeout_s}``: answer :class:`IdleOk` once every request held here when it
        arrived (in ``reqs``, or out of it with its pages still being freed) is gone, its pages
        freed, or once ``timeout_s`` seconds have passed; woken by the requests' release, not
        by a clock. A request arriving meanwhile is not waited for."""
        timeout_s = max(0.0, float(WaitIdle.decode(h).timeout_s))
        held = {id(c): c for c in self.reqs.values()}
        held.update(self._freeing)
        n = len(held)
        if held:
            fut = asyncio.get_running_loop().create_future()
            entry = (held, fut)
            self._idle_waiters.append(entry)
            try:
                await asyncio.wait({fut}, timeout=timeout_s)
            finally:
                self._idle_waiters.remove(entry)
                fut.cancel()
        return IdleOk(self.spec.name, n, len(held), len(self.reqs)).wire(), b""

    # ------------------------------------------------------------------ handlers
    async def on_stats(self, peer, h, payload):
        ru = resource.getrusage(resource.RUSAGE_SELF)
        e = self.engine
        runner = getattr(e, "runner", None)
        return StatsOk(
            name=self.spec.name,
            role=self.spec.role,
            dc=self.spec.dc,
            pages_total=e.pool.num_pages,
            pages_free=e.pool.num_free,
            page_bytes=e.pool.page_bytes,
            hardware=self.hardware(),
            running=len(self.reqs),
            forward_calls=getattr(runner, "forward_calls", 0),
            engine_steps=self.worker.steps,
            engine_busy_s=round(self.worker.busy_s, 4),
            engine_held_s=round(self.worker.held_s, 4),  # of busy_s: steps held to engine.min_step_ms
            preemptions=getattr(e, "preemptions", 0),
            cpu_seconds=ru.ru_utime + ru.ru_stime,
            counters=dict(self.counters),
            # pages only the prefix cache holds (reclaimable): /metrics pdd_kv_pages{state="cached"}
            extra={"pages_cached": kv_pages(e.pool)[2], **self.extra_stats()},
        ).wire(), b""

    def extra_stats(self) -> dict:
        return {}

    def hardware(self) -> dict:
        """This instance's emulated hardware profile (``ClusterConfig.hardware_profile``), its KV
        pool's dtype and page size as built."""
        pool = self.engine.pool
        return {**self.cfg.hardware_profile(self.spec.name), "dtype": str(pool.dtype_name),
                "page_size": int(pool.page_size), "num_pages": int(pool.num_pages)}

    async def on_flush(self, peer, h, payload):
        """``flush``: evict every unlocked prefix-cache page; :class:`FlushOk` with the pages
        then free and ``live_requests``: the requests in ``reqs`` after it, and those out of
        ``reqs`` whose pages were not yet freed when the engine thread counted the free pages
        (``_freeing``: an abort's or a finish's release still waiting for the engine thread;
        ``ReqCtx.pages_freed``, read on that thread), so a release under way is live there,
        never read as leaked pages (the gateway waits for it: ``wait_idle``)."""
        before = {id(c): c for c in [*self.reqs.values(), *self._freeing.values()]}

        def _flush(e):
            free0 = e.pool.num_free
            e.flush_cache()
            held = {k for k, c in before.items() if not c.pages_freed}
            return e.pool.num_pages, e.pool.num_free, e.pool.num_free - free0, held

        total, free, dropped, held = await self.worker.call(_flush)
        live = held | {id(c) for c in self.reqs.values()}
        return FlushOk(self.spec.name, total, free, len(live), dropped).wire(), b""

    def note_aborted(self, rid: str) -> None:
        self._aborted[rid] = None
        while len(self._aborted) > ABORTED_MEMORY:
            self._aborted.pop(next(iter(self._aborted)))

    async def admitted(self, ctx: ReqCtx) -> None:
        """Call once a new request's sequence exists: if the request was aborted meanwhile, free
        it now and raise (the owner gave up on it; its pages must not wait for anyone)."""
        if ctx.rid in self._aborted:
            ctx.seq.cancelled = True  # the engine schedules none of it while its release waits
            await self.release(ctx, cache=False)
            raise RuntimeError(f"request {ctx.rid} was aborted")

    async def on_abort(self, peer, h, payload):
        rid = Abort.decode(h).rid
        self.note_aborted(rid)
        ctx = self.reqs.get(rid)
        if ctx is not None:
            self.counters["aborted"] += 1
            await self.release(ctx, cache=False)
        return AbortOk(rid, ctx is not None).wire(), b""

    # ------------------------------------------------------------------ KV receive (RLD, MD)
    async def on_kv(self, peer, h, payload):
        ctx = self.reqs.get(h.get("rid")) if isinstance(h.get("rid"), str) else None
        try:
            m = Kv.decode(h)
        except MessageError as e:
            await self.refuse_kv(ctx, h, str(e))
            return None
        if ctx is None:
            return None  # aborted meanwhile: drop the frame
        try:
            self.import_frame(ctx, m, payload)
        except ValueError as e:
            await self.refuse_kv(ctx, h, str(e))
        return None

    def note_kv_refused(self, line: str, *args) -> None:
        """Count a ``kv`` / ``kv_done`` frame this instance does not take (``counters["kv_refused"]``)
        and log its one warning line (``line % args``)."""
        self.counters["kv_refused"] = self.counters.get("kv_refused", 0) + 1
        log.warning(line, *args)

    async def refuse_kv(self, ctx: ReqCtx | None, h: dict, why: str) -> None:
        """A ``kv`` / ``kv_done`` frame this instance cannot take (malformed, pages outside the
        request's uncached prompt pages, the wrong page size or dtype, after the request's KV was
        complete): one log line, counted in ``kv_refused``. The frame's request (``ctx``; None:
        not held here, only logged) fails with ``req_error`` naming why, and its pages are freed
        without caching anything: its prompt's KV is incomplete, so decoding it would be wrong."""
        self.note_kv_refused("refused a %s frame of %s: %s", shown_t(h),
                             ctx.rid if ctx is not None else "a request not held here", why)
        if ctx is None or ctx.released:
            return
        ctx.sink.put(ReqError(ctx.rid, f"{self.spec.name}: refused a KV frame: {why}").wire())
        await self.release(ctx, cache=False)

    async def first_token_refused(self, ctx: ReqCtx, h: dict, token_id) -> bool:
        """Check P's first token in a ``kv_done`` (``token_id``) against this model's vocabulary:
        an id outside it would fail the forward pass of every request batched with it. If it is
        outside (or missing), refuse the frame as :meth:`refuse_kv` does (one line, ``kv_refused``
        counted, the request failed with ``req_error``, its pages freed) and return True."""
        why = None
        if token_id is OMIT or isinstance(token_id, bool) or not isinstance(token_id, int):
            why = "it carries no first_token"
        else:
            try:
                self.engine.check_token_ids([token_id], "output")
            except ValueError as e:
                why = str(e)
        if why is None:
            return False
        await self.refuse_kv(ctx, h, f"kv_done of {ctx.rid!r}: {why}")
        return True

    def import_frame(self, ctx: ReqCtx, m: Kv, payload) -> None:
        """Copy one ``kv`` frame's pages (``first_page``, ``n_pages``, ``layers``,
        ``last_page_bytes``, ``dtype``) into ``ctx``'s page table. The frame is in this
        instance's pages; ``layers`` ``[l0, l1)`` (None: all) is the frame's layer range (one
        unit of a layer-wise stream carries one layer group of its pages); ``dtype`` (the
        sender's, narrower than this pool's: ``pdd.transfer.layout``) is widened on import.
        Raises ValueError for a frame whose ``page_bytes`` is not one of this pool's pages of
        those layers in that dtype, a partial last page that is not whole token slots, pages
        outside the request's uncached prompt pages (below its prefix-cache hit, whose pages the
        radix cache shares, or past the prompt's last page), or a frame after the request's
        ``kv_done``."""
        first, n = int(m.first_page), int(m.n_pages)
        pool = self.engine.pool
        seq = ctx.seq
        if ctx.extra.get("kv_complete") or ctx.extra.get("kv_done"):
            raise ValueError(f"kv frame of {m.rid!r} after its kv_done (the prompt's KV is complete)")
        # the prompt's pages this request computes: the prefix-cache hit below ``lo`` is shared
        # with other requests (the radix cache's), never written by a transfer
        lo, hi = int(seq.num_cached_tokens) // pool.page_size, -(-int(seq.prompt_len) // pool.page_size)
        if n < 0 or first < lo or first + n > hi:
            raise ValueError(f"kv frame of {m.rid!r}: pages [{first}, {first + n}) are not within its uncached "
                             f"prompt pages [{lo}, {hi})")
        pages = seq.page_table[first : first + n]
        layers = tuple(m.layers) if m.layers is not None else None
        if layers is not None and len(layers) != 2:
            raise ValueError(f"kv frame of {m.rid!r}: layers {list(layers)} is not a range [l0, l1]")
        src = str(m.dtype if m.dtype is not OMIT and m.dtype else pool.dtype_name)
        if src not in DTYPE_BYTES:
            raise ValueError(f"kv frame of {m.rid!r}: dtype {src!r} is not one of {sorted(DTYPE_BYTES)}")
        slot = wire_slot_bytes(pool.slot_bytes(layers), pool.dtype_name, src)
        if int(m.page_bytes) != slot * pool.page_size:
            raise ValueError(f"kv frame of {m.rid!r}: page_bytes {m.page_bytes} is not a page of "
                             f"{pool.page_size} tokens in {src} ({slot * pool.page_size} bytes)")
        last_slots = None
        if m.last_page_bytes is not OMIT and m.last_page_bytes is not None:  # the prompt's last page, its filled slots only
            last_slots, rest = divmod(int(m.last_page_bytes), slot)
            if rest:
                raise ValueError(f"kv frame of {m.rid!r}: last_page_bytes {m.last_page_bytes} is not whole "
                                 f"token slots of {slot} bytes")
        pool.import_pages(pages, payload, layers=layers, last_slots=last_slots,
                          src_dtype=None if src == pool.dtype_name else src)
        ctx.extra["pages_received"] = ctx.extra.get("pages_received", 0) + n
        if "kv_first_s" not in ctx.extra:  # the rate is measured from the end of the first frame
            now = time.perf_counter()
            ctx.extra["kv_first_s"] = now
            ctx.extra["kv_bytes"] = 0
            ctx.extra["kv_total"] = len(payload)
            ctx.extra["kv_mark"] = (now, len(payload))  # kv_progress's last report: (time, bytes)
        else:
            ctx.extra["kv_bytes"] += len(payload)
            ctx.extra["kv_total"] += len(payload)

    def kv_progress(self, ctx: ReqCtx, interval_s: float = KV_PROGRESS_INTERVAL_S,
                    now: float | None = None) -> KvProgress | None:
        """The progress report of ``ctx``'s KV while it arrives (``kv_progress``, to the gateway's
        cut-off): once ``interval_s`` seconds (perf_counter ``now``, default the clock's) have
        passed since the previous report, or since the first frame arrived, the payload bytes
        received so far and the rate since then (Gbit/s), and the next interval starts; else
        None (also before a frame after the first, and once the KV is complete)."""
        mark = ctx.extra.get("kv_mark")
        if mark is None or ctx.extra.get("kv_complete"):
            return None
        now = time.perf_counter() if now is None else now
        t0, b0 = mark
        total = int(ctx.extra["kv_total"])
        rep = progress_report(t0, b0, now, total, interval_s)
        if rep is None:
            return None
        ctx.extra["kv_mark"] = (now, total)
        return KvProgress(ctx.rid, total, rep[1])

    def kv_rate_sample_gbps(self, ctx: ReqCtx, min_bytes: int = 256 * 1024, wait_s: float = 0.0) -> float | None:
        """Receive rate of this request's KV, Gbit/s: bytes of the frames after the first over the
        time since the first arrived, less ``wait_s`` (seconds the sender had nothing to send:
        a layer-wise stream waiting for the prefill, ``kv_done``'s ``kv_wait_s``); None if too
        small to say anything about the line (small transfers measure the RTT, not the rate)."""
        b = ctx.extra.get("kv_bytes", 0)
        t0 = ctx.extra.get("kv_first_s")
        dt = time.perf_counter() - t0 - max(0.0, wait_s) if t0 is not None else 0.0
        if b < min_bytes or dt <= 0:
            return None
        return b * 8 / dt / 1e9


def weights_digest(model_path: str) -> str:
    """sha256 (hex, 16 chars) of a checkpoint's config and weight files: name, size, first and
    last MiB of each (two checkpoints differing anywhere else are not told apart)."""
    import hashlib
    from pathlib import Path

    h = hashlib.sha256()
    root = Path(model_path)
    files = sorted(p for p in root.iterdir() if p.suffix in (".safetensors", ".bin", ".json") and p.is_file()) \
        if root.is_dir() else []
    for p in files:
        size = p.stat().st_size
        h.update(f"{p.name}:{size}:".encode())
        with open(p, "rb") as f:
            h.update(f.read(1 << 20))
            if size > 2 << 20:
                f.seek(-(1 << 20), 2)
                h.update(f.read(1 << 20))
    return h.hexdigest()[:16]


async def serve_instance(inst) -> int:
    """Start an instance, print ``READY <name>`` (its signal handlers in place), run until
    SIGTERM, SIGINT or SIGHUP (the terminal of a ``pdd launch`` typed by hand closed), then stop
    it cleanly (``inst.stop``) and return the signal's number. A SIGHUP ignored
    when it starts (``nohup pdd launch``) stays ignored, so the instance outlives its terminal."""
    from pdd.stop_signals import stop_waiter

    await inst.start()
    stop = stop_waiter()
    print(f"READY {inst.spec.name}", flush=True)  # after the handlers: a signal sent on READY stops it cleanly
    sig = await stop
    await inst.stop()
    return sig
