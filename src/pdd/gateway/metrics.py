"""Prometheus metrics (prometheus-client) of the gateway, mounted on its HTTP port at ``/metrics``:
TTFT / ITL histograms (:class:`GatewayMetrics`), the orchestrator's counters and admission
control's (:class:`AdmissionCollector`), read at scrape time. An engine instance's metrics are
:mod:`pdd.metrics`. Names follow Prometheus conventions: ``_total`` counters, ``_seconds``
histograms, ``_bytes`` sizes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from pdd.gateway.state import OUTCOMES

# TTFT / ITL buckets, seconds: from a fast-path decode step to a long WAN transfer
TTFT_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
ITL_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0)


class _OrchestratorCollector:
    def __init__(self, orch):
        self.orch = orch

    def collect(self):
        o = self.orch
        c = CounterMetricFamily("pdd_gateway_requests", "requests by pipeline", labels=["pipeline"])
        for k, v in sorted(o.pipelines.items()):
            c.add_metric([k], v)
        yield c
        t = o.totals
        # each request (each choice of n) exactly once: completed (incl. ended by a stop string),
        # failed, cancelled (the client disconnected; vLLM's finish reason "abort") or rejected
        # (refused before any tier ran it: a tier's 429, or a 503 when no instance of a role was
        # reachable on its first try); pdd.gateway.state.OUTCOMES
        c = CounterMetricFamily("pdd_gateway_outcomes", "requests ended, by outcome: completed, failed, "
                                "cancelled (client disconnected) or rejected (refused before any tier ran it: "
                                "429, or 503 with no instance of a role reachable)",
                                labels=["outcome"])
        for k in OUTCOMES:
            c.add_metric([k], t.get(k, 0))
        yield c
        c = CounterMetricFamily("pdd_handoffs", "RLD -> MD handoffs by mode", labels=["mode"])
        for k, v in sorted(t.items()):
            if k.startswith("handoffs_"):
                c.add_metric([k[len("handoffs_"):]], v)
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
            g = GaugeMetricFamily("pdd_wan_gbps_estimate", "live WAN throughput estimate, Gbit/s")
            g.add_metric([], o.wan_gbps_live)
            yield g
        peers = o.wan_peers.view() if getattr(o, "wan_peers", None) is not None else {}
        # per WAN peer (MD): what the pipeline choice and MD routing read (pdd.policy.wan_estimate)
        g = GaugeMetricFamily("pdd_wan_peer_gbps", "WAN goodput estimate per MD (live median of its KV receive "
                              "rates, or the configured line before a sample / with policy.wan_estimate config), "
                              "Gbit/s", labels=["instance"])
        r = GaugeMetricFamily("pdd_wan_peer_rtt_ms", "WAN round-trip estimate per MD (minimum of recent reservation "
                              "round trips, or the configured RTT), ms", labels=["instance"])
        for name, v in peers.items():
            g.add_metric([name], v["gbps"])
            r.add_metric([name], v["rtt_ms"])
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
    """The gateway's registry: TTFT / ITL histograms by pipeline and tier, plus the
    orchestrator's counters read at scrape time."""

    def __init__(self, orch):
        self.registry = CollectorRegistry()
        self.ttft = Histogram("pdd_ttft_seconds", "time to first token at the gateway", ["pipeline"],
                              buckets=TTFT_BUCKETS, registry=self.registry)
        self.itl = Histogram("pdd_itl_seconds", "inter-token latency at the gateway", ["pipeline", "tier"],
                             buckets=ITL_BUCKETS, registry=self.registry)
        self.registry.register(_OrchestratorCollector(orch))


class AdmissionCollector:
    """The gateway's admission control (``pdd.gateway.admission.Admission``): requests admitted
    and refused (HTTP 429) by reason, and the measured quantities the limits apply to."""

    def __init__(self, adm):
        self.adm = adm

    def collect(self):
        a = self.adm
        c = CounterMetricFamily("pdd_gateway_admitted", "requests admitted by admission control")
        c.add_metric([], a.admitted)
        yield c
        c = CounterMetricFamily("pdd_gateway_rejected", "requests refused with HTTP 429, by the limit hit",
                                labels=["reason"])
        for k, v in sorted(a.rejected.items()):
            c.add_metric([k], v)
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
