"""The built-in engine: sequences, prefix cache, pages, scheduling and sampling around one runner.

Life of a sequence (all calls from one thread):

    seq = engine.new_sequence(rid, prompt_ids, sampling)   # match prefix, lock, alloc pages
    engine.add(seq)                                         # join the batch
    events = engine.step()                                  # one forward call over the batch
    ...                                                     # TokenEvent(finished=True): seq left the batch
    engine.release(seq)                                     # pages -> radix cache / free list
    # to stop a running sequence early (abort, RLD handoff): engine.release(engine.remove(rid))

KV produced elsewhere (P -> RLD / MD): allocate with ``new_sequence`` (``use_cache=False`` or
with the matched prefix), import page bytes for tokens ``[seq.num_computed, prompt_len)`` into
``seq.page_table`` via ``engine.pool.import_pages``, then ``engine.kv_imported(seq, first_token)``
and ``engine.add(seq)`` (or ``kv_imported(..., add=True)``) to start decoding.
Extend-decode handoff (MD): ``engine.append_tokens(seq, handed_ids)`` then ``engine.add(seq)``;
the next ``step`` computes all handed-over tokens in one forward call and samples after them.
"""

from __future__ import annotations

import itertools
import logging
import os
import threading
from dataclasses import dataclass

import torch

from pdd.types import FinishReason, SamplingParams

from .config import ModelConfig
from .kv_pool import KVPool, OutOfPages, PagesHeld
from .model import LlamaModel, load_model
from .radix_cache import RadixCache
from .runner import ModelRunner, RunItem
from .sampler import Sampler
from .scheduler import SchedulerConfig, SeqState, TierBusy, schedule
from .sequence import Sequence, SeqStatus

log = logging.getLogger(__name__)


@dataclass
class TokenEvent:
    """One sampled token. ``position`` = index into the sequence's output tokens (0-based)."""

    seq_id: object
    token_id: int
    position: int
    finished: bool = False
    finish_reason: FinishReason | None = None
    logprobs: dict | None = None  # {"lp", "top": [[id, lp], ...]} when the request asked for them


def load_tokenizer(path: str):
    """``tokenizers.Tokenizer`` from ``path/tokenizer.json`` (None when absent)."""
    fn = os.path.join(path, "tokenizer.json")
    if not os.path.exists(fn):
        return None
    from tokenizers import Tokenizer

    return Tokenizer.from_file(fn)


