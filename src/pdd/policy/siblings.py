"""Choices of one prompt (``n`` > 1, or a batch repeating a prompt): one copy of the prompt's KV
crosses the WAN, not one per choice.

The decode-side radix cache (PDD report, "DRC") ships only what MD lacks; but the ``n`` choices of
a request start together, so while the first choice's KV is still crossing MD's cache does not
hold it yet, and every sibling would ship the same pages again. A sibling can instead reserve
on the first choice's MD once that KV has arrived (MD inserts the prompt's whole pages into its
cache on import): it then ships only the prompt's partial last page. Waiting costs the sibling
about one WAN round trip of latency (the reservation's reply leaves MD after the first choice's
KV arrived, instead of beside it); shipping costs the line the copies' serialisation, which
delays every transfer queued behind them. The same holds for a request whose prefix another
request's KV, still crossing, is bringing to its MD (a claim in the gateway's prefix index):
:func:`claim_waits_for_kv`.
"""

from __future__ import annotations


def sibling_waits_for_kv(first_wan_bytes: int, siblings: int, wan_gbps: float, wan_rtt_ms: float) -> bool:
    """Whether the ``siblings`` other choices of a prompt reserve on MD after the first choice's
    KV arrived there (True) rather than ship their own copies at once (False).

    ``first_wan_bytes``: the KV bytes the first choice's transfer plans to send (its missing
    prompt KV, bytes); ``wan_gbps``: the WAN line's rate estimate (Gbit/s); ``wan_rtt_ms``: its
    round trip. Waits when the copies' serialisation, ``siblings x first_wan_bytes x 8 /
    (wan_gbps x 1e9)`` seconds of line time, exceeds the round trip a waiting sibling loses: a
    small increment (a high-hit agentic turn) is cheaper to send again than to wait for. A
    non-positive rate: waits (copies would never finish).
    """
    if siblings <= 0 or first_wan_bytes <= 0:
        return False
    if wan_gbps <= 0:
        return True
    line_s = siblings * first_wan_bytes * 8.0 / (wan_gbps * 1e9)
    return line_s > max(0.0, wan_rtt_ms) / 1000.0


def claim_waits_for_kv(claimed_bytes: float, wan_gbps: float, wan_rtt_ms: float) -> bool:
    """Whether a request whose prefix ends in another request's *claim* on its MD (pages routed
    there whose KV is still crossing the WAN: ``pdd.policy.prefix_index``) reserves there after
    that KV arrived (True) rather than ship the claimed pages again (False): the sibling rule
    (:func:`sibling_waits_for_kv`) for one copy of ``claimed_bytes`` (the claimed pages' KV,
    bytes). MD's cache matches only KV that landed, so without the wait every such request
    sends its copy; a conversation whose relayed turns follow a transfer still queued then
    resends its whole prompt each turn. Waiting costs about a round trip beyond the claim's own
    landing; a copy costs the line its serialisation (and lands behind or beside the claim).
    Whether the wait is on the request's first-token path is the caller's to weigh (``gateway.
    launch``: relayed at once, or the claim already being sent)."""
    return sibling_waits_for_kv(int(claimed_bytes), 1, wan_gbps, wan_rtt_ms)
