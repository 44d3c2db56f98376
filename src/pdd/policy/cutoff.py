"""Anomalous-traffic filtering (PDD report, "Anomalous-traffic filtering").

About 3-4% of requests have a very long input and a very short output: RLD finishes them
before their KV has crossed the WAN. The WAN transfer is then cut off: RLD completes the
request locally, nothing more is sent to MD and MD frees what it had received.
"""

from __future__ import annotations


def should_cut_off(rld_finished: bool, md_kv_complete: bool, remaining_wan_s: float | None = None,
                   min_remaining_s: float = 0.0, sent_fraction: float = 0.0,
                   max_sent_fraction: float = 1.0) -> bool:
    """Cancel the request's WAN transfer when RLD finished it while MD's KV is still incomplete
    and what is left to send is worth cancelling.

    Once MD holds all the KV, the handoff (or nothing, if RLD finished) is cheaper than any
    cancel. Before that, the bytes still to send serve only MD's decode-side cache (the next
    turn of the conversation hits it). The report's filter targets the few very long-input,
    short-output requests, whose remaining transfer is long. ``remaining_wan_s``: expected
    seconds to finish the transfer (None: unknown, cut off); with ``min_remaining_s`` > 0 a
    transfer finishing sooner than that is let through, keeping MD's cache aligned with P's.

    ``sent_fraction``: the share of the transfer's bytes MD has reported received (0 before its
    first progress report); at ``max_sent_fraction`` or more the transfer is let through whatever
    its remaining time. A cut-off saves the rest R but throws away the S bytes sent, and MD
    caches none of the prompt: a later turn of the conversation sends all S + R again. Cutting
    pays when R > q (S + R), q the chance of such a turn, i.e. while the share sent is under
    1 - q. ``policy.cutoff_max_sent_fraction``'s default 0.25 is q = 0.75 (multi-turn traffic:
    the report's setting has a 90% prefix hit), chosen in ``pdd sim experiment goodput``
    against 0.5 and 1 (docs/SIM.md "cutoff"). Without it, on a congested line (every transfer's
    share of the line slow, so every remainder long) the cut-off cancelled most relayed
    transfers, MD's cache fell behind P's, the next turns were relayed and resent, and the line
    stayed congested: the collapse the report's P -> RLD exclusion guards against.
    """
    if not rld_finished or md_kv_complete:
        return False
    if sent_fraction >= max_sent_fraction:
        return False
    return remaining_wan_s is None or remaining_wan_s >= min_remaining_s


def sent_fraction(received_bytes: float, expected_bytes: float) -> float:
    """The share of a transfer's ``expected_bytes`` that MD reported as ``received_bytes`` (both
    bytes), in [0, 1]; 0 when nothing is expected."""
    if expected_bytes <= 0:
        return 0.0
    return min(1.0, max(0.0, received_bytes / expected_bytes))


def predict_rld_finishes_first(
    max_output_tokens: int,
    rld_step_s: float,
    wan_seconds: float,
) -> bool:
    """Forecast of the anomaly filter (diagnostic only; never used to skip MD in planning):
    True when RLD's ``max_output_tokens`` decode steps of ``rld_step_s`` end before the
    missing KV's expected ``wan_seconds``. The rule that acts is :func:`should_cut_off`.
    """
    return max(0, max_output_tokens) * max(0.0, rld_step_s) < wan_seconds
