"""MD (datacenter B): decode-side radix cache (DRC), delta KV receive, extend, decode.

Also serves as the decode instance of ``same_dc_pd`` (tier ``d``, in datacenter A) and, with
``generate``, as the single engine of ``colocated``.

Messages:
  ``reserve {rid, prompt_ids, sampling, relay}`` (call, gateway): match the prompt against the
  DRC, lock the matched pages, allocate the missing ones; reply ``{md_cached_tokens,
  md_cached_pages, n_pages, page_bytes}``. Only pages ``[md_cached_pages, n_pages)`` cross the
  WAN (the partial last page is never cached, so it always does).
  ``kv`` / ``kv_done {first_token, fin}`` (from P): import; when complete either start decoding
  (no relay) or tell the gateway ``kv_ready`` and wait for the handoff.
  ``extend {rid, token_ids}`` (gateway, after RLD's handoff): the relay's output ids; MD appends
  them and its next forward pass is one extend over all of them, then it decodes on.
  ``finish {rid}`` (gateway): the relay finished the request first; keep the prompt's KV in the
  DRC (so MD's hit rate tracks P's) and free the rest.
  ``generate {rid, prompt_ids, sampling}`` (colocated only): prefill + decode here.
"""

from __future__ import annotations

from pdd.roles.base import EngineInstance, ReqCtx
from pdd.topology import ROLE_COLOCATED
from pdd.types import SamplingParams


class MainDecodeInstance(EngineInstance):
    def __init__(self, cfg, spec, lay):
        super().__init__(cfg, spec, lay)
        if spec.role == ROLE_COLOCATED:
            self.tier = "colocated"
        else:
            self.tier = "md" if spec.dc == "B" else "d"
        self.cached_tokens = 0
        self.prompt_tokens = 0

    def handlers(self) -> dict:
        return {**super().handlers(), "reserve": self.on_reserve, "kv": self.on_kv, "kv_done": self.on_kv_done,
                "extend": self.on_extend, "finish": self.on_finish, "generate": self.on_generate,
                "kv_cancel": self.on_kv_cancel, "drop": self.on_kv_cancel}

    def extra_stats(self) -> dict:
        return {"prefix_hit_tokens": self.cached_tokens, "prompt_tokens": self.prompt_tokens}

    async def on_reserve(self, peer, h, payload):
        rid = h["rid"]
        sp = SamplingParams.from_dict(h["sampling"])
        prompt = list(h["prompt_ids"])
        seq = await self.worker.call(lambda e: e.new_sequence(rid, prompt, sp, use_cache=True, min_uncached=0))
        ctx = ReqCtx(rid, seq, self.sink_for(peer), sp)
        self.reqs[rid] = ctx
        self.counters["requests"] += 1
        ps = self.engine.pool.page_size
        cached = int(seq.num_cached_tokens)
        self.cached_tokens += cached
        self.prompt_tokens += len(prompt)
        return {"t": "reserve_ok", "rid": rid, "md_cached_tokens": cached, "md_cached_pages": cached // ps,
                "n_pages": (len(prompt) + ps - 1) // ps, "page_bytes": self.engine.pool.page_bytes}, b""

    async def on_kv_done(self, peer, h, payload):
        ctx = self.reqs.get(h["rid"])
        if ctx is None:
            return None
        t0, fin = int(h["first_token"]), h.get("fin")
        seq = ctx.seq
        relay = bool(h.get("relay"))  # set by the gateway's plan, carried by P's kv_done
        start = fin is None and not relay

        def _imported(e):
            e.kv_imported(seq, t0, add=start)
            # the prompt's whole pages enter the DRC as soon as they are here, so a request
            # arriving meanwhile with the same prefix does not ship them again
            n = seq.prompt_len // e.page_size
            if n and e.radix is not None:
                e.radix.insert(seq.token_ids[: n * e.page_size], seq.page_table[:n])

        ctx.in_engine = start
        await self.worker.call(_imported)
        ctx.extra["kv_complete"] = True
        if relay:
            ctx.sink.put({"t": "kv_ready", "rid": ctx.rid})
        else:
            self.emit(ctx, 0, t0, fin)
            if fin is not None:
                await self.release(ctx, cache=True)
        return None

    async def on_extend(self, peer, h, payload):
        ctx = self.reqs.get(h["rid"])
        if ctx is None:
            return None
        ids = [int(t) for t in h["token_ids"]]
        seq = ctx.seq

        def _extend(e):
            # seq.token_ids is prompt + [first token]; the relay's ids start with that same token
            have = len(seq.token_ids) - seq.prompt_len
            e.append_tokens(seq, ids[have:])
            e.add(seq)

        ctx.in_engine = True
        self.counters["extends"] = self.counters.get("extends", 0) + 1
        await self.worker.call(_extend)
        return None

    async def on_kv_cancel(self, peer, h, payload):
        """The transfer was cut off (RLD finished first): ``kv_cancel`` from P, or ``drop`` from
        the gateway (which also covers a transfer P never started). Free what arrived, cache
        nothing; frames still in flight find no request and are dropped."""
        ctx = self.reqs.get(h["rid"])
        if ctx is not None and not ctx.extra.get("kv_complete"):
            self.counters["cut_offs"] = self.counters.get("cut_offs", 0) + 1
            await self.release(ctx, cache=False)
        return None

    async def on_finish(self, peer, h, payload):
        ctx = self.reqs.get(h["rid"])
        if ctx is not None:
            await self.release(ctx, cache=True)
        return None

    async def on_generate(self, peer, h, payload):
        rid = h["rid"]
        sp = SamplingParams.from_dict(h["sampling"])
        prompt = list(h["prompt_ids"])
        seq = await self.worker.call(lambda e: e.new_sequence(rid, prompt, sp, use_cache=True, min_uncached=1))
        ctx = ReqCtx(rid, seq, self.sink_for(peer), sp)
        self.reqs[rid] = ctx
        self.counters["requests"] += 1
        cached = int(seq.num_cached_tokens)
        self.cached_tokens += cached
        self.prompt_tokens += len(prompt)
        ctx.in_engine = True
        await self.worker.call(lambda e: e.add(seq))
        return {"t": "generate_ok", "rid": rid, "p_cached_tokens": cached}, b""
