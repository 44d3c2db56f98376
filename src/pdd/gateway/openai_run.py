"""Running one API request: n choices through the orchestrator, text and stop strings per choice.

``n > 1``: n sibling requests with seeds ``seed + i``. Choice 0 is started first; once P has
prefilled it, its prompt's whole pages are in P's prefix cache, so the other choices (started
together) reuse that KV and only recompute the last partial page (P always computes at least
one token itself to get the first token's logits). RLD and MD each hold their own copy per
choice.

A choice ends on its finish token from a tier, or at the gateway when a stop string completes:
then the request is aborted on every tier (``Orchestrator.abort`` frees its pages everywhere),
so no tier keeps decoding text that would never be sent. Every abort carries its reason, which
decides how the gateway counts the choice (``Orchestrator.totals``, /metrics
``pdd_gateway_outcomes``): a stop string ``ABORT_STOP`` (completed), the client gone or no longer
reading ``ABORT_CLIENT`` (cancelled), a failure of the request or of a sibling choice
``ABORT_FAILED`` (failed).

A choice that runs to its last token while other choices of its request are still starting
(a short one, or a batch's prompt whose sibling prompts start later) is held at its end: its
stream, which counts it, ends only once every choice of the request has started
(:meth:`Generation.settle`: counted completed). If the request is stopped instead (a sibling
refused for now: 429, failed, the client gone), the held choice is aborted with that reason like
the others, so the counts say what happened to the request, not to each choice alone.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from dataclasses import dataclass, field

from pdd.gateway.openai_schemas import TextOptions
from pdd.gateway.openai_text import Detokenizer, StopMatcher
from pdd.gateway.admission import refusal
from pdd.gateway.metrics import FINISHED_REASONS
from pdd.gateway.orchestrator import (ABORT_CLIENT, ABORT_FAILED, ABORT_REJECTED, ABORT_STOP, RequestFailed, ReqState,
                                      TokenOut)
from pdd.gateway.state import client_error_of, client_reason_of
from pdd.types import SamplingParams

log = logging.getLogger(__name__)

_BACKGROUND: set = set()  # strong refs to fire-and-forget tasks (aborts)


def _spawn(coro) -> asyncio.Task:
    task = asyncio.get_running_loop().create_task(coro)
    _BACKGROUND.add(task)
    task.add_done_callback(_BACKGROUND.discard)
    return task


@dataclass
class Delta:
    """What one token adds to a choice. ``text`` may be empty (held back); ``finish_reason`` is
    set on the choice's last delta; ``stop_reason`` is the stop string or stop token id;
    ``ntok``: the choice's tokens so far, this one included (its ``completion_tokens`` then)."""

    index: int
    token: TokenOut
    text: str
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    ntok: int = 0


@dataclass
class Choice:
    index: int
    st: ReqState
    opts: TextOptions
    detok: Detokenizer
    stop: StopMatcher
    ntok: int = 0
    text: list[str] = field(default_factory=list)
    tokens: list[TokenOut] = field(default_factory=list)
    finish_reason: str | None = None
    stop_reason: str | int | None = None
    last_s: float | None = None  # perf_counter when its last token was handed to it (None: none yet)
    first_s: float | None = None  # perf_counter when its first token was handed to it (None: none yet)

    def on_token(self, t: TokenOut, eos_ids: set[int]) -> Delta:
        self.ntok += 1
        self.tokens.append(t)
        final = t.fin is not None
        # a choice ended by its stop token (EOS or one of stop_token_ids) does not show that token's
        # text unless include_stop_str_in_output (as vLLM); its id still counts and has logprobs
        hidden = (t.fin == "stop" and not self.opts.include_stop
                  and (t.token_id in eos_ids or t.token_id in self.st.sampling.stop_token_ids))
        piece = self.detok.flush() if hidden else self.detok.add(t.token_id, final)
        fin, reason = t.fin, None
        if self.ntok <= self.opts.min_tokens:
            # no stop string ends in the first min_tokens tokens' text, one may begin there (vLLM:
            # they are matched from the token after the min_tokens-th on, looking back into it)
            out, _ = self.stop.feed(piece, match=False)
        else:
            # the text the detokenizer holds back before a partial character counts: a stop
            # string in it ends the choice on this token (StopMatcher.feed)
            out, matched = self.stop.feed(piece, self.detok.pending)
            if matched is not None:
                fin, reason = "stop", matched
        if fin is not None and reason is None:
            out += self.stop.flush()
            if fin == "stop" and t.token_id in self.st.sampling.stop_token_ids:
                reason = t.token_id  # EOS: None (as in vLLM)
        self.text.append(out)
        if fin is not None:
            self.finish_reason, self.stop_reason = fin, reason
        return Delta(self.index, t, out, fin, reason, self.ntok)


