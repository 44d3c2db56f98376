"""Prometheus metrics (prometheus-client) of the gateway, mounted on its HTTP port at ``/metrics``:
TTFT / ITL / end-to-end histograms, a request's queue / prefill / decode / inference times
(:func:`request_intervals`), its prompt and output lengths, the finish reasons and the prompt and
generated token counters (:class:`GatewayMetrics`), HTTP responses by route and status
(:class:`pdd.gateway.http_metrics.HttpMetrics`), the orchestrator's counters and admission control's
(:class:`AdmissionCollector`), read at scrape time, and the process's own ``process_*``. An engine
instance's metrics are :mod:`pdd.metrics`. Names follow Prometheus conventions: ``_total``
counters, ``_seconds`` histograms, ``_bytes`` sizes. docs/SERVE.md "Metrics" lists them all.
"""

from __future__ import annotations

import time

from prometheus_client import CollectorRegistry, Counter, Histogram, ProcessCollector
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdd.gateway.http_metrics import HttpCounters
from pdd.gateway.phase import Phase
from pdd.gateway.admission import REJECT_REASONS
from pdd.gateway.state import OUTCOMES
from pdd.types import Pipeline

# TTFT / ITL buckets, seconds: from a fast-path decode step to a long WAN transfer; a gap between
# two tokens reaches seconds when a request waits for a lost instance's recovery (up to
# pdd.gateway.recovery.RECOVERY_WAIT_S, 30 s), which the top ITL buckets separate from +Inf
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
# a request's whole life at the gateway, seconds (vLLM's e2e_request_latency_seconds spans the same)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 30.0, 60.0, 120.0, 300.0, 600.0)
# a request's prompt / output length, tokens (vLLM's request_prompt_tokens buckets: 1-2-5 steps)
TOKEN_BUCKETS = (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000, 2000, 5000, 10000, 20000, 50000, 100000, 200000)
HANDOFF_MODES_APPLIED = ("one_shot", "catch_up")  # pdd.policy.handoff.decide_handoff's modes ("auto" picks one)
FINISHED_REASONS = ("stop", "length")  # a choice's finish_reason as its client got it (abort: cancelled)
GBPS_TO_BYTES_PER_S = 1e9 / 8  # the WAN estimates are kept in Gbit/s; exported in bytes/s (base units)


def prefill_start(st) -> float:
    """When request ``st`` (a ``ReqState``) was sent to the tiers, ``time.perf_counter`` seconds:
    its first attempt's prompt sent to its prefill instance (``st.events["prefill_sent"]``), else
    its first move to the prefill phase (an orchestrator that sends no prompt itself), else its
    start at the gateway (``st.t_arrival``: one that keeps no phases)."""
    t = st.events.get("prefill_sent")
    if t is None:
        t = next((t for ph, t in st.life.history if ph is Phase.PREFILL), st.t_arrival)
    return t


def request_intervals(t_arrival: float, t_start: float, t_first: float, t_last: float | None = None) -> dict:
    """A choice's life at the gateway split as vLLM splits a request's (seconds of one clock;
    pure): ``t_arrival`` its start at the gateway (the TTFT origin), ``t_start`` its prompt sent
    to the tiers (:func:`prefill_start`), ``t_first`` / ``t_last`` its first and last token handed
    to the client. Returns ``{"queue", "prefill"}`` (arrival -> sent -> first token: their sum is
    the TTFT) and, with ``t_last``, ``"decode"`` (first -> last token) and ``"inference"`` (sent
    -> last token); ``t_start`` is taken within ``[t_arrival, t_first]``, so none is negative."""
    start = min(max(t_start, t_arrival), t_first)
    out = {"queue": start - t_arrival, "prefill": t_first - start}
    if t_last is not None:
        out["decode"] = max(0.0, t_last - t_first)
        out["inference"] = max(0.0, t_last - start)
    return out


