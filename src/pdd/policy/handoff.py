"""Extend-Decode handoff from RLD to MD (PDD report, "Extend-Decode handoff", "Two handoff modes").

When MD holds all the prompt's KV, RLD hands over only the *token ids* it generated meanwhile;
MD recomputes their KV in one multi-token forward ("extend") and continues decoding.

- **One-shot**: RLD hands over all its pending tokens at once and is released at once
  (shortest RLD occupancy; MD has one larger stall).
- **Catch-up**: while more than ``threshold`` tokens are pending, RLD hands over everything
  generated so far *and keeps decoding*; MD extends over them; the next round hands over what
  RLD produced meanwhile. When the gap is ``<= threshold`` tokens the round is final: RLD stops,
  sends the rest and MD takes over. A hard cap of ``max_rounds`` rounds makes the round after
  the cap final whatever the gap (so a slow MD can never keep RLD busy forever).
- **Auto**: switch by RLD's real-time load with hysteresis: load = max(running / capacity,
  pages_used / pages_total); from catch-up go to one-shot when load >= ``high_watermark``;
  from one-shot go back to catch-up when load <= ``low_watermark``; otherwise keep the
  current mode. A loaded RLD wants to be released (one-shot); an idle one can afford to
  smooth MD's stall into several imperceptible ones (catch-up).
"""

from __future__ import annotations

from dataclasses import dataclass

HANDOFF_MODES = ("one_shot", "catch_up", "auto")


@dataclass(frozen=True)
class HandoffInputs:
    """RLD-side state when MD is ready (or when a catch-up round has been absorbed).

    tokens_pending: tokens generated on RLD whose ids are not yet on MD.
    rld_running / rld_capacity: sequences in RLD's batch / its max_running_seqs.
    rld_pages_used / rld_pages_total: RLD's KV pool occupancy.
    threshold: catch-up's "small gap" (report: e.g. 64 tokens).
    mode_config: "one_shot" | "catch_up" | "auto".
    current_mode: the mode auto is in now ("one_shot" | "catch_up"), for hysteresis.
    round_index: catch-up rounds already sent for this request (0 for the first).
    """

    tokens_pending: int
    rld_running: int = 0
    rld_capacity: int = 1
    rld_pages_used: int = 0
    rld_pages_total: int = 1
    threshold: int = 64
    mode_config: str = "one_shot"
    current_mode: str = "catch_up"
    round_index: int = 0
    max_rounds: int = 8
    high_watermark: float = 0.85
    low_watermark: float = 0.60


@dataclass(frozen=True)
class HandoffDecision:
    """mode: "one_shot" | "catch_up" (the mode applied, also auto's new current mode);
    tokens_to_send: how many pending token ids go to MD now;
    final: True when RLD stops decoding this request and MD takes over after this round."""

    mode: str
    tokens_to_send: int
    final: bool


def rld_load(inp: HandoffInputs) -> float:
    """RLD load in [0, 1+]: ``max(running / capacity, pages_used / pages_total)``."""
    seq = inp.rld_running / inp.rld_capacity if inp.rld_capacity > 0 else 1.0
    pages = inp.rld_pages_used / inp.rld_pages_total if inp.rld_pages_total > 0 else 1.0
    return max(seq, pages)


def effective_handoff_mode(inp: HandoffInputs) -> str:
    """The mode to apply: ``mode_config`` unless it is "auto", then the hysteresis rule."""
    if inp.mode_config not in HANDOFF_MODES:
        raise ValueError(f"unknown handoff mode {inp.mode_config!r}; expected one of {HANDOFF_MODES}")
    if inp.mode_config != "auto":
        return inp.mode_config
    load = rld_load(inp)
    cur = inp.current_mode if inp.current_mode in ("one_shot", "catch_up") else "catch_up"
    if cur == "catch_up" and load >= inp.high_watermark:
        return "one_shot"
    if cur == "one_shot" and load <= inp.low_watermark:
        return "catch_up"
    return cur


def decide_handoff(inp: HandoffInputs) -> HandoffDecision:
    """One handoff round.

    one_shot: send all ``tokens_pending``, final.
    catch_up: send all ``tokens_pending``; final iff ``tokens_pending <= threshold`` or
    ``round_index >= max_rounds``; otherwise RLD keeps decoding and a further round follows.
    """
    mode = effective_handoff_mode(inp)
    n = max(0, inp.tokens_pending)
    if mode == "one_shot":
        return HandoffDecision("one_shot", n, True)
    final = n <= inp.threshold or inp.round_index >= inp.max_rounds
    return HandoffDecision("catch_up", n, final)


def early_handoff_delay_s(wan_bytes: int, wan_gbps: float, elapsed_s: float) -> float:
    """Seconds from now until an early handoff (``policy.early_handoff``) should start: when the
    last byte of MD's KV (``wan_bytes`` bytes, streaming since ``elapsed_s`` seconds ago) is
    expected to have left at ``wan_gbps`` Gbit/s, i.e. ``max(0, wan_bytes x 8 / (wan_gbps x 1e9)
    - elapsed_s)``. The handoff's ids then cross the WAN beside that byte and reach MD as the KV
    lands (both take the one-way delay), instead of a crossing after MD's ``kv_ready`` came back:
    RLD stops about a WAN round trip earlier, and the client's switch gap is unchanged when the
    estimate holds (an early estimate makes MD's extend wait for the KV; a late one only hands
    over later). Also the remaining-transfer estimate of the anomaly cut-off
    (:func:`pdd.policy.cutoff.should_cut_off`). Raises ValueError for a non-positive rate or
    negative bytes."""
    if wan_gbps <= 0 or wan_bytes < 0:
        raise ValueError(f"need wan_gbps > 0 and wan_bytes >= 0, got {wan_gbps}, {wan_bytes}")
    return max(0.0, wan_bytes * 8 / (wan_gbps * 1e9) - max(0.0, elapsed_s))
