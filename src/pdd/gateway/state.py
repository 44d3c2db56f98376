"""A gateway request's state (:class:`ReqState`), its token records, outcomes and phases, and
the handoff message (:func:`extend_message`).

Shared by the orchestrator (:mod:`pdd.gateway.orchestrator`), its collaborators and the OpenAI
layer; plain data, no I/O. Each sub-state of :class:`ReqState` is written by one module, named
in its docstring (``tests/gateway/test_state_owners.py`` checks it).
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field

from pdd.gateway.phase import INJECTABLE, Phase, PhaseLog
from pdd.transfer.messages import Extend
from pdd.types import Pipeline, SamplingParams


def extend_message(rid: str, token_ids: list[int], final: bool = True) -> dict:
    """The handoff message to MD: the relay's output token ids and nothing else (no KV).

    msgpack packs an id below 65,536 in 3 bytes, so 100 ids are ~300 bytes against
    100 x kv_bytes_per_token of KV (PDD report: "100 token IDs ~ 1.5 KB vs ~4649 KB of KV").
    """
    return Extend(rid, [int(t) for t in token_ids], bool(final)).wire()


class ReleaseDict(dict):
    """A dict of the orchestrator's in-flight bookkeeping (``reqs``, ``inflight``,
    ``planned_src``, ``superseded_wan``, ``awaiting_kv``: what ``Membership.busy`` counts) that
    calls ``on_release()`` after anything may have left it: an entry deleted or popped, the dict
    cleared, or an ``int`` value lowered. Additions call nothing. ``on_release`` must not raise;
    it is how a removal waiting for an instance to go idle is woken as its last request or
    transfer ends (``Membership._remove_when_idle``), with no poll."""

    __slots__ = ("on_release",)

    def __init__(self, on_release, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.on_release = on_release

    def __setitem__(self, key, value):
        old = dict.get(self, key)
        dict.__setitem__(self, key, value)
        if isinstance(old, int) and isinstance(value, int) and value < old:
            self.on_release()

    def __delitem__(self, key):
        dict.__delitem__(self, key)
        self.on_release()

    _MISSING = object()

    def pop(self, key, default=_MISSING):
        if key in self:
            value = dict.pop(self, key)
            self.on_release()
            return value
        if default is ReleaseDict._MISSING:
            raise KeyError(key)
        return default

    def popitem(self):
        item = dict.popitem(self)
        self.on_release()
        return item

    def clear(self):
        had = bool(self)
        dict.clear(self)
        if had:
            self.on_release()


class RequestFailed(RuntimeError):
    """A tier failed the request; the message says which and why. ``client_error`` True: the
    request's own failure (a tier's ``ReqError.client_error``, or a failed call's
    ``detail.client_error``: its structured output's grammar failed), which the API answers
    400 ``invalid_request_error``; else the server's. ``reason``: what the client reads of a
    request's own failure (the tier's why, without the gateway's request id nor an instance's
    name: those are the server's, for its log); None when it is the message itself."""

    def __init__(self, message: str, client_error: bool = False, reason: str | None = None):
        super().__init__(message)
        self.client_error = client_error
        self.reason = reason

    @property
    def client_message(self) -> str:
        """The message the API answers with: ``reason`` for the request's own failure, when
        given, else the whole message."""
        return self.reason if self.client_error and self.reason else str(self)


def client_error_of(e: BaseException | None) -> bool:
    """Whether ``e`` (or an exception it was raised from) is a request's own failure: a
    :class:`RequestFailed` with ``client_error``, or a call a tier failed with
    ``detail.client_error`` (``pdd.transfer.peer.RemoteError``)."""
    from pdd.gateway.admission import causes

    for c in causes(e):
        if getattr(c, "client_error", False) is True:
            return True
        header = getattr(c, "header", None)
        if isinstance(header, dict) and (header.get("detail") or {}).get("client_error") is True:
            return True
    return False


def client_reason_of(e: BaseException | None) -> str | None:
    """What the client reads of ``e`` when it is a request's own failure (:func:`client_error_of`):
    a :class:`RequestFailed`'s ``reason``, or the text of a call a tier failed with
    ``detail.client_error`` without its exception's name (``pdd.transfer.peer`` sends
    "CallFailed: <why>"). None when ``e`` holds none."""
    from pdd.gateway.admission import causes

    for c in causes(e):
        if isinstance(c, RequestFailed) and c.client_error and c.reason:
            return c.reason
        header = getattr(c, "header", None)
        if isinstance(header, dict) and (header.get("detail") or {}).get("client_error") is True:
            return str(c).removeprefix("CallFailed: ")
    return None