class _OrchestratorCollector:
    def __init__(self, orch):
        self.orch = orch

    def collect(self):
        o = self.orch
        c = CounterMetricFamily("pdd_gateway_requests", "requests (each choice of n) started on the tiers, by the "
                                "pipeline of their start (a recovery's new attempts are not counted)",
                                labels=["pipeline"])
        for k in sorted({*(p.value for p in Pipeline), *o.pipelines}):  # each at 0 from the start
            c.add_metric([k], o.pipelines.get(k, 0))
        yield c
        t = o.totals
        # each request (each choice of n) exactly once: completed (incl. ended by a stop string),
        # failed, cancelled (the client disconnected; vLLM's finish reason "abort") or rejected
        # (refused before any tier ran it: a tier's 429, or a 503 when no instance of a role was
        # reachable on its first try); pdd.gateway.state.OUTCOMES
        c = CounterMetricFamily("pdd_gateway_outcomes", "requests (each choice of n) that admission let in, by how "
                                "they ended: completed, failed, cancelled (client disconnected) or rejected (a tier "
                                "refused it while it started: 429; or no instance of a role reachable on its first "
                                "try: 503); admission's own 429s are pdd_gateway_rejected_total only",
                                labels=["outcome"])
        for k in OUTCOMES:
            c.add_metric([k], t.get(k, 0))
        yield c
        # what faults did (docs/FAULTS.md), as /pdd/stats totals counts it
        for key, name, help_ in (
                ("recoveries", "pdd_gateway_recoveries", "new attempts of requests after a lost instance, whatever "
                 "became of the requests (at most liveness.recovery_attempts per request)"),
                ("recovered", "pdd_gateway_recovered", "completed requests (each choice of n) that made at least one "
                 "new attempt after a lost instance"),
                ("degraded", "pdd_gateway_degraded", "completed requests (each choice of n) that ended on RLD "
                 "without MD (no MD usable)"),
                ("instances_lost", "pdd_gateway_instances_lost", "connections to engine instances lost (the "
                 "instance died, or its heartbeat went silent)"),
                ("kv_awaited_expired", "pdd_gateway_kv_awaited_expired", "finished relayed requests whose KV MD "
                 "did not report within request_timeout_s (dropped on MD)")):
            c = CounterMetricFamily(name, help_)
            c.add_metric([], t.get(key, 0))
            yield c
        c = CounterMetricFamily("pdd_gateway_request_success", "choices (each choice of n) that ended, by the "
                                "finish_reason their client got: stop (EOS, a stop token or string), length "
                                "(max_tokens or the context), abort (the client went away: "
                                "pdd_gateway_outcomes_total{outcome=\"cancelled\"})", labels=["finished_reason"])
        finished = getattr(getattr(o, "metrics", None), "finished", {})
        for k in FINISHED_REASONS:
            c.add_metric([k], finished.get(k, 0))
        c.add_metric(["abort"], t.get("cancelled", 0))
        yield c
        c = CounterMetricFamily("pdd_handoffs", "RLD -> MD handoffs by mode", labels=["mode"])
        modes = {*HANDOFF_MODES_APPLIED, *(k[len("handoffs_"):] for k in t if k.startswith("handoffs_"))}
        for k in sorted(modes):  # each mode at 0 from the start
            c.add_metric([k], t.get(f"handoffs_{k}", 0))
        yield c
        c = CounterMetricFamily("pdd_cut_offs", "WAN transfers cut off because RLD finished first")
        c.add_metric([], t.get("cut_offs", 0))
        yield c
        c = CounterMetricFamily("pdd_wan_kv_bytes", "KV bytes to MD over the WAN", labels=["kind"])
        c.add_metric(["planned"], t.get("wan_bytes_planned", 0))
        c.add_metric(["cancelled"], t.get("wan_bytes_cancelled", 0))
        c.add_metric(["expected"], t.get("wan_bytes_expected", 0))
        yield c
        g = GaugeMetricFamily("pdd_gateway_requests_live", "requests in flight at the gateway")
        g.add_metric([], len(o.reqs))
        yield g
        # the phase each live request holds (pdd.gateway.phase; a recovering one counted once)
        g = GaugeMetricFamily("pdd_gateway_requests_phase", "requests in flight at the gateway, by phase",
                              labels=["phase"])
        by_phase: dict[str, int] = {}
        for st in {id(st): st for st in list(o.reqs.values())}.values():
            by_phase[st.phase.value] = by_phase.get(st.phase.value, 0) + 1
        for k, v in sorted(by_phase.items()):
            g.add_metric([k], v)
        yield g
        if o.wan_gbps_live is not None:
            g = GaugeMetricFamily("pdd_wan_goodput_bytes_per_second", "live WAN throughput estimate, bytes/s "
                                  "(KV payload bytes)")
            g.add_metric([], o.wan_gbps_live * GBPS_TO_BYTES_PER_S)
            yield g
        peers = o.wan_peers.view() if getattr(o, "wan_peers", None) is not None else {}
        # per WAN peer (MD): what the pipeline choice and MD routing read (pdd.policy.wan_estimate)
        g = GaugeMetricFamily("pdd_wan_peer_goodput_bytes_per_second", "WAN goodput estimate per MD (live median "
                              "of its KV receive rates, or the configured line before a sample / with "
                              "policy.wan_estimate config), bytes/s", labels=["instance"])
        r = GaugeMetricFamily("pdd_wan_peer_rtt_seconds", "WAN round-trip estimate per MD (minimum of recent "
                              "reservation round trips, or the configured RTT), seconds", labels=["instance"])
        for name, v in peers.items():
            g.add_metric([name], v["gbps"] * GBPS_TO_BYTES_PER_S)
            r.add_metric([name], v["rtt_ms"] / 1000)
        yield g
        yield r
        c = CounterMetricFamily("pdd_gateway_md_routes", "requests routed to each MD", labels=["instance"])
        for name, v in sorted(getattr(o, "md_routes", {}).items()):
            c.add_metric([name], v)
        yield c
        c = CounterMetricFamily("pdd_gateway_md_routes_by_wan", "MD routes the WAN estimates changed (another MD "
                                "than the hit-and-load rule's)")
        c.add_metric([], o.totals.get("md_routes_by_wan", 0))
        yield c
        probes = getattr(o, "wan_probes", {})
        c = CounterMetricFamily("pdd_gateway_wan_probes", "WAN probes of MDs whose goodput estimate was stale "
                                "(policy.wan_probe_interval_s)", labels=["outcome"])
        c.add_metric(["ok"], probes.get("probes", 0))
        c.add_metric(["failed"], probes.get("failures", 0))
        yield c


