"""Anomalous-traffic filtering (PDD report, "Anomalous-traffic filtering").

About 3-4% of requests have a very long input and a very short output: RLD finishes them
before their KV has crossed the WAN. The WAN transfer is then cut off: RLD completes the
request locally, nothing more is sent to MD and MD frees what it had received.
"""

from __future__ import annotations


def should_cut_off(rld_finished: bool, md_kv_complete: bool) -> bool:
    """Cancel the request's WAN transfer iff RLD finished it while MD's KV is still incomplete.

    Once MD holds all the KV, the handoff (or nothing, if RLD finished) is cheaper than
    any cancel; before that, every further byte is wasted line capacity.
    """
    return bool(rld_finished) and not bool(md_kv_complete)


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
