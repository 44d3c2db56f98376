"""Anomalous-traffic filtering (PDD report, "Anomalous-traffic filtering").

About 3-4% of requests have a very long input and a very short output: RLD finishes them
before their KV has crossed the WAN. The WAN transfer is then cut off: RLD completes the
request locally, nothing more is sent to MD and MD frees what it had received.
"""

from __future__ import annotations


def should_cut_off(rld_finished: bool, md_kv_complete: bool, remaining_wan_s: float | None = None,
                   min_remaining_s: float = 0.0) -> bool:
    """Cancel the request's WAN transfer when RLD finished it while MD's KV is still incomplete
    and what is left to send is worth cancelling.

    Once MD holds all the KV, the handoff (or nothing, if RLD finished) is cheaper than any
    cancel. Before that, the bytes still to send serve only MD's decode-side cache (the next
    turn of the conversation hits it). The report's filter targets the few very long-input,
    short-output requests, whose remaining transfer is long. ``remaining_wan_s``: expected
    seconds to finish the transfer (None: unknown, cut off); with ``min_remaining_s`` > 0 a
    transfer finishing sooner than that is let through, keeping MD's cache aligned with P's.
    """
    if not rld_finished or md_kv_complete:
        return False
    return remaining_wan_s is None or remaining_wan_s >= min_remaining_s


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