class NoInstance(RequestFailed):
    """No live instance of a role the request needs (all dead or restarting): the request did no
    work, and may be retried once one rejoins (the gateway retries connecting every
    ``liveness.reconnect_interval_s``)."""


class NoMember(NoInstance):
    """No instance of a role the request needs is in service at all: every one of the role was
    removed (or drained, or is a standby slot) by the operator, so none comes back by itself (a
    crashed one is still a member and is reconnected: that is plain :class:`NoInstance`). A request
    needing the role fails at once instead of waiting for one (``pdd.gateway.recovery``); the
    message names the role and its slots' states."""


class ShuttingDown(RequestFailed):
    """The gateway began its shutdown drain (:mod:`pdd.gateway.shutdown`) while the request's
    start waited for an instance that was not up (a crashed P restarting). The drain does not
    wait on a restart (one under way may finish, one not begun may never come), and the client
    has received nothing: the start ends at once and its client is told, as a request arriving
    during the drain is, to send it to another server (HTTP 503 ``shutting_down``)."""


class InstanceLost(ConnectionError):
    """An instance a request needs is unreachable (dead, or silent past its heartbeat)."""


# Why a request was aborted (:meth:`Orchestrator.abort`), and the outcome it is counted as. Every
# request is counted exactly once in ``totals`` (and /metrics ``pdd_gateway_outcomes``), as one of
# OUTCOMES: "completed" (ran to its end, or a stop string ended it at the gateway), "failed" (a
# tier or the gateway failed it, or a sibling choice of the same API request failed),
# "cancelled" (the client went away or stopped reading: vLLM's finish reason "abort") or
# "rejected" (refused before any tier ran it, and nothing of it was kept: a tier refused it for now
# while it was starting, its queue full or its KV pool short of pages, so the client got a 429 to
# retry later, docs/OVERLOAD.md; or no instance of a role was reachable on its first try, a 503
# with Retry-After: pdd.gateway.start).
# The choices of one API request end as the request did: one that finished while a sibling was
# still starting is counted only once they all started (pdd.gateway.openai_run: held, then settled).
ABORT_STOP = "stop"  # a stop string completed at the gateway: the request is done -> "completed"
ABORT_CLIENT = "client_disconnect"  # the client disconnected (or stopped reading) -> "cancelled"
ABORT_FAILED = "failed"  # the request (or a sibling choice) failed -> "failed"
ABORT_REJECTED = "rejected"  # refused before any tier ran it (TierBusy, OutOfPages, NoInstance) -> "rejected"
ABORT_OUTCOMES = {ABORT_STOP: "completed", ABORT_CLIENT: "cancelled", ABORT_FAILED: "failed",
                  ABORT_REJECTED: "rejected"}
OUTCOMES = ("completed", "failed", "cancelled", "rejected")

# the phases a fault can be injected in (pdd.faults; the held phase is ReqState.phase)
PHASES = tuple(p.value for p in INJECTABLE)
# per-attempt events, renamed "<name>@<attempt>" when a request is recovered
ATTEMPT_EVENTS = ("rld_expect", "md_reserved", "p_first_token", "prefilled", "xfer_done", "md_kv_ready", "handoff_call",
                  "handoff", "handoff_rld_ms", "switch")


@dataclass
class TokenOut:
    pos: int
    token_id: int
    tier: str
    fin: str | None
    lp: dict | None = None  # {"lp", "top": [[id, lp], ...]} from the logits that chose it, if asked


@dataclass(slots=True)
class WanPlan:
    """A request's KV transfer to an MD across the WAN, as the gateway books it. Written only by
    :mod:`pdd.gateway.wan_booking` (the launcher and recovery ask it: ``_open_fill_slot``,
    ``_unbook_md``, ``_wan_new_attempt``, ``_count_cut_off``). Bytes are KV payload bytes.
    ``reported`` and ``cut_off`` are the request's; the rest is the current attempt's."""

    expected: int = 0  # this attempt's planned bytes (the cut-off's and early handoff's estimate)
    reported: int | None = None  # what P reported it sent (xfer_done), None before
    # a predicted MD send (policy.md_predicted_send): the pages P was told MD holds (it sends the
    # rest at once) and the bytes booked for them; None: MD's part waits for its reservation
    predicted_pages: int | None = None
    predicted_bytes: int = 0
    kv_sent: bool = False  # P reported MD's KV written to the WAN (xfer_done): P has no part left
    fill_slot: bool = False  # P was started with an md_fill slot, which MD's reservation reply resolves
    cut_off: bool = False  # the transfer was cut off: RLD finished first (anomaly filter) or its first token did
    # MD's last kv_progress of this attempt: (gateway perf_counter s when it came, payload bytes
    # received, Gbit/s lately); None before one (the cut-off then reads the goodput estimate)
    progress: tuple | None = None


