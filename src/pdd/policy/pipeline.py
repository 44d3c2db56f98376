"""Pipeline choice: which instances serve a request (PDD report, "Pipelines").

Rules (report):
- Only two pipelines are *planned* in pdd mode: **P->MD** for high-hit requests (the WAN
  increment is small, no relay is needed) and **P->RLD->MD** for low-hit requests (RLD masks
  the WAN latency by decoding at once, "eager output tokens").
- **P->RLD alone is excluded**: if low-hit requests finished on RLD, MD would never receive
  their KV, MD's hit rate would drift below P's, more requests would become low-hit and RLD
  would collapse under the load. It is returned only for the ``allow_p_rld`` ablation (low-hit
  requests finish on RLD) and as the degraded mode when no MD is reachable.
- The decision compares the expected WAN time of the *missing* KV (prompt minus what MD's
  decode-side radix cache already holds, "DRC") against a TTFT budget.

Pure: no I/O, no clock; callers pass the live WAN throughput estimate when they have one.
"""

from __future__ import annotations

from dataclasses import dataclass

from pdd.types import Pipeline
from pdd.policy.wan_estimate import transfer_seconds

MODES = ("colocated", "same_dc_pd", "cross_dc_pd", "pdd")


@dataclass(frozen=True)
class PipelineInputs:
    """What the gateway knows when it plans a request.

    mode: "colocated" | "same_dc_pd" | "cross_dc_pd" | "pdd".
    prompt_tokens: prompt length.
    md_cached_tokens: prompt tokens MD's radix cache already holds (whole pages).
    kv_bytes_per_token: the model's KV bytes per token (a model property, never a constant).
    wan_gbps_estimate: live measured WAN throughput if known, else the configured line rate.
    wan_rtt_ms: WAN round-trip time.
    ttft_budget_ms: P->MD is chosen when the missing KV's expected WAN time fits it;
        0 (or less) means "always relay" in pdd mode (config.PolicyConfig semantics).
    allow_p_rld: ablation: requests that do not fit the budget finish on RLD (P->RLD).
    md_available: False when no MD is reachable (degraded: P->RLD).
    wan_backlog_bytes: KV bytes already queued to that MD ahead of this request's (bytes;
        ``pdd.policy.wan_estimate.queued_bytes``), which cross the line first.
    md_crosses_wan: False for an MD in datacenter A (a relay decoder re-roled to main-decode
        duty, ``pdd.gateway.membership``): its KV comes over the fast path, nothing to mask.
    """

    mode: str
    prompt_tokens: int
    md_cached_tokens: int = 0
    kv_bytes_per_token: int = 131072
    wan_gbps_estimate: float = 10.0
    wan_rtt_ms: float = 20.0
    ttft_budget_ms: float = 0.0
    allow_p_rld: bool = False
    md_available: bool = True
    wan_backlog_bytes: float = 0.0
    md_crosses_wan: bool = True


def missing_tokens(inp: PipelineInputs) -> int:
    """Prompt tokens whose KV MD lacks: ``max(0, prompt_tokens - md_cached_tokens)``."""
    return max(0, inp.prompt_tokens - max(0, inp.md_cached_tokens))


def expected_wan_seconds(inp: PipelineInputs) -> float:
    """Expected seconds until MD can emit the first token through the gateway over the WAN.

    ``rtt + (wan_backlog_bytes + missing_tokens * kv_bytes_per_token) * 8 / (wan_gbps_estimate * 1e9)``:
    the KV crosses A->B (half an RTT of propagation plus serialisation at the estimated
    throughput, after the bytes already queued to MD) and MD's token crosses back B->A (the
    other half RTT). Only the missing KV counts (decode-side radix cache, report "DRC"). A
    non-positive rate gives ``inf``.
    """
    return transfer_seconds(missing_tokens(inp) * inp.kv_bytes_per_token, inp.wan_gbps_estimate, inp.wan_rtt_ms,
                            inp.wan_backlog_bytes)


def relays_every_request(mode: str, ttft_budget_ms: float, allow_p_rld: bool, md_in_a: bool = False) -> bool:
    """Whether every request is planned P->RLD->MD before MD's cache state is known: ``pdd``
    mode with a zero (or negative) TTFT budget, without the ``allow_p_rld`` ablation and with no
    MD in datacenter A among the routable ones (``md_in_a``: a request routed there goes P->MD
    over the fast path, so the plan waits for MD's choice). Then :func:`choose_pipeline` cannot
    return anything else (what MD holds does not matter), so P may stream to RLD at once instead
    of waiting for MD's reservation."""
    return mode == "pdd" and ttft_budget_ms <= 0 and not allow_p_rld and not md_in_a


def plans_from_index(mode: str, ttft_budget_ms: float, allow_p_rld: bool, md_route_peek: bool) -> bool:
    """Whether the gateway plans a request on its prefix index's prediction of MD's cache before
    MD's reservation returns: ``pdd`` mode with a positive TTFT budget, neither the
    ``allow_p_rld`` ablation nor ``md_route_peek`` (which asks MD over the WAN). Then a request
    :func:`choose_pipeline` relays on the predicted ``md_cached_tokens`` is relayed at once
    (its TTFT does not wait a WAN round trip for the reservation, as with a zero budget) and one
    it sends P->MD is re-planned on MD's reply (what MD's cache really holds)."""
    return mode == "pdd" and ttft_budget_ms > 0 and not allow_p_rld and not md_route_peek


def choose_pipeline(inp: PipelineInputs) -> Pipeline:
    """Choose the pipeline for one request.

    - colocated -> COLOCATED; same_dc_pd -> P_D; cross_dc_pd -> P_MD (no relay exists there).
    - pdd:
        * MD unreachable -> P_RLD (degraded mode, never planned otherwise);
        * MD in datacenter A (``md_crosses_wan`` False) -> P_D: its KV takes the fast path;
        * budget > 0 and expected_wan_seconds <= budget -> P_MD (high-hit: small increment);
        * otherwise -> P_RLD_MD (low-hit: RLD masks the WAN), or P_RLD when the
          ``allow_p_rld`` ablation is on (report: the excluded pipeline that collapses).
    """
    if inp.mode == "colocated":
        return Pipeline.COLOCATED
    if inp.mode == "same_dc_pd":
        return Pipeline.P_D
    if inp.mode == "cross_dc_pd":
        return Pipeline.P_MD
    if inp.mode != "pdd":
        raise ValueError(f"unknown mode {inp.mode!r}; expected one of {MODES}")
    if not inp.md_available:
        return Pipeline.P_RLD
    if not inp.md_crosses_wan:
        return Pipeline.P_D
    if inp.ttft_budget_ms > 0 and expected_wan_seconds(inp) * 1000.0 <= inp.ttft_budget_ms + 1e-9:
        return Pipeline.P_MD
    return Pipeline.P_RLD if inp.allow_p_rld else Pipeline.P_RLD_MD
