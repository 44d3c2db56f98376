"""Live policy counters at the gateway (issue #22 item 3), read on ``/metrics``:

- **Handoff mode, per RLD**: every handoff round RLD decides (``policy.handoff``: one-shot,
  catch-up, or auto switching between them on RLD's live load with hysteresis) comes back with its
  inputs; a round whose applied mode differs from the mode RLD was in (``inputs.current_mode``)
  is a switch, the same rule RLD counts by (its own ``pdd_events_total{event="mode_switches"}``).
  ``pdd_gateway_handoff_rounds_total{instance,mode}``,
  ``pdd_gateway_handoff_mode_switches_total{instance}``, ``pdd_gateway_handoff_mode{instance,mode}``
  (1 for the mode of its last round).
- **P/MD prefix-hit alignment**: over the last ``ALIGN_WINDOW`` attempts that got both P's
  prefill reply and MD's reservation reply, hit_P = sum of P's cached prompt tokens / sum of
  prompt tokens, hit_MD = sum of MD's cached prompt tokens (its decode-side radix cache) / the same
  sum, and ``pdd_gateway_prefix_hit_alignment`` = hit_MD / hit_P (absent while hit_P is 0).
  1 means MD's cache holds what P's does, the state the report's two pipelines keep (both end at
  MD); below 1 MD lags and more KV crosses the WAN (the drift a P->RLD-only pipeline would cause);
  above 1 MD holds more (a larger pool, or P evicted). With ``policy.md_predicted_send`` MD caps
  its match at the predicted first page, so hit_MD counts what MD used, not more.
  ``pdd_gateway_prefix_hit_rate{tier="prefill"|"main_decode"}`` are hit_P and hit_MD.

Fed at the end of each attempt (``gateway.routing``'s ``_unassign`` hook); pure bookkeeping.
"""

from __future__ import annotations

from collections import OrderedDict, deque

ALIGN_WINDOW = 256
SEEN_KEPT = 4096  # requests whose counted decisions are remembered (a recovered one ends its attempts soon after)


class HitAlignment:
    """A window of (prompt tokens, P's hit tokens, MD's hit tokens), one per attempt."""

    def __init__(self, window: int = ALIGN_WINDOW):
        self.window: deque[tuple[int, int, int]] = deque(maxlen=window)

    def record(self, prompt_tokens: int, p_hit: int, md_hit: int) -> None:
        if prompt_tokens > 0:
            self.window.append((prompt_tokens, max(0, p_hit), max(0, md_hit)))

    def rates(self) -> dict:
        """{"n", "prompt_tokens", "p_hit_rate", "md_hit_rate", "alignment"} (rates None when the
        window is empty, alignment None while P's hits are 0)."""
        tot = sum(x[0] for x in self.window)
        p = sum(x[1] for x in self.window)
        md = sum(x[2] for x in self.window)
        return {"n": len(self.window), "prompt_tokens": tot,
                "p_hit_rate": p / tot if tot else None, "md_hit_rate": md / tot if tot else None,
                "alignment": md / p if p else None}


class LiveCounters:
    """The gateway's live policy counters (module docstring); installs itself as
    ``orch.live_counters`` and registers its collector on the gateway's registry."""

    def __init__(self, orch, window: int = ALIGN_WINDOW):
        self.orch = orch
        self.align = HitAlignment(window)
        self.rounds: dict[tuple[str, str], int] = {}  # (rld, mode) -> handoff rounds
        self.switches: dict[str, int] = {}  # rld -> mode switches
        self.mode_now: dict[str, str] = {}  # rld -> mode of its last round
        self._seen: OrderedDict[str, int] = OrderedDict()  # request -> its decisions counted (recent ones)
        orch.live_counters = self
        reg = getattr(getattr(orch, "metrics", None), "registry", None)
        if reg is not None:
            reg.register(LiveCountersCollector(self))

    def attempt_ended(self, st) -> None:
        """Count ``st``'s attempt that just ended: its handoff rounds not counted yet, and its hit
        tokens when both P's and MD's replies came."""
        seen = self._seen.pop(st.rid, 0)  # decisions of its earlier attempts, counted then
        decisions = st.decisions[seen:]
        self._seen[st.rid] = len(st.decisions)
        while len(self._seen) > SEEN_KEPT:
            self._seen.popitem(last=False)
        rld = st.names.get("relay_decode")
        for d in decisions:
            if d.get("policy") != "handoff" or not isinstance(d.get("inputs"), dict) or rld is None:
                continue
            mode = (d.get("result") or {}).get("mode")
            if mode is None:
                continue
            self.rounds[(rld, mode)] = self.rounds.get((rld, mode), 0) + 1
            if d["inputs"].get("current_mode") != mode:
                self.switches[rld] = self.switches.get(rld, 0) + 1
            self.mode_now[rld] = mode
        ev = st.events
        if "md_reserved" in ev and "prefilled" in ev:
            # the attempt's prompt: a recovery attempt prefills the prompt plus the tokens streamed before it
            self.align.record(st.prompt_len + st.base, st.p_cached_tokens, st.md_cached_tokens)

    def view(self) -> dict:
        return {"handoff_rounds": {f"{r}/{m}": n for (r, m), n in sorted(self.rounds.items())},
                "handoff_mode_switches": dict(sorted(self.switches.items())),
                "handoff_mode_now": dict(sorted(self.mode_now.items())),
                "prefix_hit": self.align.rates()}


class LiveCountersCollector:
    def __init__(self, lc: LiveCounters):
        self.lc = lc

    def collect(self):
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

        lc = self.lc
        c = CounterMetricFamily("pdd_gateway_handoff_rounds", "handoff rounds RLD decided, by RLD and applied mode",
                                labels=["instance", "mode"])
        for (r, m), n in sorted(lc.rounds.items()):
            c.add_metric([r, m], n)
        yield c
        c = CounterMetricFamily("pdd_gateway_handoff_mode_switches", "handoff rounds whose applied mode differs "
                                "from the mode RLD was in (auto mode switching), by RLD", labels=["instance"])
        for r, n in sorted(lc.switches.items()):
            c.add_metric([r], n)
        yield c
        g = GaugeMetricFamily("pdd_gateway_handoff_mode", "1 for the mode of each RLD's last handoff round",
                              labels=["instance", "mode"])
        for r, m in sorted(lc.mode_now.items()):
            g.add_metric([r, m], 1)
        yield g
        a = lc.align.rates()
        g = GaugeMetricFamily("pdd_gateway_prefix_hit_rate", "prompt tokens found in the prefix cache over the last "
                              "attempts that reached both P and MD, by tier", labels=["tier"])
        if a["p_hit_rate"] is not None:
            g.add_metric(["prefill"], a["p_hit_rate"])
            g.add_metric(["main_decode"], a["md_hit_rate"])
        yield g
        if a["alignment"] is not None:
            g = GaugeMetricFamily("pdd_gateway_prefix_hit_alignment", "MD's prefix-hit rate / P's, over the same "
                                  "window (1: aligned; below 1: MD's cache lags P's)")
            g.add_metric([], a["alignment"])
            yield g