@dataclass(slots=True)
class HandoffState:
    """The RLD -> MD handoff and the client's switch to MD's stream. Written only by
    :mod:`pdd.gateway.handoff` (MD's ``kv_ready``, the rounds, the switch, an MD takeover after
    RLD was lost, its reset for a new attempt: ``_handoff_new_attempt``). ``pos``, ``tokens``,
    ``rld_finished_first`` and ``extend_extra_step_ms`` are the request's record (kept across
    attempts, the response's ``pdd`` fields); the rest is the current attempt's."""

    kv_ready: bool = False  # MD reported it holds this attempt's KV (kv_ready)
    started: bool = False  # _handoff ran for this attempt (from kv_ready or the KV's predicted landing)
    early: bool = False  # ... from the KV's predicted landing (policy.early_handoff)
    mode: str | None = None  # RLD's last round's mode ("one_shot", "catch_up"), or "takeover"
    rounds: int = 0  # rounds RLD answered this attempt
    md_start: int | None = None  # first position MD samples (after the final handoff round)
    switch_pos: int | None = None  # this attempt's first position streamed from MD
    md_pending: dict = field(default_factory=dict)  # pos -> TokenOut from MD, before/after the switch
    md_diverged: bool = False  # MD's token differed from one streamed (near-tie): RLD finishes
    takeover: bool = False  # RLD was lost after MD had the KV: MD continued from the streamed ids
    final_ids: list = field(default_factory=list)  # the final round's ids (RLD's outputs up to md_start)
    rld_lost: bool = False  # RLD was lost after the final round, before the switch: it finishes nothing
    pos: int | None = None  # where the client last switched to MD (the response's handoff_pos)
    tokens: int = 0  # ids in the last round (the response's handoff_tokens)
    # RLD ended the request (completed) before any handoff to MD, and its transfer was not cut off
    # (MD keeps the prompt's KV); with totals.rld_finished_first set once, at the stream's settling
    rld_finished_first: bool = False
    extend_extra_step_ms: list = field(default_factory=list)  # MD's extra step time per catch-up round


@dataclass(slots=True)
class RecoveryState:
    """What faults did to the request. Written only by :mod:`pdd.gateway.recovery` (a lost
    instance, a tier's ``req_error``, a new attempt, a plan made without MD: ``_plan_degraded``).
    ``lost``, ``error`` and ``md_lost`` are the current attempt's; the rest is the request's."""

    lost: bool = False  # error is an unreachable instance: recoverable (the stream starts a new attempt)
    error: str | None = None  # why the current attempt failed (a tier's req_error, a lost instance)
    asked: bool = False  # error is the operator's removal of the instance, not a fault (logged at INFO)
    client_error: bool = False  # error is the request's own (ReqError.client_error): the API's 400
    client_reason: str | None = None  # then what its client reads: the tier's why, no instance named
    md_lost: bool = False  # MD's leg of a relayed request is gone: RLD finishes it
    degraded: bool = False  # ended (or will end) on RLD because no MD was usable
    recoveries: list = field(default_factory=list)  # [{"attempt", "reason", "phase", "pos", "pipeline", "names"}]


@dataclass(slots=True)
class EndState:
    """How the request ended, counted once. Written only by :mod:`pdd.gateway.stream` (its
    ``_count_outcome`` and ``abort``)."""

    outcome: str | None = None  # one of OUTCOMES once counted in Orchestrator.totals (exactly once)
    aborted: bool = False  # aborted (client gone, failure): late replies must not book anything
    abort_reason: str | None = None  # the first abort's reason (ABORT_STOP, ABORT_CLIENT, ...)


