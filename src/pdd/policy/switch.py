"""Seamless RLD -> MD switch for catch-up handoffs: a jitter buffer at the gateway.

Why: after the final catch-up round MD extends over RLD's ids and decodes on, but its tokens
reach the gateway ``lag`` ms later than RLD's token of the same position (the ids cross the WAN
to MD, MD extends, MD's token crosses back: about one WAN round trip plus the extend). Switching
the client to MD the moment MD's first token arrives therefore leaves one gap of ~``lag`` ms
(~25 ms here, against an inter-token latency of ~3-5 ms).

Remedy (a jitter buffer; the client sees the same tokens in the same order, some later):

- From the first catch-up round on, every RLD token is released to the client ``hold`` ms after
  it arrived, and ``hold`` grows by ``step = max_gap_factor x itl - itl_rld`` per token (``itl``:
  the larger of RLD's and MD's inter-token gaps at the gateway for this request, EWMAs;
  ``(max_gap_factor - 1) x itl`` when they are equal), so each paced gap is about
  ``max_gap_factor`` x that ITL, and the hold gains at least ``(max_gap_factor - 1) x itl`` per
  token on MD's lag even when MD decodes slower than RLD.
- MD's tokens for positions RLD already streamed are checked against what was streamed and
  predict when MD's token for the next position will arrive (its latest token's arrival plus
  ``itl`` per position: MD may decode slower than RLD, and then its lag grows). The switch to MD
  is allowed once that predicted arrival is within ``switch_gap_factor x itl`` (default 1: MD on
  RLD's cadence; the rest of ``max_gap_factor`` is a margin for MD's jitter) of the last
  released token (:func:`switch_ready`). Until then RLD keeps decoding and streaming (catch-up
  keeps it alive until the switch) and MD's tokens are held back (checked, then dropped).
- After the switch MD's tokens are released as they arrive (they are already ``lag`` late).
- Bounds: ``hold`` never exceeds ``max_hold_ms``; after ``max_ramp_tokens`` paced tokens the
  switch is allowed whatever the gap (so a slow MD cannot keep RLD decoding for long).

Cost (stated in docs/BENCH.md): the tokens RLD streams from the first catch-up round until the
switch are delayed by ``hold`` (0 up to about ``lag``, at most ``max_hold_ms``); RLD decodes
about ``lag / step`` more tokens than an immediate switch would have it decode. One-shot
handoffs are not paced (RLD stops at once: there is nothing to spread the lag over).

The functions are pure; :class:`SwitchPacer` is plain state driven by the gateway with times it
passes in (ms), so it is tested without processes or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

DEFAULT_MAX_GAP_FACTOR = 1.5
DEFAULT_MAX_HOLD_MS = 250.0
DEFAULT_MAX_RAMP_TOKENS = 64
ITL_EWMA_ALPHA = 0.25
MD_ITL_MIN_SAMPLES = 3


@dataclass(frozen=True)
class PaceParams:
    """max_gap_factor: a paced client gap is at most this x the request's ITL (> 1).
    max_hold_ms: the largest delay added to any token (ms, >= 0).
    max_ramp_tokens: paced tokens after which the switch is allowed whatever the gap (>= 1).
    itl_floor_ms: ITL used before any gap is seen, and the least ITL estimate (ms, > 0).
    prior_lag_ms: the hold ramps up to this until MD's lag is measured (ms, >= 0; the gateway
    passes 1.5 x the configured WAN RTT: the ids' and MD's token's crossings plus the extend).
    switch_gap_factor: the switch waits until MD's next token is predicted within this x ITL of the
    last released token (>= 1, <= max_gap_factor; below max_gap_factor it leaves the difference
    as a margin for MD's jitter and the prediction's error)."""

    max_gap_factor: float = DEFAULT_MAX_GAP_FACTOR
    max_hold_ms: float = DEFAULT_MAX_HOLD_MS
    max_ramp_tokens: int = DEFAULT_MAX_RAMP_TOKENS
    itl_floor_ms: float = 1.0
    prior_lag_ms: float = 30.0
    switch_gap_factor: float = 1.0

    def __post_init__(self) -> None:
        if not self.max_gap_factor > 1.0:
            raise ValueError(f"max_gap_factor must be > 1, got {self.max_gap_factor}")
        if not 1.0 <= self.switch_gap_factor <= self.max_gap_factor:
            raise ValueError(f"need 1 <= switch_gap_factor <= max_gap_factor, got {self.switch_gap_factor}")
        if self.max_hold_ms < 0 or self.max_ramp_tokens < 1 or not self.itl_floor_ms > 0 or self.prior_lag_ms < 0:
            raise ValueError("need max_hold_ms >= 0, max_ramp_tokens >= 1, itl_floor_ms > 0, prior_lag_ms >= 0")


def ewma_itl(prev_ms: float | None, gap_ms: float, alpha: float = ITL_EWMA_ALPHA) -> float:
    """EWMA of inter-arrival gaps (ms): ``gap`` first, then ``(1 - alpha) prev + alpha gap``.
    Raises ValueError for a negative gap or alpha outside (0, 1]."""
    if gap_ms < 0:
        raise ValueError(f"negative gap {gap_ms}")
    if not 0 < alpha <= 1:
        raise ValueError(f"alpha must be in (0, 1], got {alpha}")
    return gap_ms if prev_ms is None else (1 - alpha) * prev_ms + alpha * gap_ms


def hold_step_ms(itl_ms: float, params: PaceParams = PaceParams(), itl_src_ms: float | None = None) -> float:
    """How much the hold may grow per paced token (ms): ``max_gap_factor x itl - itl_src`` with
    both floored at ``itl_floor_ms``; ``itl``: the reference ITL (the larger of RLD's and MD's),
    ``itl_src``: the paced source's own ITL (RLD's; default ``itl``). A paced gap is then about
    ``itl_src + step = max_gap_factor x itl``. With equal ITLs the step is ``(max_gap_factor - 1)
    x itl``; when MD is slower than RLD (its lag grows by ``itl - itl_src`` per token) the larger
    step still gains ``(max_gap_factor - 1) x itl`` per token on it."""
    ref = max(itl_ms, params.itl_floor_ms)
    src = ref if itl_src_ms is None else min(ref, max(itl_src_ms, params.itl_floor_ms))
    return params.max_gap_factor * ref - src


def next_hold(hold_ms: float, itl_ms: float, target_ms: float | None, params: PaceParams = PaceParams(),
              itl_src_ms: float | None = None) -> float:
    """The hold for the next paced token: ``hold + step`` (:func:`hold_step_ms`), capped by
    ``target`` (``prior_lag_ms`` when None; the pacer passes ``prior_lag_ms`` until MD is live,
    then ``max_hold_ms``) and by ``max_hold_ms``; never below the current hold (a shrinking hold
    would bunch tokens)."""
    target = params.prior_lag_ms if target_ms is None else target_ms
    cap = min(params.max_hold_ms, max(0.0, target))
    return max(hold_ms, min(cap, hold_ms + hold_step_ms(itl_ms, params, itl_src_ms)))


def predicted_md_arrival_ms(last_md_arrival_ms: float, last_md_pos: int, pos: int, itl_md_ms: float) -> float:
    """When MD's token for ``pos`` should reach the gateway: MD's latest token (position
    ``last_md_pos``, arrived at ``last_md_arrival_ms``) plus ``(pos - last_md_pos)`` MD
    inter-token gaps (``itl_md_ms``, MD's own pace: MD may be slower than RLD, then its lag grows)."""
    return last_md_arrival_ms + max(0, pos - last_md_pos) * max(0.0, itl_md_ms)


def switch_ready(predicted_gap_ms: float | None, itl_ref_ms: float, ramp_tokens: int, hold_ms: float,
                 params: PaceParams = PaceParams()) -> bool:
    """Whether the client may switch to MD now.

    ``predicted_gap_ms``: MD's predicted arrival of the next position
    (:func:`predicted_md_arrival_ms`) minus the release time of the last token already scheduled
    (None: MD not live yet -> False). Ready when it is <= ``switch_gap_factor x itl_ref``
    (``itl_ref``: the larger of RLD's and MD's ITL). Also True once ``ramp_tokens >= max_ramp_tokens`` or the
    hold reached ``max_hold_ms`` (give up smoothing: the switch then has the gap it has).
    """
    if predicted_gap_ms is None:
        return False
    if ramp_tokens >= params.max_ramp_tokens or hold_ms >= params.max_hold_ms:
        return True
    return predicted_gap_ms <= params.switch_gap_factor * max(itl_ref_ms, params.itl_floor_ms) + 1e-9


def release_ms(arrival_ms: float, hold_ms: float, last_release_ms: float | None) -> float:
    """When a token is released: ``arrival + hold``, never before the previous token."""
    r = arrival_ms + max(0.0, hold_ms)
    return r if last_release_ms is None else max(r, last_release_ms)


@dataclass
class SwitchPacer:
    """Per-request jitter-buffer state at the gateway (one relayed request, catch-up handoff).

    Driven by :meth:`feed` (a token arrived at ``now_ms``) and :meth:`due` (tokens whose release
    time has come). ``route(st, tok) -> list`` is the gateway's in-order router
    (``Orchestrator._next_tokens``); ``st`` is the request state it reads (``handoff_mode``,
    ``switch_pos``, ``next_pos``, ``emitted``, ``md_diverged``). Tokens need ``pos``,
    ``token_id``, ``tier`` ("rld" for RLD's).

    Pacing is on while the request is in a catch-up handoff and not yet switched: each RLD token
    routed then gets ``hold += step`` (:func:`next_hold`; up to ``prior_lag_ms`` until MD's first
    token is seen, then up to ``max_hold_ms``). MD's tokens for positions RLD already streamed are
    checked against what was streamed (a mismatch goes to ``route`` at once: its divergence
    handling) and held back until :func:`switch_ready`; then the latest one is routed, which
    switches the client to MD at the next position.

    Fields: ``itl_ms`` / ``itl_md_ms`` (EWMA of RLD's / MD's gaps, per position), ``hold_ms``,
    ``lag_ms`` (MD's latest measured lag behind RLD at equal positions), ``ramp_tokens``,
    ``held_back`` (MD tokens checked and dropped while waiting), ``max_hold_seen_ms``.
    """

    params: PaceParams = field(default_factory=PaceParams)
    itl_ms: float | None = None
    itl_md_ms: float | None = None
    hold_ms: float = 0.0
    lag_ms: float | None = None
    ramp_tokens: int = 0
    held_back: int = 0
    max_hold_seen_ms: float = 0.0
    _rld_arrival: dict = field(default_factory=dict)
    _last_rld_ms: float | None = None
    _last_md: tuple | None = None  # (arrival_ms, pos) of MD's latest token
    _md_gaps: int = 0
    _withheld: object = None  # MD's latest agreeing token, not yet routed
    _last_release_ms: float | None = None
    _queue: list = field(default_factory=list)  # [(release_ms, token)] in release order

    def _pacing(self, st) -> bool:
        ho = st.handoff  # the gateway's pdd.gateway.state.HandoffState
        return ho.mode == "catch_up" and ho.switch_pos is None and not ho.md_diverged

    def _itl(self) -> float:
        return max(self.itl_ms if self.itl_ms is not None else self.params.itl_floor_ms, self.params.itl_floor_ms)

    def _itl_ref(self) -> float:
        # MD's estimate counts once it rests on MD_ITL_MIN_SAMPLES gaps (two tokens of one engine
        # step can arrive together; one such gap would predict MD far too early)
        md = self.itl_md_ms if self._md_gaps >= MD_ITL_MIN_SAMPLES else None
        return max(self._itl(), md or 0.0)

    def predicted_gap_ms(self, next_pos: int) -> float | None:
        """MD's predicted arrival of ``next_pos`` minus the last scheduled release (None: MD not live,
        or its pace not yet measured over ``MD_ITL_MIN_SAMPLES`` gaps)."""
        if self._last_md is None or self._md_gaps < MD_ITL_MIN_SAMPLES:
            return None
        arr = predicted_md_arrival_ms(self._last_md[0], self._last_md[1], next_pos, self._itl_ref())
        return arr - (self._last_release_ms if self._last_release_ms is not None else arr)

    def _ready(self, st) -> bool:
        return switch_ready(self.predicted_gap_ms(st.next_pos), self._itl_ref(), self.ramp_tokens, self.hold_ms,
                            self.params)

    def feed(self, st, tok, now_ms: float, route: Callable) -> None:
        """One token arrived at ``now_ms``; route it and schedule what became streamable."""
        if tok.tier == "rld":
            if self._last_rld_ms is not None:
                self.itl_ms = ewma_itl(self.itl_ms, max(0.0, now_ms - self._last_rld_ms))
            self._last_rld_ms = now_ms
            self._rld_arrival[tok.pos] = now_ms
        else:
            if self._last_md is not None and tok.pos > self._last_md[1]:
                self.itl_md_ms = ewma_itl(self.itl_md_ms, max(0.0, now_ms - self._last_md[0]) / (tok.pos - self._last_md[1]))
                self._md_gaps += 1
            self._last_md = (now_ms, tok.pos)
            if self._pacing(st) and tok.pos < st.next_pos:
                if tok.pos in self._rld_arrival:
                    self.lag_ms = now_ms - self._rld_arrival[tok.pos]
                agrees = 0 <= tok.pos < len(st.emitted) and st.emitted[tok.pos] == tok.token_id
                if agrees and not self._ready(st):
                    self.held_back += 1
                    self._withheld = tok
                    return  # checked; routed later if it is still the latest when the switch is due
                self._withheld = None
        self._schedule(st, route(st, tok), now_ms)
        if self._withheld is not None and self._pacing(st) and self._ready(st):
            tok, self._withheld = self._withheld, None
            self._schedule(st, route(st, tok), now_ms)  # switches the client to MD at next_pos
        if len(self._rld_arrival) > 4096:  # bounded memory for very long outputs
            for k in sorted(self._rld_arrival)[:2048]:
                del self._rld_arrival[k]

    def _schedule(self, st, toks: list, now_ms: float) -> None:
        pacing = self._pacing(st)
        for t in toks:
            if pacing and t.tier == "rld":
                cap = self.params.prior_lag_ms if self._last_md is None else self.params.max_hold_ms
                self.hold_ms = next_hold(self.hold_ms, self._itl_ref(), cap, self.params, self._itl())
                self.ramp_tokens += 1
                r = release_ms(now_ms, self.hold_ms, self._last_release_ms)
            else:
                r = release_ms(now_ms, 0.0, self._last_release_ms)
            self.max_hold_seen_ms = max(self.max_hold_seen_ms, r - now_ms)
            self._last_release_ms = r
            self._queue.append((r, t))

    def due(self, now_ms: float) -> list:
        """Tokens whose release time is <= ``now_ms``, in order (removed from the buffer)."""
        n = 0
        while n < len(self._queue) and self._queue[n][0] <= now_ms + 1e-9:
            n += 1
        out = [t for _, t in self._queue[:n]]
        del self._queue[:n]
        return out

    def wait_ms(self, now_ms: float) -> float | None:
        """Ms until the next buffered token is due (0 if overdue); None when nothing is buffered."""
        return None if not self._queue else max(0.0, self._queue[0][0] - now_ms)

    def summary(self) -> dict:
        """What the pacer did (for logs and tests)."""
        return {"paced_tokens": self.ramp_tokens, "max_hold_ms": round(self.max_hold_seen_ms, 3),
                "lag_ms": None if self.lag_ms is None else round(self.lag_ms, 3), "md_held_back": self.held_back,
                "itl_ms": None if self.itl_ms is None else round(self.itl_ms, 3),
                "itl_md_ms": None if self.itl_md_ms is None else round(self.itl_md_ms, 3)}


def paced_gaps(arrivals_ms: Sequence[float], holds_ms: Sequence[float]) -> list[float]:
    """Client gaps (ms) when token i arriving at ``arrivals_ms[i]`` is held ``holds_ms[i]``
    (release = max(arrival + hold, previous release)); for documentation and tests."""
    if len(arrivals_ms) != len(holds_ms):
        raise ValueError("arrivals and holds differ in length")
    rel: list[float] = []
    for a, h in zip(arrivals_ms, holds_ms):
        rel.append(release_ms(a, h, rel[-1] if rel else None))
    return [b - a for a, b in zip(rel, rel[1:])]