class Generation:
    """The choices of one request and a merged, position-ordered token stream per choice."""

    def __init__(self, orch, tokenizer, prompt_ids: list[int], sps: list[SamplingParams], opts: TextOptions,
                 eos_ids: set[int]):
        self.orch, self.tok, self.prompt_ids, self.sps, self.opts = orch, tokenizer, prompt_ids, sps, opts
        self.eos_ids = eos_ids
        self.choices: list[Choice] = []
        self.q: asyncio.Queue = asyncio.Queue()
        self.pumps: list[asyncio.Task] = []
        self.live = 0
        self.on_first_token = None  # called once, when the first token of any choice arrives (admission)
        self.rids: list[str] = []  # the rid of every choice asked to start (abort_starting finds them by it)
        self.stopped: str | None = None  # abort_starting's reason: no further choice starts
        self.settled = asyncio.Event()  # every choice of the API request started (settle)
        self.held: set[int] = set()  # choices at their last token, their stream's end held until settled
        self.shutdown: str | None = None  # shut_down's message: the server's shutdown timeout ended it
        self.metrics = getattr(orch, "metrics", None)  # pdd.gateway.metrics.GatewayMetrics (None: a bare orchestrator)

    def _rid(self) -> str | None:
        """A rid for the next choice to start, from the orchestrator's own sequence (None: an
        orchestrator without ``new_rid`` names its requests itself). Raises ``RequestFailed``
        once :meth:`abort_starting` stopped this request (nothing more starts)."""
        if self.stopped is not None:
            raise RequestFailed(f"request stopped before this choice started ({self.stopped})")
        new_rid = getattr(self.orch, "new_rid", None)
        if new_rid is None:
            return None
        rid = new_rid()
        self.rids.append(rid)
        return rid

    def abort_starting(self, reason: str) -> None:
        """Abort every choice of this request, started or still starting (its tiers reserving,
        P prefilling: ``Orchestrator.abort`` drops it everywhere, P at its next chunk boundary),
        with ``reason``; a starting choice's ``start_request`` then fails at once."""
        from pdd.gateway.disconnect import abort_starting

        self.stopped = self.stopped or reason
        self.close(reason)
        abort_starting(self.orch, self.rids, reason)

    def shut_down(self, message: str) -> bool:
        """The server's shutdown timeout ran out with this request in flight
        (:mod:`pdd.gateway.shutdown`): no further choice starts, every choice still running or
        starting is aborted on every tier as failed (:meth:`abort_starting`), and :meth:`deltas`
        (or a :meth:`start` still under way) raises ``RequestFailed(message)``, which the API
        answers with its error (an SSE error event then ``[DONE]``, or a 503). Returns whether
        the request was still running (False: it had ended, or was shut down already)."""
        if self.shutdown is not None:
            return False
        self.shutdown = message
        running = not self.settled.is_set() or any(
            c.finish_reason is None or i in self.held for i, c in enumerate(self.choices))
        self.abort_starting(ABORT_FAILED)
        self.q.put_nowait((None, RequestFailed(message)))
        return running

    def settle(self) -> None:
        """Every choice of the API request has started: a choice held at its end (it finished
        meanwhile) ends now, counted completed. Idempotent."""
        self.held.clear()
        self.settled.set()

    async def start(self, settle: bool = True) -> None:
        """Start every choice (choice 0 first, so the others hit P's prefix cache), then
        :meth:`settle` (``settle`` False: the caller does, once the other prompts of its batch
        started too). Raises ``RequestFailed`` if a choice could not start; the choices started
        are then aborted (counted failed, rejected when a tier refused the choice for now,
        cancelled if the start itself was cancelled), those that already finished too, and so are
        the other choices still starting, at once (not after their prefill)."""
        try:
            first = await self.orch.start_request(self.prompt_ids, self.sps[0], rid=self._rid())
            self._add(first)
            if len(self.sps) > 1:
                # the other choices reserve on choice 0's MD once its KV is there, when the copy
                # would cost the WAN more than the wait (pdd.policy.siblings)
                loop = asyncio.get_running_loop()
                tasks = [loop.create_task(self.orch.start_request(self.prompt_ids, sp, rid=self._rid(),
                                                                  sibling_of=first, siblings=len(self.sps) - 1))
                         for sp in self.sps[1:]]
                for t in tasks:  # retrieved however this start ends (no "never retrieved" noise)
                    t.add_done_callback(lambda f: f.cancelled() or f.exception())
                await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
                first_err = next((t.exception() for t in tasks if t.done() and t.exception() is not None), None)
                if first_err is not None:  # the others still starting stop now, with the same reason
                    self.abort_starting(ABORT_REJECTED if refusal(first_err) is not None else ABORT_FAILED)
                rest = await asyncio.gather(*tasks, return_exceptions=True)
                errs = [r for r in rest if isinstance(r, BaseException)]
                for r in rest:
                    if not isinstance(r, BaseException):
                        self._add(r)
                if errs:
                    # the choice that failed first is the cause; the others may only have been
                    # aborted because of it ("request ... aborted"), which would hide a 429
                    raise first_err if first_err is not None else errs[0]
            if settle:
                self.settle()
        except asyncio.CancelledError:
            self.abort_starting(ABORT_CLIENT)  # the choices still starting too
            raise
        except BaseException as e:
            # a choice refused by a tier for now (the API answers 429): the others started are
            # stopped as rejected too, not failed (pdd.gateway.admission.refusal)
            self.close(ABORT_REJECTED if refusal(e) is not None else ABORT_FAILED)
            if self.shutdown is not None:  # stopped by the server's shutdown: say so, not how the tier saw it
                raise RequestFailed(self.shutdown) from e
            raise

    def _add(self, st: ReqState) -> None:
        i = len(self.choices)
        self.choices.append(Choice(i, st, self.opts, Detokenizer(self.tok, self.opts.skip_special_tokens),
                                   StopMatcher(self.opts.stop, self.opts.include_stop)))
        self.pumps.append(asyncio.get_running_loop().create_task(self._pump(i, st)))
        self.live += 1

    async def _pump(self, i: int, st: ReqState) -> None:
        try:
            async with contextlib.aclosing(self.orch.stream(st)) as toks:  # closed here, however it ends
                async for t in toks:
                    self.q.put_nowait((i, t))
                    if t.fin is not None and not self.settled.is_set():
                        # its last token, while other choices still start: its stream (which counts
                        # it completed) ends once they all started; a refusal aborts it (close)
                        self.held.add(i)
                        await self.settled.wait()
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            self.q.put_nowait((i, e))
            return
        self.q.put_nowait((i, None))

    async def deltas(self):
        """Yield :class:`Delta` s of all choices as tokens arrive (each choice in position
        order), until every choice has finished. Raises ``RequestFailed`` if a tier fails. Each
        token handed to a choice (its ``usage.completion_tokens``) is a TTFT (a choice's first) or
        ITL sample and counts in ``pdd_gateway_generation_tokens_total``
        (:meth:`pdd.gateway.metrics.GatewayMetrics.token_handed`): tokens a tier sent past a stop
        string, or to a choice of a request refused while its other choices started, are not. A
        choice's last token counts its finish reason, decode time and lengths
        (:meth:`~pdd.gateway.metrics.GatewayMetrics.choice_finished`).

        However it ends early, the choices still running are aborted (:meth:`close`): with
        ``ABORT_CLIENT`` when the consumer cancels or closes this generator (the client went
        away), else ``ABORT_FAILED``."""
        with _closing(self.close):
            while self.live:
                i, item = await self.q.get()
                if i is None:  # shut_down: the server's shutdown timeout ended the request
                    raise item
                c = self.choices[i]
                if c.finish_reason is not None:
                    continue  # stopped at the gateway: later tokens are dropped
                if item is None:  # stream ended without a finish token (aborted elsewhere)
                    if c.finish_reason is None:
                        c.finish_reason = "abort"
                        self.live -= 1
                    continue
                if isinstance(item, BaseException):
                    if not isinstance(item, RequestFailed):
                        item = RequestFailed(str(item), client_error_of(item), client_reason_of(item))
                    raise item
                if self.on_first_token is not None:
                    cb, self.on_first_token = self.on_first_token, None
                    cb()
                d = c.on_token(item, self.eos_ids)
                if self.metrics is not None:  # TTFT / ITL and the generated tokens, as the client gets them
                    c.last_s = self.metrics.token_handed(c.st, item.tier, c.last_s)
                    if c.first_s is None:
                        c.first_s = c.last_s
                    if d.finish_reason in FINISHED_REASONS:  # its finish reason, decode time and lengths
                        self.metrics.choice_finished(c.st, d.finish_reason, c.ntok, c.first_s, c.last_s)
                if d.finish_reason is not None:
                    self.live -= 1
                    if item.fin is None:  # a stop string ended it here: stop every tier
                        self._stop(i, ABORT_STOP)
                yield d

    def _stop(self, i: int, reason: str, held: bool = False) -> None:
        """Abort choice ``i`` on every tier with ``reason`` (``Orchestrator.abort``) and cancel
        its pump; ``held``: it finished, but its end is held (not counted yet), so it is aborted
        too."""
        st = self.choices[i].st
        if not st.finished or held:
            # runs before the pump sees its cancellation, so the reason is the one counted
            _spawn(self.orch.abort(st, reason))
        pump = self.pumps[i]
        if not pump.done():
            pump.cancel()

    def close(self, reason: str) -> None:
        """Abort every choice still running, with ``reason`` (``ABORT_CLIENT``: the client went
        away; ``ABORT_FAILED``: the request failed), which decides how they are counted
        (cancelled / failed; ``ABORT_REJECTED``: a choice was refused while starting);
        idempotent: a choice already ended keeps its first count. A choice that finished on a
        tier's finish token is left alone (its stream still tidies up), unless its end is held
        (its request never fully started): it is aborted with ``reason`` too."""
        for i, pump in enumerate(self.pumps):
            held = i in self.held
            if not pump.done() and (self.choices[i].finish_reason is None or held):
                self.held.discard(i)
                self.choices[i].finish_reason = "abort"
                self._stop(i, reason, held)

    async def collect(self) -> None:
        async for _ in self.deltas():
            pass

    # ------------------------------------------------------------------ usage
    def completion_tokens(self) -> int:
        return sum(c.ntok for c in self.choices)