class Engine:
    def __init__(self, model: LlamaModel, pool: KVPool, sched_cfg: SchedulerConfig | None = None,
                 enable_prefix_cache: bool = True, tokenizer=None, model_path: str | None = None,
                 max_waiting: int | None = None):
        self.model = model
        self.model_cfg: ModelConfig = model.cfg
        self.pool = pool
        self.page_size = pool.page_size
        self.sched_cfg = sched_cfg or SchedulerConfig()
        self.radix = RadixCache(pool) if enable_prefix_cache else None
        self.runner = ModelRunner(model, pool)
        self.sampler = Sampler(self.model_cfg.eos_token_ids)
        self.seqs: dict[object, Sequence] = {}  # added and not yet removed / released
        self._arrival = itertools.count()
        self._tokenizer = tokenizer
        self.model_path = model_path
        self.evict_batch_pages = max(1, pool.num_pages // 128)  # at least this many per eviction
        self.starved: list = []  # seq ids that could not get a page in the last step
        self.preemptions = 0  # running sequences whose pages were freed to let older ones run
        self.keep_logits = False  # tests: keep the float32 logits row of each sampled token
        self.last_logits: dict[object, torch.Tensor] = {}
        # bounded queue: sequences that still need compute (created, not finished, not released)
        # beyond one batch; None = unbounded. new_sequence raises TierBusy past it.
        self.max_waiting = max_waiting
        self._live: dict[int, Sequence] = {}  # id(seq) -> seq, from new_sequence until release
        self.prefill_chunks = 0  # prefill chunks run: (sequence, forward pass) pairs that computed prompt tokens
        # layer-wise KV hand-off (P, policy.kv_stream = layerwise): seq id -> fn(layer, tokens, ready),
        # called on the engine thread as soon as a prefill chunk's forward pass has written layer
        # ``layer``'s K/V: prompt tokens [0, tokens) of that layer are then in the sequence's pages
        # (``ready``: a torch.cuda.Event recorded after the write on CUDA, to wait on before reading
        # the bytes; None on CPU, where they are written). ``layer`` -1: the sequence was preempted,
        # its pages are gone (never on P, whose sequences hold their prompt's pages from the start).
        # Set with :meth:`watch_kv`; removed on release.
        self.kv_listeners: dict = {}
        # sequences a step failed on their own (a structured output's grammar failed), with why:
        # out of the batch, not released; the caller takes them (:meth:`pop_failed`). Each is the
        # request's own failure (the same request fails the same way again): a client error
        self.failed: list[tuple[Sequence, str]] = []

    @classmethod
    def from_pretrained(cls, path: str, num_pages: int = 1024, page_size: int = 16, dtype="float32",
                        device="cpu", max_batch_tokens: int = 2048, max_running_seqs: int = 256,
                        prefill_chunk_tokens: int = 512, enable_prefix_cache: bool = True,
                        max_running: int | None = None, max_waiting: int | None = None,
                        prefill_order: str = "fcfs") -> "Engine":
        """Load an HF-format checkpoint directory and size a pool of ``num_pages`` pages of
        ``page_size`` tokens. ``max_running`` is an alias of ``max_running_seqs``; ``max_waiting``
        bounds the queue beyond one batch (:meth:`new_sequence`; None: unbounded);
        ``prefill_order``: :data:`pdd.engine.scheduler.PREFILL_ORDERS`."""
        if max_running is not None:
            max_running_seqs = max_running
        cfg = ModelConfig.from_pretrained(path)
        model = load_model(path, cfg, dtype=dtype, device=device)
        pool = KVPool(cfg, num_pages, page_size, dtype=dtype, device=device)
        sc = SchedulerConfig(max_batch_tokens, max_running_seqs, prefill_chunk_tokens, prefill_order)
        return cls(model, pool, sc, enable_prefix_cache, model_path=path, max_waiting=max_waiting)

    @property
    def tokenizer(self):
        """``tokenizers.Tokenizer`` of the checkpoint (lazy)."""
        if self._tokenizer is None and self.model_path:
            self._tokenizer = load_tokenizer(self.model_path)
        return self._tokenizer

    @property
    def model_config(self) -> ModelConfig:
        return self.model_cfg

    @property
    def eos_token_ids(self) -> list[int]:
        return list(self.model_cfg.eos_token_ids)

    # -- pages -------------------------------------------------------------------------------
    def _pages_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.page_size)

    def _alloc(self, n: int, seq_id=None) -> list[int]:
        """Allocate ``n`` pages, evicting unlocked radix leaves first if short."""
        if n <= 0:
            return []
        if self.radix is not None:
            while self.pool.num_free < n:
                # evict in batches: each evict call walks the tree once
                want = max(n - self.pool.num_free, self.evict_batch_pages)
                if self.radix.evict(want) == 0:
                    break
        try:
            return self.pool.alloc(n)
        except OutOfPages as e:
            raise OutOfPages(e.needed, e.free, seq_id) from None

    def _ensure_pages(self, seq: Sequence, num_tokens: int) -> None:
        need = self._pages_for(num_tokens) - len(seq.page_table)
        if need > 0:
            seq.page_table.extend(self._alloc(need, seq.seq_id))

    # -- sequences ---------------------------------------------------------------------------
    def new_sequence(self, seq_id, prompt_ids, sampling: SamplingParams | None = None,
                     use_cache: bool = True, min_uncached: int = 1) -> Sequence:
        """Create a sequence holding pages for its whole prompt.

        With ``use_cache`` the longest cached whole-page prefix is matched, capped so that at
        least ``min_uncached`` prompt tokens remain to compute; it is locked and its pages are
        shared (``num_computed = num_cached_tokens`` = matched tokens). Raises ``OutOfPages``
        (holding nothing) if the rest cannot be allocated even after evicting.

        Bounded queue: with ``max_waiting`` set, raises :class:`TierBusy` (holding nothing) when
        ``max_running_seqs + max_waiting`` sequences already need compute (:meth:`pending_seqs`).
        Raises ValueError (holding nothing) for an empty prompt or a token id outside the model's
        vocabulary (it would fail the forward pass of every sequence batched with it), and for a
        ``sampling.grammar`` (structured outputs) that does not compile or a checkpoint without
        the tokenizer or EOS id it needs (:meth:`guide_for`).
        """
        prompt = [int(t) for t in prompt_ids]
        if not prompt:
            raise ValueError("empty prompt")
        self.check_token_ids(prompt, "prompt")
        guide = self.guide_for(sampling) if sampling is not None and sampling.grammar is not None else None
        if self.max_waiting is not None:
            pending, limit = self.pending_seqs(), self.sched_cfg.max_running_seqs + self.max_waiting
            if pending >= limit:
                raise TierBusy(pending, limit, seq_id)
        match = None
        pages: list[int] = []
        if use_cache and self.radix is not None:
            max_pages = max(0, len(prompt) - max(0, min_uncached)) // self.page_size
            match = self.radix.match_prefix(prompt, max_pages)
            pages = list(match.pages)
        try:
            new = self._alloc(self._pages_for(len(prompt)) - len(pages), seq_id)
        except OutOfPages:
            if match is not None:
                self.radix.unlock(match)
                self.pool.decref(match.pages)
            raise
        cached = len(pages) * self.page_size
        seq = Sequence(seq_id=seq_id, token_ids=prompt, prompt_len=len(prompt),
                       sampling=sampling or SamplingParams(), num_computed=cached,
                       page_table=pages + new, num_cached_tokens=cached, prefix_match=match, guide=guide)
        self._live[id(seq)] = seq
        return seq

    def pop_failed(self) -> list[tuple[Sequence, str]]:
        """The sequences steps have failed since the last call, with why (:attr:`failed`); the
        caller releases each and fails its request as the client's (``EngineWorker._fail_seq``:
        ``client_error``), never the server's: only the request's own grammar fails one here."""
        out, self.failed = self.failed, []
        return out

    def guide_for(self, sampling: SamplingParams):
        """A fresh ``pdd.structured.Guide`` for ``sampling.grammar`` over this checkpoint's
        tokenizer and EOS ids, at the start of the outputs (it advances over them as they come,
        :meth:`Sampler.sample`). Raises ValueError (a ``GrammarError`` for the grammar itself)
        when the grammar does not compile, or the checkpoint has no ``tokenizer.json`` or no
        EOS id."""
        from pdd.structured import Guide

        return Guide(self.structured_tokenizer(), sampling.grammar)

    def structured_tokenizer(self):
        """llguidance's tokenizer over this checkpoint's (``pdd.structured.ll_tokenizer``, built
        once a process: 10 ms for pdd's 1,024 ids, 60 ms for 16k, growing with the vocabulary,
        which is why an instance builds it at start, beside its engine thread:
        :meth:`warm_structured`). Raises ValueError without ``tokenizer.json`` or an EOS id."""
        from pdd.structured import ll_tokenizer

        tok = self.tokenizer
        if tok is None:
            raise ValueError("structured outputs need the checkpoint's tokenizer.json")
        return ll_tokenizer(tok, self.model_cfg.eos_token_ids, self.model_cfg.vocab_size)

    def warm_structured(self) -> threading.Thread | None:
        """Build :meth:`structured_tokenizer` on a daemon thread now, so the first structured
        request does not hold the engine thread while it is built (a request arriving meanwhile
        waits for the one build). None (nothing to build) without a tokenizer or an EOS id."""
        if self.tokenizer is None or not self.model_cfg.eos_token_ids:
            return None

        def build():
            try:
                self.structured_tokenizer()
            except Exception as e:  # the first structured request meets it again, as its error
                log.warning("structured outputs: building the tokenizer failed: %s", e)

        t = threading.Thread(target=build, name="structured-tokenizer", daemon=True)
        t.start()
        return t

    def pending_seqs(self) -> int:
        """Sequences that still need compute: created by :meth:`new_sequence`, neither finished
        nor released (running, queued, or waiting for their KV / a handoff). A finished sequence
        whose pages are still held (P streaming its KV) does not count."""
        live = list(self._live.values())  # one C-level copy: safe against the metrics thread's reads
        return sum(1 for s in live if s.status not in (SeqStatus.FINISHED, SeqStatus.RELEASED))

    def watch_kv(self, seq_id, fn) -> None:
        """Call ``fn(layer, tokens, ready)`` after each layer of each prefill chunk of ``seq_id``
        (see ``kv_listeners``); ``fn`` runs on the engine thread, inside the forward pass, so it
        must only hand the news on (``loop.call_soon_threadsafe``)."""
        self.kv_listeners[seq_id] = fn

    def add(self, seq: Sequence) -> None:
        """Put ``seq`` into the running batch (FCFS order = order of first ``add``). Adding a
        sequence already in the batch is a no-op; adding a FINISHED one is a no-op too (it
        would have nothing to do)."""
        if seq.status == SeqStatus.RELEASED:
            raise ValueError(f"sequence {seq.seq_id} already released")
        cur = self.seqs.get(seq.seq_id)
        if cur is seq or seq.status == SeqStatus.FINISHED:
            return
        if cur is not None:
            raise ValueError(f"duplicate seq_id {seq.seq_id}")
        seq.status = SeqStatus.RUNNING
        seq.arrival = next(self._arrival)
        self.seqs[seq.seq_id] = seq

    def remove(self, seq_id) -> Sequence:
        """Take a running sequence out of the batch (e.g. RLD at handoff); it keeps its pages.
        Raises ``KeyError`` if it is not in the batch (finished sequences leave the batch by
        themselves in the ``step`` that finishes them)."""
        seq = self.seqs.pop(seq_id)
        if seq.status == SeqStatus.RUNNING:
            seq.status = SeqStatus.WAITING
        return seq

    def release(self, seq: Sequence, cache: bool = True) -> None:
        """Return a sequence's pages. With ``cache``, its whole computed pages are inserted into
        the prefix cache first. Unlocks its prefix match. Idempotent."""
        if seq.status == SeqStatus.RELEASED:
            return
        if self.seqs.get(seq.seq_id) is seq:
            del self.seqs[seq.seq_id]
        self.kv_listeners.pop(seq.seq_id, None)
        if cache and self.radix is not None:
            n = min(seq.num_computed // self.page_size, len(seq.page_table))
            if n:
                self.radix.insert(seq.token_ids[:n * self.page_size], seq.page_table[:n])
        self._free_pages(seq)
        seq.status = SeqStatus.RELEASED
        self._live.pop(id(seq), None)

    def flush_cache(self) -> int:
        """Evict every unlocked prefix-cache page; returns nodes removed."""
        return self.radix.flush() if self.radix is not None else 0

    def kv_imported(self, seq: Sequence, first_token_id: int | None = None, add: bool = False) -> FinishReason | None:
        """Mark the prompt's KV as present (after ``pool.import_pages`` filled tokens
        ``[seq.num_computed, prompt_len)``): sets ``num_computed = prompt_len``; appends
        ``first_token_id`` (output 0, sampled by P) if given. With ``add=True`` it also
        ``add``\\ s the sequence (otherwise call ``engine.add(seq)`` to start decoding).
        Returns the finish reason if the first token already ends it (then it is FINISHED
        and ``add`` does nothing)."""
        if len(seq.page_table) < self._pages_for(seq.prompt_len):
            raise ValueError("page table does not cover the prompt")
        seq.num_computed = max(seq.num_computed, seq.prompt_len)
        reason = None
        if first_token_id is not None:
            if seq.num_outputs != 0:
                raise ValueError("kv_imported: sequence already has outputs")
            seq.token_ids.append(int(first_token_id))
            reason = self.sampler.check_stop(int(first_token_id), 1, seq.sampling)
            if reason is not None:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
        if add:
            self.add(seq)
        return reason

    def check_token_ids(self, ids: list[int], what: str, start: int = 0) -> None:
        """Raise ValueError naming the first of ``ids`` outside the model's vocabulary ``[0,
        vocab_size)`` and its position (``start`` + its index: ``what``'s position of ``ids[0]``)."""
        vocab = int(self.model_cfg.vocab_size)
        if ids and (min(ids) < 0 or max(ids) >= vocab):
            i, t = next((i, t) for i, t in enumerate(ids) if not 0 <= t < vocab)
            raise ValueError(f"{what} token id {t} at position {start + i} is outside the vocabulary [0, {vocab})")

    def append_tokens(self, seq: Sequence, token_ids, sample: bool = True) -> None:
        """Append output tokens produced elsewhere (handoff). Their KV is computed by the next
        steps in one extend; with ``sample=False`` no token is sampled after them (catch-up).
        Raises ValueError for a finished or released sequence, or a token id outside the
        vocabulary (nothing appended)."""
        if seq.status in (SeqStatus.FINISHED, SeqStatus.RELEASED):
            raise ValueError(f"sequence {seq.seq_id} is {seq.status.value}")
        ids = [int(t) for t in token_ids]
        self.check_token_ids(ids, "output", start=seq.num_outputs)
        seq.token_ids.extend(ids)
        seq.can_sample = sample

    # -- stepping ----------------------------------------------------------------------------
    def has_work(self) -> bool:
        return any(s.status == SeqStatus.RUNNING and s.pending > 0 and not s.cancelled for s in self.seqs.values())

    @staticmethod
    def cancel(seq: Sequence) -> None:
        """Stop scheduling ``seq`` from the next step on (its request was aborted). Safe from any
        thread (one attribute store): the step in flight, if any, still runs its chunk, so at
        most one chunk runs after this call. It keeps its pages until :meth:`release`."""
        seq.cancelled = True

    def step(self) -> list[TokenEvent]:
        """One forward call over a scheduled batch; returns the tokens sampled (possibly none,
        e.g. for a prefill chunk). No work -> no forward call, ``[]``.

        Pages for growing sequences are allocated first (evicting cache leaves if needed); a
        sequence that cannot get one sits this step out (``engine.starved`` lists them) while
        the others run. If no planned sequence can run while two or more running sequences hold
        pages, the youngest of them is *preempted* (vLLM's recompute preemption): its pages are
        freed and it stays in the batch with all its tokens to compute again, so the older ones
        run on and finish instead of one of them failing (``preemptions`` counts them). With
        one such sequence left and still no page, raises ``PagesHeld`` (an ``OutOfPages``) when
        sequences outside the batch hold pages that will come back (waiting for KV or a handoff,
        finished, or cancelled, each until its owner releases it: the caller waits and steps
        again), else ``OutOfPages``; cancelled sequences are never preempted; its ``seq_id`` names the first starved sequence. Either is
        raised before any forward call and without leaking: after ``OutOfPages`` the caller must
        free pages (abort / release something) or every later step raises too."""
        self.last_step_items = []
        while True:
            states = [SeqState(s.seq_id, len(s.token_ids), s.num_computed, s.arrival, s.can_sample)
                      for s in list(self.seqs.values())
                      if s.status == SeqStatus.RUNNING and s.pending > 0 and not s.cancelled]
            if not states:
                return []
            plan = schedule(states, self.sched_cfg)
            if not plan:
                return []
            seqs, plan_items, starved = [], [], []
            for it in plan.items:  # decodes first: they only ever need one more page
                seq = self.seqs[it.seq_id]
                try:
                    self._ensure_pages(seq, it.start + it.num_tokens)
                except OutOfPages as e:
                    starved.append(e)  # waits in the batch until pages come back
                    continue
                seqs.append(seq)
                plan_items.append(it)
            self.starved = [e.seq_id for e in starved]
            if seqs:
                break
            victim = self._preemption_victim()
            if victim is None:
                e = starved[0]
                if self._pages_held_outside_the_batch():
                    raise PagesHeld(e.needed, e.free, e.seq_id)
                raise e
            self._preempt(victim)
        items = [RunItem(s.token_ids, it.start, it.num_tokens, s.page_table, it.sample)
                 for s, it in zip(seqs, plan_items)]
        # (cached tokens, new tokens) of each item: what a step-time profile prices (EngineWorker)
        self.last_step_items = [(it.start, it.num_tokens) for it in plan_items]
        logits = self.runner.forward(items, on_layer=self._layer_hook(seqs, plan_items))
        sampled = []
        for seq, it in zip(seqs, plan_items):
            if it.start < seq.prompt_len:  # computed prompt tokens: one prefill chunk of it
                seq.prefill_chunks += 1
                self.prefill_chunks += 1
            seq.num_computed = it.start + it.num_tokens
            if it.sample:
                sampled.append(seq)
        if not sampled:
            return []
        # output positions and the prompt/output split count an earlier attempt's outputs
        # (SamplingParams.output_offset) as outputs
        toks = self.sampler.sample(logits, [s.sampling for s in sampled],
                                   [s.sampling.output_offset + s.num_outputs for s in sampled],
                                   histories=[(s.token_ids, s.prompt_len - s.sampling.output_offset) for s in sampled],
                                   guides=[s.guide for s in sampled])
        lps = self.sampler.last_logprobs
        events = []
        for i, (seq, tok) in enumerate(zip(sampled, toks)):
            if seq.guide is not None and seq.guide.error is not None:
                # its grammar failed (a run-time limit of llguidance, a token it rejects): the
                # request fails with why, never ends as if its output held the grammar
                seq.status, seq.finish_reason = SeqStatus.FINISHED, FinishReason.ABORT
                del self.seqs[seq.seq_id]  # leaves the batch; its owner releases it
                from pdd.structured import FAILED_AT

                self.failed.append((seq, f"{FAILED_AT} {seq.num_outputs}: {seq.guide.error}"))
                continue
            seq.token_ids.append(tok)
            n_out = seq.num_outputs
            if self.keep_logits:
                self.last_logits[seq.seq_id] = logits[i].detach().cpu()
            reason = self.sampler.check_stop(tok, n_out, seq.sampling)
            if reason is not None:
                seq.status, seq.finish_reason = SeqStatus.FINISHED, reason
                del self.seqs[seq.seq_id]  # leaves the batch; caller release()s it
            events.append(TokenEvent(seq.seq_id, tok, n_out - 1, reason is not None, reason, lps[i]))
        return events

    def _layer_hook(self, seqs: list, plan_items: list):
        """The runner's ``on_layer`` for this step: tells each watched sequence with a prefill
        chunk in the batch (``kv_listeners``) how far each layer's prompt K/V now reaches; None
        when no such sequence is in the batch."""
        if not self.kv_listeners:
            return None
        watched = [(fn, min(it.start + it.num_tokens, s.prompt_len))
                   for s, it in zip(seqs, plan_items)
                   if it.start < s.prompt_len and (fn := self.kv_listeners.get(s.seq_id)) is not None]
        if not watched:
            return None
        cuda = self.pool.device.type == "cuda"

        def on_layer(layer: int) -> None:
            ready = None
            if cuda:  # the write is queued on this thread's stream: readers wait for this event
                ready = torch.cuda.Event()
                ready.record()
            for fn, tokens in watched:
                fn(layer, tokens, ready)

        return on_layer

    def _preemption_victim(self) -> Sequence | None:
        """The youngest running sequence holding pages, if at least two do (freeing the only one
        would let nothing else run); None otherwise. A cancelled sequence is never a victim: it
        runs nothing and its owner's release returns its pages (a P stream may still read them)."""
        holders = [s for s in self.seqs.values() if s.status == SeqStatus.RUNNING and s.page_table and not s.cancelled]
        return max(holders, key=lambda s: s.arrival) if len(holders) >= 2 else None

    def _pages_held_outside_the_batch(self) -> bool:
        """Whether a live sequence outside the running batch holds pages (waiting for its KV or
        a handoff, finished and not yet released, or cancelled and not yet released): they come
        back without anyone failing."""
        live = list(self._live.values())
        return any(s.page_table and (s.cancelled or s.status in (SeqStatus.WAITING, SeqStatus.FINISHED))
                   for s in live)

    def _free_pages(self, seq: Sequence) -> None:
        """Unlock ``seq``'s prefix-cache match and drop its refs on every page it holds (release
        and preemption)."""
        if self.radix is not None:
            self.radix.unlock(seq.prefix_match)
        seq.prefix_match = None
        pages, seq.page_table = seq.page_table, []
        self.pool.decref(pages)

    def _preempt(self, seq: Sequence) -> None:
        """Free a running sequence's pages; it stays in the batch (same arrival order) with all
        its tokens to compute again: prompt and outputs are recomputed as one prefill when pages
        come back, and it samples on from where it was."""
        self._free_pages(seq)
        seq.num_computed = 0
        self.preemptions += 1
        fn = self.kv_listeners.pop(seq.seq_id, None)
        if fn is not None:  # its KV is gone: a layer-wise stream of it must stop
            fn(-1, 0, None)
        # a warning, as vLLM's: preemption costs a recompute, and a pool this tight is worth knowing
        log.warning("preempted %s (%d tokens to recompute): no running sequence could get a KV page; "
                    "%d preemptions so far", seq.seq_id, len(seq.token_ids), self.preemptions)

    def generate(self, prompts: list[list[int]], sampling: SamplingParams | None = None,
                 use_cache: bool = True) -> list[list[int]]:
        """Convenience (tests, demo): run prompts to completion, release with caching, return outputs.
        Each sequence is released as it finishes, so on a tight pool its pages let the others
        (a preempted one among them) run on. Raises ``OutOfPages`` as :meth:`new_sequence` and
        :meth:`step` do when the prompts cannot fit."""
        seqs = {}
        for p in prompts:
            s = self.new_sequence(("gen", next(self._arrival)), p, sampling, use_cache=use_cache)
            self.add(s)
            seqs[s.seq_id] = s
        while self.has_work():
            for ev in self.step():
                if ev.finished:
                    self.release(seqs[ev.seq_id], cache=use_cache)
        seqs = list(seqs.values())
        for s in seqs:
            self.release(s, cache=use_cache)
        return [s.output_ids for s in seqs]

    def stats(self) -> dict:
        return {
            "pages_total": self.pool.num_pages,
            "pages_free": self.pool.num_free,
            "running": sum(1 for s in self.seqs.values() if s.status == SeqStatus.RUNNING),
            "forward_calls": self.runner.forward_calls,
            "preemptions": self.preemptions,
            "tokens_computed": self.runner.tokens_computed,
            "radix": self.radix.stats() if self.radix is not None else None,
        }
