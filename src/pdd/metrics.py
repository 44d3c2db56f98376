"""Prometheus metrics (prometheus-client) of an engine instance, read from its live state at scrape time.

Engine instances serve ``/metrics`` on their own metrics port (:class:`InstanceCollector`); the
gateway's metrics, mounted on its HTTP port, are :mod:`pdd.gateway.metrics`. Names follow
Prometheus conventions: ``_total`` counters, ``_seconds`` histograms, ``_bytes`` sizes.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily


# an instance's counters (``Instance.counters``, /pdd/stats ``counters``) that count bytes, not
# events: each its own ``_bytes_total`` family instead of an ``event`` of pdd_events_total,
# exported (at 0 until the first count) on the roles that count it
BYTE_COUNTERS = {
    "kv_bytes_before_first_token": ("pdd_kv_before_first_token_bytes", "KV payload bytes P had written to its "
                                    "transfers when the prefill ended (overlapped with the prefill; docs/LINK.md)",
                                    ("prefill",)),
}


class InstanceCollector:
    """Gauges and counters of one engine instance (P, RLD, MD or colocated)."""

    def __init__(self, inst):
        self.inst = inst

    def collect(self):
        inst = self.inst
        lab = ["instance", "role"]
        lv = [inst.spec.name, inst.spec.role]
        e = inst.engine
        if e is None:
            return
        total, free, cached = kv_pages(e.pool)
        g = GaugeMetricFamily("pdd_kv_pages", "KV pages of the pool: total, and by state: free, cached (held only by "
                              "the prefix cache: reclaimed by the first allocation that needs them) and in_use (held "
                              "by requests); free + cached + in_use = total", labels=lab + ["state"])
        g.add_metric(lv + ["total"], total)
        g.add_metric(lv + ["free"], free)
        g.add_metric(lv + ["cached"], cached)
        g.add_metric(lv + ["in_use"], total - free - cached)
        yield g
        g = GaugeMetricFamily("pdd_kv_cache_usage_ratio", "KV pages held by requests / the pool's pages, 0 to 1 "
                              "(vLLM's kv_cache_usage_perc: pages only the prefix cache holds count as free)",
                              labels=lab)
        g.add_metric(lv, (total - free - cached) / total if total else 0.0)
        yield g
        g = GaugeMetricFamily("pdd_requests_live", "requests this instance holds (queue depth)", labels=lab)
        g.add_metric(lv, len(inst.reqs))
        yield g
        g = GaugeMetricFamily("pdd_running_sequences", "sequences in the engine's batch", labels=lab)
        g.add_metric(lv, len(e.seqs))
        yield g
        if hasattr(e, "pending_seqs"):
            g = GaugeMetricFamily("pdd_pending_sequences", "sequences that still need compute (the bounded queue's "
                                  "occupancy: TierBusy at max_running + max_waiting)", labels=lab)
            g.add_metric(lv, e.pending_seqs())
            yield g
            if e.max_waiting is not None:
                g = GaugeMetricFamily("pdd_pending_sequences_limit", "the bounded queue's limit", labels=lab)
                g.add_metric(lv, e.sched_cfg.max_running_seqs + e.max_waiting)
                yield g
        hs = inst.hit_stats()
        g = GaugeMetricFamily("pdd_prefix_hit_rate", "token-weighted prefix-cache hit rate", labels=lab + ["window"])
        g.add_metric(lv + ["all"], hs["prefix_hit_rate"])
        g.add_metric(lv + ["recent"], hs["prefix_hit_rate_window"])
        yield g
        c = CounterMetricFamily("pdd_prompt_tokens", "prompt tokens looked up in the prefix cache", labels=lab)
        c.add_metric(lv, hs["prompt_tokens"])
        yield c
        c = CounterMetricFamily("pdd_prefix_hit_tokens", "prompt tokens found in the prefix cache", labels=lab)
        c.add_metric(lv, hs["prefix_hit_tokens"])
        yield c
        c = CounterMetricFamily("pdd_forward_calls", "engine forward calls", labels=lab)
        c.add_metric(lv, getattr(e.runner, "forward_calls", 0))
        yield c
        c = CounterMetricFamily("pdd_preemptions", "sequences preempted for KV pages (their pages freed, "
                                "recomputed later)", labels=lab)
        c.add_metric(lv, getattr(e, "preemptions", 0))
        yield c
        if hasattr(e, "prefill_chunks"):
            c = CounterMetricFamily("pdd_prefill_chunks", "prefill chunks run (a sequence's prompt tokens in one "
                                    "forward pass)", labels=lab)
            c.add_metric(lv, e.prefill_chunks)
            yield c
        if inst.worker is not None:
            c = CounterMetricFamily("pdd_engine_busy_seconds", "time spent in forward passes", labels=lab)
            c.add_metric(lv, inst.worker.busy_s)
            yield c
        c = CounterMetricFamily("pdd_events", "request events on this instance", labels=lab + ["event"])
        for k, v in sorted(inst.counters.items()):
            if k not in BYTE_COUNTERS:
                c.add_metric(lv + [k], v)
        yield c
        for k, (name, help_, roles) in BYTE_COUNTERS.items():
            if k in inst.counters or inst.spec.role in roles:  # a counter is there from the start, at 0
                c = CounterMetricFamily(name, help_, labels=lab)
                c.add_metric(lv, inst.counters.get(k, 0))
                yield c
        sent = getattr(inst, "bytes_sent", None)
        if sent is not None:
            c = CounterMetricFamily("pdd_kv_sent_bytes", "KV payload bytes sent, by target", labels=lab + ["target"])
            for k, v in sorted(sent.items()):
                c.add_metric(lv + [k], v)
            yield c


def kv_pages(pool) -> tuple[int, int, int]:
    """``(total, free, cached)`` pages of ``pool`` (a ``KVPool``), read once each: cached pages are
    the ones only the prefix cache holds (``KVPool.num_cached``). Read off the engine thread, the
    three may be a step apart, so ``cached`` is capped at ``total - free``."""
    total, free = int(pool.num_pages), int(pool.num_free)
    return total, free, min(int(getattr(pool, "num_cached", 0)), total - free)


def start_instance_metrics(inst, port: int, host: str = "127.0.0.1") -> CollectorRegistry:
    """Serve ``/metrics`` for ``inst`` on ``host:port`` (a daemon thread), with the process's own
    ``process_*`` metrics (CPU seconds, resident memory, open files) beside :class:`InstanceCollector`'s."""
    from prometheus_client import ProcessCollector

    reg = CollectorRegistry()
    reg.register(InstanceCollector(inst))
    ProcessCollector(registry=reg)
    start_http_server(port, addr=host, registry=reg)
    return reg