@contextlib.contextmanager
def _closing(close):
    """Around a generator's loop over its choices' tokens: however it ends, call ``close(reason)``
    once -- ``ABORT_CLIENT`` when the consumer cancelled or closed the generator (the client went
    away) or it ran to its end (nothing is left to abort), else ``ABORT_FAILED``."""
    reason = ABORT_CLIENT
    try:
        yield
    except (asyncio.CancelledError, GeneratorExit):
        raise  # the consumer is gone: ABORT_CLIENT
    except BaseException:
        reason = ABORT_FAILED
        raise
    finally:
        close(reason)


class Batch:
    """The prompts of one ``/v1/completions`` request whose ``prompt`` is a list of prompts (a
    batch, as vLLM and OpenAI take it): one :class:`Generation` per prompt, seen as one with
    choice ``index = prompt * n + i`` (vLLM's numbering). Deltas of all prompts are merged as they
    arrive; however the consumer stops, every prompt's choices still running are aborted."""

    def __init__(self, gens: list[Generation], n: int):
        self.gens, self.n = gens, n
        self.opts = gens[0].opts
        for k, g in enumerate(gens):
            for c in g.choices:
                c.index = k * n + c.index  # Delta.index follows: Choice.on_token uses it
        self.choices: list[Choice] = [c for g in gens for c in g.choices]

    async def _pump(self, g: Generation, q: asyncio.Queue) -> None:
        try:
            async for d in g.deltas():
                q.put_nowait(d)
        except asyncio.CancelledError:
            raise
        except BaseException as e:
            q.put_nowait(e)
            return
        q.put_nowait(None)

    async def deltas(self):
        q: asyncio.Queue = asyncio.Queue()
        loop = asyncio.get_running_loop()
        pumps = [loop.create_task(self._pump(g, q)) for g in self.gens]
        left = len(pumps)
        try:
            # closed first, so the reason counted is this one, not the pumps' cancellation
            with _closing(self.close):
                while left:
                    item = await q.get()
                    if item is None:
                        left -= 1
                    elif isinstance(item, BaseException):
                        raise item
                    else:
                        yield item
        finally:
            for p in pumps:
                p.cancel()

    async def collect(self) -> None:
        async for _ in self.deltas():
            pass

    def close(self, reason: str) -> None:
        for g in self.gens:
            g.close(reason)

    def completion_tokens(self) -> int:
        return sum(g.completion_tokens() for g in self.gens)