@dataclass(slots=True)
class ReqState:
    """One request at the gateway. Its own fields are the request's identity (set at its start),
    the current attempt's identity and route, and the client's stream; the rest is in sub-states,
    each written by one module (:class:`WanPlan`, :class:`HandoffState`, :class:`RecoveryState`,
    :class:`EndState`). Who writes each top-level field:

    - ``rid``, ``prompt_len``, ``sampling``, ``prompt_ids``, ``t_arrival``, ``sibling_of``,
      ``siblings``: set when the request is made (:mod:`pdd.gateway.start`), never reassigned;
    - ``trid``, ``base``, ``attempt``: :mod:`pdd.gateway.recovery` (a new attempt);
    - ``pipeline``, ``p_cached_tokens``, ``names`` (which recovery empties for a new attempt) and
      ``prompt_cached_tokens`` (set once): :mod:`pdd.gateway.launch`; ``assigned``, ``holds``: :mod:`pdd.gateway.routing`;
      ``md_cached_tokens``: :mod:`pdd.gateway.wan_booking` (MD's reservation reply);
    - ``next_pos``, ``pending``, ``emitted``: :mod:`pdd.gateway.handoff` (tokens in position
      order, whichever decoder made them); ``finished``, ``last_token_s``: :mod:`pdd.gateway.stream`;
    - shared channels and logs any collaborator adds to: ``queue`` (tokens and failure marks to
      the stream), ``events`` (name -> time), ``decisions`` (policy inputs and results),
      ``md_settled``, ``life`` (the phase, moved only by :meth:`to`).
    """

    rid: str
    prompt_len: int
    sampling: SamplingParams
    pipeline: Pipeline = Pipeline.P_MD
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)
    next_pos: int = 0
    pending: dict = field(default_factory=dict)  # pos -> TokenOut from RLD (or the one decoder), not streamed yet
    finished: bool = False
    p_cached_tokens: int = 0  # P's prefix-cache hit on this attempt's prompt (tokens)
    # P's hit on the client's prompt at the first prefill P answered for the request (tokens; None
    # until then; usage.prompt_tokens_details.cached_tokens): a recovery's new prefill hits the
    # request's own earlier prefill, which saved the client nothing
    prompt_cached_tokens: int | None = None
    md_cached_tokens: int = 0
    emitted: list = field(default_factory=list)  # token ids streamed so far
    last_token_s: float = 0.0
    names: dict = field(default_factory=dict)  # role -> instance serving this attempt
    assigned: set = field(default_factory=set)  # instances counted in Orchestrator.inflight
    # instances whose bounded queue this attempt may still take a place of (Orchestrator.holding):
    # from routing; P's until its prefill returned, the others' until the attempt ends
    holds: set = field(default_factory=set)
    t_arrival: float = field(default_factory=time.perf_counter)
    events: dict = field(default_factory=dict)  # name -> perf_counter seconds
    # each policy decision's inputs and result, for replay (``pdd sim validate``):
    # [{"policy": "pipeline"|"handoff", "inputs": {...}, "result": ...}, ...]
    decisions: list = field(default_factory=list)
    trid: str = ""  # the rid the tiers know this attempt by (rid, then rid.1, rid.2, ...)
    base: int = 0  # output position of this attempt's first token (tokens streamed before it)
    prompt_ids: list = field(default_factory=list)
    attempt: int = 0
    # another choice of the same prompt (n > 1), started first: this one may reserve on its MD once
    # its KV is there (pdd.policy.siblings), and then ships only the prompt's partial last page
    sibling_of: "ReqState | None" = None
    siblings: int = 0  # choices of the prompt besides the first
    # set once this request's first attempt knows its MD part of the plan (MD's reservation reply
    # booked: pdd.gateway.wan_booking) or never will (its MD leg lost, the attempt given up): a
    # sibling choice that starts while the reply is still out waits on it before choosing its own
    # MD (pdd.gateway.launch, pdd.policy.siblings). Request-level, not the attempt's WanPlan: it is
    # about the first attempt only and is never reset by a recovery
    md_settled: asyncio.Event = field(default_factory=asyncio.Event)
    life: PhaseLog = field(default_factory=PhaseLog)  # the held phase and its history (pdd.gateway.phase)
    wan: WanPlan = field(default_factory=WanPlan)  # the WAN transfer's booking (wan_booking.py)
    handoff: HandoffState = field(default_factory=HandoffState)  # RLD -> MD (handoff.py)
    recovery: RecoveryState = field(default_factory=RecoveryState)  # faults (recovery.py)
    end: EndState = field(default_factory=EndState)  # the outcome, counted once (stream.py)

    def note_p_cached(self, tokens: int) -> None:
        """P answered this attempt's prefill with a prefix-cache hit of ``tokens``: the attempt's
        ``p_cached_tokens``; the request's ``prompt_cached_tokens`` if it is P's first answer
        (clamped to the client's prompt, ``prompt_len`` tokens)."""
        self.p_cached_tokens = tokens
        if self.prompt_cached_tokens is None:
            self.prompt_cached_tokens = min(tokens, self.prompt_len)

    @property
    def phase(self) -> Phase:
        """The request's held phase (moved only by :meth:`to`)."""
        return self.life.phase

    def to(self, phase: Phase, why: str = "") -> bool:
        """Move the request to ``phase`` (:meth:`pdd.gateway.phase.PhaseLog.to`: checked against
        the table of legal moves, recorded with its time); True if it moved."""
        return self.life.to(phase, self.rid, why)