class GatewayMetrics:
    """The gateway's registry: TTFT / ITL / end-to-end histograms by pipeline (and tier), the
    queue / prefill / decode / inference times, prompt and output lengths and finish reasons of
    the choices, the prompt and generated token counters, the HTTP counters (``http``, fed by
    :class:`pdd.gateway.http_metrics.HttpMetrics`), the orchestrator's counters read at scrape
    time, and the process's ``process_*``.

    Fed by the request's life: ``ttft``, ``itl`` and ``generation_tokens`` as each token is handed
    to the client's choice (:meth:`token_handed`, from ``pdd.gateway.openai_run.Generation.deltas``:
    so TTFT count + ITL count = generated tokens = ``usage.completion_tokens`` summed), ``e2e``
    when a choice is counted completed (``pdd.gateway.stream.Streams._count_outcome``: its count
    is ``pdd_gateway_outcomes_total{outcome="completed"}``) and ``prompt_tokens`` once a
    request's choices all started (``pdd.gateway.api``: its prompts' tokens, as its
    ``usage.prompt_tokens``). ``queue`` and ``prefill`` with a choice's TTFT; ``decode``,
    ``inference``, the lengths and ``finished`` at its last token (:meth:`choice_finished`, from
    ``Generation.deltas`` too)."""

    def __init__(self, orch):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("pdd_gateway_ttft_seconds", "time to first token at the gateway, from the request's "
                              "start there to its first token handed to the client, per choice", ["pipeline"],
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("pdd_gateway_itl_seconds", "inter-token latency at the gateway: the gap before each token "
                             "handed to the client after a choice's first, by the tier that made the token",
                             ["pipeline", "tier"],
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.e2e = Histogram("pdd_gateway_e2e_request_latency_seconds", "a completed choice's time at the gateway, "
                             "from its start there to its last token", ["pipeline"], buckets=E2E_BUCKETS,
                             registry=self.registry)
        self.queue = Histogram("pdd_gateway_request_queue_time_seconds", "a choice's time at the gateway from its "
                               "start there (the TTFT origin) to its prompt sent to its prefill instance (routing, "
                               "RLD's reservation, a wait for a lost instance); an engine's own queue is in the "
                               "prefill time; per choice that got a first token", ["pipeline"], buckets=TTFT_BUCKETS,
                               registry=self.registry)
        self.prefill = Histogram("pdd_gateway_request_prefill_time_seconds", "from a choice's prompt sent to its "
                                 "prefill instance to its first token handed to the client (P's queue and prefill, "
                                 "the KV transfer, the decoder's first token); queue + prefill = TTFT; per choice "
                                 "that got a first token", ["pipeline"], buckets=TTFT_BUCKETS, registry=self.registry)
        self.decode = Histogram("pdd_gateway_request_decode_time_seconds", "from a choice's first token handed to "
                                "the client to its last, per choice that ended with finish_reason stop or length",
                                ["pipeline"], buckets=E2E_BUCKETS, registry=self.registry)
        self.inference = Histogram("pdd_gateway_request_inference_time_seconds", "from a choice's prompt sent to "
                                   "its prefill instance to its last token handed to the client (prefill + decode), "
                                   "per choice that ended with finish_reason stop or length", ["pipeline"],
                                   buckets=E2E_BUCKETS, registry=self.registry)
        self.prompt_len = Histogram("pdd_gateway_request_prompt_tokens", "the prompt tokens of each choice that "
                                    "ended with finish_reason stop or length", buckets=TOKEN_BUCKETS,
                                    registry=self.registry)
        self.output_len = Histogram("pdd_gateway_request_generation_tokens", "the tokens handed to each choice that "
                                    "ended with finish_reason stop or length (its part of usage.completion_tokens)",
                                    buckets=TOKEN_BUCKETS, registry=self.registry)
        self.finished = dict.fromkeys(FINISHED_REASONS, 0)  # choices ended, by finish_reason (request_success)
        self.prompt_tokens = Counter("pdd_gateway_prompt_tokens", "prompt tokens of the requests started (each "
                                     "prompt once per request, as usage.prompt_tokens counts it)",
                                     registry=self.registry)
        self.generation_tokens = Counter("pdd_gateway_generation_tokens", "output tokens handed to requests' choices "
                                         "(usage.completion_tokens), also of requests later cancelled or failed",
                                         registry=self.registry)
        self.http = HttpCounters(self.registry)  # fed by pdd.gateway.http_metrics.HttpMetrics
        self.registry.register(_OrchestratorCollector(orch))
        ProcessCollector(registry=self.registry)

    def token_handed(self, st, tier: str, last_s: float | None) -> float:
        """A token of request ``st`` (a ``ReqState``), made by ``tier``, handed to its choice now:
        a TTFT sample (from ``st.t_arrival``) and its queue and prefill times
        (:func:`request_intervals`) if ``last_s`` is None (its first), else an ITL one (from
        ``last_s``), by ``st``'s pipeline; one generated token. Returns now
        (``time.perf_counter``), the choice's next ``last_s``."""
        now = time.perf_counter()
        if last_s is None:
            self.ttft.labels(st.pipeline.value).observe(max(0.0, now - st.t_arrival))
            iv = request_intervals(st.t_arrival, prefill_start(st), now)
            self.queue.labels(st.pipeline.value).observe(iv["queue"])
            self.prefill.labels(st.pipeline.value).observe(iv["prefill"])
        else:
            self.itl.labels(st.pipeline.value, tier).observe(max(0.0, now - last_s))
        self.generation_tokens.inc()
        return now

    def choice_finished(self, st, finish_reason: str, tokens: int, first_s: float, last_s: float) -> None:
        """A choice of request ``st`` got its last token with ``finish_reason`` (``stop`` or
        ``length``, as its client got it): counted in ``pdd_gateway_request_success_total``, its
        decode and inference times (:func:`request_intervals`, ``first_s`` / ``last_s`` its first
        and last token handed, ``time.perf_counter``) and its prompt and output lengths (``tokens``
        handed to it) observed. Raises ``ValueError`` for another finish reason."""
        if finish_reason not in FINISHED_REASONS:
            raise ValueError(f"unknown finish_reason {finish_reason!r}; expected one of {FINISHED_REASONS}")
        self.finished[finish_reason] += 1
        iv = request_intervals(st.t_arrival, prefill_start(st), first_s, last_s)
        self.decode.labels(st.pipeline.value).observe(iv["decode"])
        self.inference.labels(st.pipeline.value).observe(iv["inference"])
        self.prompt_len.observe(st.prompt_len)
        self.output_len.observe(tokens)


class AdmissionCollector:
    """The gateway's admission control (``pdd.gateway.admission.Admission``): requests admitted
    and refused (HTTP 429) by reason, and the measured quantities the limits apply to."""

    def __init__(self, adm):
        self.adm = adm

    def collect(self):
        a = self.adm
        c = CounterMetricFamily("pdd_gateway_admitted", "API requests admitted by admission control (a request "
                                "of n choices, or a batch of prompts, once)")
        c.add_metric([], a.admitted)
        yield c
        c = CounterMetricFamily("pdd_gateway_rejected", "API requests answered HTTP 429, by the limit hit: "
                                "admission's (inflight, queued_tokens, queue_wait, wan_backlog, concurrency) or a "
                                "tier's refusal while the request started (tier_busy, out_of_pages: its choices are "
                                "pdd_gateway_outcomes_total{outcome=\"rejected\"} too)", labels=["reason"])
        for k in sorted({*REJECT_REASONS, *a.rejected}):  # each reason at 0 from the start
            c.add_metric([k], a.rejected.get(k, 0))
        yield c
        g = GaugeMetricFamily("pdd_gateway_inflight", "requests (choices) admitted and not yet ended")
        g.add_metric([], a.inflight)
        yield g
        g = GaugeMetricFamily("pdd_gateway_queued_prompt_tokens", "prompt tokens admitted and not yet prefilled")
        g.add_metric([], a.queued_tokens)
        yield g
        rate = a.rate.tokens_per_s
        if rate is not None:
            g = GaugeMetricFamily("pdd_prefill_tokens_per_second", "P's measured prefill rate (busy periods)")
            g.add_metric([], rate)
            yield g
