"""Discrete-event simulator (SimPy) of a two-datacenter pdd cluster.

Every decision goes through the code the live runtime runs, looked up at call time (so a test
can replace it and see the simulator change):

- ``pdd.policy.pipeline.choose_pipeline`` (which pipeline), ``pdd.policy.handoff.decide_handoff``
  (one-shot / catch-up rounds), ``pdd.policy.cutoff.should_cut_off`` (anomaly filter),
  ``pdd.policy.wan_order.pick_next`` (WAN send order), ``pdd.policy.routing.choose_instance``;
- ``pdd.engine.scheduler.schedule`` forms every batch of every instance (continuous batching,
  chunked prefill, extends), so its small tail chunks appear here as they do in the engine.

Model (units in names; all times in simulated seconds):

- An *instance* is one engine (``gpus`` chips) with a roofline step-time model
  (``hardware.StepCostModel``), a KV pool of ``kv_capacity_tokens`` and, on P / MD / colocated,
  a prefix cache over the trace's 512-token blocks (LRU over unlocked blocks, children evicted
  before their parents). Admission reserves the uncached prompt plus the output length; a
  request that does not fit waits (FIFO).
- Pure-decode batches advance to their next membership change in one event (``k`` steps at the
  step time of the mid-point context); an arrival (or any message) wakes the instance, which
  finishes the step in flight and re-plans.
- Links: the WAN is *one* line shared by all A->B flows (processor sharing = TCP fairness, or
  the runtime's frame scheduler order ``fifo`` / ``srf`` via ``pick_next``) plus half an RTT of
  propagation each way; control messages and token streams cost the propagation only. The fast
  path is one line per sending P instance (its NICs).
- Request life follows docs/ARCHITECTURE.md: the gateway (in A) routes and asks MD to reserve
  (an RTT) while P prefills and samples the first token; the pipeline is chosen when MD's reply
  is back (at once with a zero TTFT budget) and P's sends wait for it (a request relayed at once
  sends MD's part when its prefill is done, ``md_predicted_send``); KV goes to RLD (fast)
  and/or MD (WAN, only the blocks MD lacks); the first token reaches the client when the KV has
  reached a decoder; RLD hands over token ids (asked when MD's kv_ready is back at the gateway,
  or, ``early_handoff``, when MD's KV has left P, its ids then crossing beside the KV's last
  bytes); MD extends (once the KV is in) and decodes; tokens from MD reach the gateway half an
  RTT later.

Files: :mod:`pdd.sim.sim_config` (:class:`SimConfig`), :mod:`pdd.sim.prefix_cache`,
:mod:`pdd.sim.request` (:class:`Req`, :class:`Seq`), :mod:`pdd.sim.links` (:class:`Line`,
:class:`Flow`), :mod:`pdd.sim.instance` (:class:`Instance`); this module wires them into
:class:`ClusterSim` (tiers, routing, each request's life through its pipeline) and re-exports them.
"""

from __future__ import annotations

from array import array
from dataclasses import asdict
from typing import Callable

import simpy

import pdd.policy.cutoff as pol_cutoff
import pdd.policy.handoff as pol_handoff
import pdd.policy.pipeline as pol_pipeline
import pdd.policy.routing as pol_routing
import pdd.policy.siblings as pol_siblings
import pdd.policy.tcp_model as tcp_model
import pdd.policy.wan_estimate as pol_west
import pdd.policy.wan_order as pol_wan
from pdd.policy.prefix_index import PrefixIndex
from pdd.policy.wan_estimate import WanEstimate, queued_bytes
from pdd.sim.hardware import StepCostModel, cost_model
# the pieces of the simulator, one job each, all still importable from here
from pdd.sim.instance import Instance, load_maker  # noqa: F401
from pdd.sim.links import Flow, Line, _noop  # noqa: F401
from pdd.sim.prefix_cache import PrefixCache  # noqa: F401
from pdd.sim.request import Req, RequestTooLarge, Seq  # noqa: F401
from pdd.sim.sim_config import BLOCK, SimConfig  # noqa: F401
from pdd.transfer.kv import layer_groups
from pdd.types import Pipeline


class ClusterSim:
    def __init__(self, cfg: SimConfig):
        self.cfg = cfg
        self.env = simpy.Environment()
        self.model = cfg.model_profile()
        self.block = cfg.block_tokens
        # the top-level KV page (an instance's own: Instance.page, from cfg.engine_of): P's cache
        # hit is whole pages, the last one computed
        self.page = cfg.page_tokens or cfg.block_tokens
        self.owd = cfg.wan_rtt_ms / 2000.0
        # MD's messages to the gateway (its reservation reply, kv_ready, tokens): the line's
        # one-way delay plus the software share of the round trip the gateway measures (its RTT
        # estimate less the line's RTT: MD's send, the link emulator, the gateway's receive), so
        # the plan that waits for the reply, the early handoff's wait for it, the handoff after
        # kv_ready and MD's tokens come when the runtime's do (live, MD's first token reaches the
        # gateway 3.0-3.6 ms after the line's delay; docs/SIM.md "P -> MD requests"). No
        # estimate: the line's
        self.md_owd = self.owd + max(0.0, (cfg.wan_rtt_estimate_ms - cfg.wan_rtt_ms) / 1000.0) \
            if cfg.wan_rtt_estimate_ms is not None else self.owd
        self.tiers: dict[str, list[Instance]] = {}
        eff = cfg.efficiency
        models: dict = {}  # (chip side, profile) -> step model, shared by the instances that run it

        def step_model(side: str, prof):
            if (side, prof) not in models:
                chip = cfg.chip(side)
                cm = cost_model(chip, self.model, profile=prof)
                if eff is not None and prof is None:
                    cm = StepCostModel(chip, self.model, None, eff)
                models[side, prof] = cm
            return models[side, prof]

        for role, (n, side) in cfg.tiers().items():
            prof = cfg.profile_a if side == "a" else cfg.profile_b
            cache = (role in ("P", "C") and cfg.p_cache) or (role == "MD" and cfg.drc)
            frac = cfg.md_cache_frac if role == "MD" else cfg.p_cache_frac
            # an instance's step model: its tier's own profile (tier_engines), else its chip side's
            names = [f"{role}{i}" for i in range(n)]
            self.tiers[role] = [Instance(self, name, role, step_model(side, cfg.engine_of(name).profile or prof),
                                         cache, frac) for name in names]
            if n <= 0:
                raise ValueError(f"{role} needs at least one instance")
        # the WAN line as the runtime's emulator models it (pdd.policy.tcp_model): one flow's rate
        # capped by the loss (Mathis), the line's rate less the cross traffic
        self.wan_conn_gbps = tcp_model.mathis_gbps(cfg.wan_mss_bytes, cfg.wan_rtt_ms, cfg.wan_loss_rate)
        express = pol_wan.express_max_bytes(cfg.wan_gbps, cfg.wan_rtt_ms, cfg.wan_express_lane_bdp) \
            if cfg.wan_express_lane_bdp > 0 else 0
        self.wan = Line(self, "wan", cfg.wan_gbps, self.owd, cfg.wan_order, self.wan_conn_gbps,
                        cfg.wan_cross_traffic, express) if cfg.cross_dc() else None
        fast = cfg.fast_gbps or cfg.chip("a").nic_gbps * self.model.gpus_per_instance
        self.fast = {p.name: Line(self, f"fast-{p.name}", fast, cfg.fast_rtt_ms / 2000.0, "ps")
                     for p in self.tiers.get("P", [])}
        self.reqs: list[Req] = []
        self.rr = 0
        self.order = 0
        self.itl_v = array("d")
        self.itl_n = array("d")
        self.pipelines: dict[str, int] = {}
        self.handoffs: dict[str, int] = {}
        self.cutoffs = 0
        self.late_cutoffs = 0  # of them, let through when RLD finished, cut off on MD's later progress report
        self.wan_saved_bytes = 0.0
        self.md_predicted_sends = 0  # relayed requests whose MD send started from the prediction
        self.md_predicted_short = 0  # ... whose MD matched less by the time the reservation reached it
        # the gateway's prefix index of each MD across the WAN (md_prefix_index), keyed by page as
        # the runtime's (one key a page: trace hash id and page within the block), at MD's pool
        self.md_index: dict[str, PrefixIndex] = {}
        if cfg.md_prefix_index and self.wan is not None:
            self.md_index = {md.name: PrefixIndex(md.page, max(1, md.pool // md.page))
                             for md in self.tiers.get("MD", [])}
        # per MD, page key -> the request last routed there with that page (md_wait_claims)
        self.md_claimer: dict[str, dict] = {name: {} for name in self.md_index}
        self.early_handoffs = 0  # handoffs started before MD's kv_ready was back (early_handoff)
        self.decode_tokens = {"RLD": 0, "MD": 0, "D": 0, "C": 0, "P": 0}
        self.decisions: list[tuple[int, str]] = []  # (rid, pipeline) for tests
        # MD's receive rates, as the gateway holds them (capped at the configured loss's TCP rate)
        self.wan_estimate = WanEstimate.for_line(cfg.wan_gbps, cfg.wan_rtt_ms, cfg.wan_loss_rate, cfg.wan_mss_bytes)
        g = self.wan_estimate.gbps
        self.wan_gbps_configured = cfg.wan_gbps if g is None else g  # PeerWanEstimates.configured_gbps
        # layer-wise streaming (policy.kv_stream: layerwise): the layer groups (pdd.transfer.kv.layer_groups)
        # and, per request whose prefill P admitted, the prompt tokens each group's KV holds
        self.layerwise = cfg.kv_stream == "layerwise"
        self.layer_groups = layer_groups(self.model.layers, cfg.kv_stream_layer_group) if self.layerwise else []
        self.kv_ready: dict[int, list[int]] = {}
        self.kv_dispatched: set[int] = set()  # requests whose sends P set up before its prefill ended
        self.wan_gbps_live: float | None = None  # its current value (gateway's estimate)
        self.host_busy = 0  # instances in a step now (for host_cores)
        self.host_prefilling = 0  # P instances in a step now (for decode_interference)
        # roles whose factor is 1 are left out: no pokes, so such a profile simulates as one without it
        self.interference = {r: f for r, f in (cfg.decode_interference or {}).items() if f != 1.0} \
            if cfg.host_cores > 0 else {}
        # P's step while decoders run (prefill_interference): 1 = off, nothing tracked
        self.p_interference = float(cfg.prefill_interference) if cfg.host_cores > 0 else 1.0
        self.host_decoding = 0  # decoding instances (not P) in a step now, tracked when it is on
        self.wan_planned: dict[int, Req] = {}  # WAN transfers planned to an MD, not yet delivered
        self.record_decisions = False  # keep each policy call's inputs and result per request
        self.decision_log: dict[int, list[dict]] = {}
        self.autoscaler = None  # pdd.sim.autoscale.SimAutoscaler: routes to its active instances only
        self.stalled: str | None = None  # after run: why requests were left unfinished (run's docstring)

    def host_share(self) -> float:
        """Slow-down of a step starting now when every instance shares ``cfg.host_cores`` CPU
        cores (the live single-machine topology): ``max(1, busy instances incl. this / cores)``,
        fixed for the step; 1 when ``host_cores`` is 0 (one accelerator per instance)."""
        c = self.cfg.host_cores
        return max(1.0, (self.host_busy + 1) / c) if c > 0 else 1.0

    def decode_slowdown(self, role: str) -> float:
        """Factor on a decode step of ``role`` starting now: its ``cfg.decode_interference`` while
        a P instance on the shared host runs a prefill step, else 1."""
        return self.interference.get(role, 1.0) if self.host_prefilling else 1.0

    def prefill_slowdown(self) -> float:
        """Factor on P's prefill step now: ``cfg.prefill_interference`` while a decoding instance
        on the shared host is in a step, else 1."""
        return self.p_interference if self.host_decoding else 1.0

    def decode_step(self, delta: int) -> None:
        """A decoding instance starts (``delta`` +1) or ends (-1) a step; with prefill
        interference on, P instances in a prefill step re-time its rest when the host's decoders
        go from none to some or back."""
        was = self.host_decoding
        self.host_decoding += delta
        if (was == 0) != (self.host_decoding == 0):
            for i in self.tiers.get("P", ()):
                i.retime()

    def prefill_step(self, inst: "Instance", delta: int) -> None:
        """``inst`` (a P instance) starts (``delta`` +1) or ends (-1) a prefill step; with decode
        interference on, the other instances of the roles it slows re-time the decode step they
        are in (each finishes its current step at the old pace, the next at the new)."""
        self.host_prefilling += delta
        for role in self.interference:
            for i in self.tiers.get(role, ()):
                if i is not inst:
                    i.poke()

    # --- the gateway's live WAN estimate (pdd.gateway.orchestrator semantics) ----------------------
    WAN_SAMPLE_MIN_BYTES = 256 * 1024  # roles.base.kv_rate_sample_gbps: smaller ones measure the RTT

    def wan_gbps_estimate(self) -> float:
        """The WAN rate the policies read: the live estimate once MD has reported a sample (as the
        gateway's ``wan_gbps_live or link.wan_gbps``), else the configured line rate."""
        if self.cfg.wan_estimate == "live" and self.wan_gbps_live is not None:
            return self.wan_gbps_live
        return self.wan_gbps_configured

    def _wan_sample(self, f: "Flow") -> None:
        """MD's receive rate of one request's KV (first frame to last: time queued behind other
        flows before its first byte is not counted, as MD cannot see it), folded into the estimate
        (``policy.wan_estimate``, as the gateway does)."""
        if f is None or f.total < self.WAN_SAMPLE_MIN_BYTES or f.t_end is None:
            return
        # less the time a layer-wise stream waited for the prefill (the runtime's kv_done kv_wait_s)
        dt = f.t_end - (f.t_served if f.t_served is not None else f.t_start) - f.wait_s
        if dt <= 0:
            return
        self.wan_gbps_live = self.wan_estimate.add(f.total * 8 / dt / 1e9)

    def remaining_wan_s(self, req: "Req") -> float:
        """The gateway's ``_remaining_wan_s``: the planned WAN bytes at the estimated rate, less
        the time since P finished prefill (when it starts streaming), at least 0."""
        elapsed = self.env.now - req.t_prefill_done if req.t_prefill_done is not None else 0.0
        return pol_handoff.early_handoff_delay_s(req.md_missing * self._wan_kvb(req),
                                                 self.wan_gbps_estimate(), elapsed)

    # --- MD's progress reports of a relayed request's KV (the runtime's kv_progress) -------------
    def _md_kv_bytes(self, req: "Req", t: float) -> float:
        """Payload bytes of ``req``'s KV (its send and fill) that had left P on the line by line
        time ``t``: MD has them one line delay later."""
        b = self.wan.sent_at(req.wan_flow, t)
        f = req.fill_flow
        if f is not None and f.hist_t is not None:
            b += self.wan.sent_at(f, t)
        return b

    def md_progress(self, req: "Req") -> "tuple[float, float, float] | None":
        """MD's last ``kv_progress`` of ``req``'s WAN transfer that has reached the gateway by now:
        (when it reached the gateway, payload bytes MD had, their rate lately in Gbit/s), or None
        (none yet, or the transfer is not tracked: not relayed, or ``cutoff`` off). Every report:
        :meth:`md_reports`."""
        reps = self._md_walk(req)[0]
        return reps[-1] if reps else None

    def md_reports(self, req: "Req") -> "list[tuple[float, float, float]]":
        """Every ``kv_progress`` of ``req``'s WAN transfer that has reached the gateway by now, in
        order: (when it reached the gateway, payload bytes MD had, their rate since the previous
        one in Gbit/s).

        As the runtime's MD (``roles.base.EngineInstance.kv_progress``, the same
        ``policy.wan_estimate.progress_report``): the first frame's arrival is the first mark, and
        MD reports with the first frame that arrives ``KV_PROGRESS_INTERVAL_S`` or more after the
        mark, the bytes it has at the rate since the mark; that report is the next mark. On a line
        that keeps sending the transfer it is the interval after the mark; after a stall (the
        line served other flows, or P had not computed the rest) the frame that ends it, as
        live, not the next point of a grid from the first frame. A frame leaves at a time the
        simulated line sends bytes of it (:meth:`Line.next_sent_s`), MD has it one line delay
        later, and the report reaches the gateway :attr:`md_owd` after that. Reports end with
        the transfer."""
        return self._md_walk(req)[0]

    def _md_walk(self, req: "Req") -> "tuple[list[tuple[float, float, float]], float | None]":
        """(MD's reports of ``req``'s transfer that reached the gateway by now (:meth:`md_reports`),
        the line time from which the next one is due: the mark plus an interval; None when none
        comes: not tracked, no frame sent yet, or the transfer over)."""
        f = req.wan_flow
        if f is None or f.hist_t is None:
            return [], None
        line = self.wan
        first = line.first_sent_s(f)
        if first is None:
            return [], None
        end = self._progress_end(req)
        lag = line.owd + self.md_owd  # the line's send time of a byte -> MD's report of it at the gateway
        until = self.env.now - lag + 1e-9  # a report due now counts (the clock's rounding)
        interval = pol_west.KV_PROGRESS_INTERVAL_S
        mark_b = 0.0  # bytes at the mark
        due = first + interval  # the mark plus an interval: a frame from then on reports
        since = interval  # seconds from the mark to ``due`` (exact, not due - mark rounded)
        out = []
        while True:
            if end is not None and due > end:
                return out, None
            if due > until:
                return out, due
            t = self._md_next_frame(req, due)
            if t is None or t > until:
                return out, due
            if end is not None and t > end:
                return out, None
            b = self._md_kv_bytes(req, t)
            rep = pol_west.progress_report(0.0, mark_b, since + (t - due), b, interval)
            if rep is None:  # no byte since the mark yet (it stalled there): the next frame brings some
                nxt = self._md_next_frame(req, t + 1e-9)
                if nxt is None:
                    return out, due
                since += nxt - due
                due = nxt
                continue
            out.append((t + lag, rep[0], rep[1]))
            mark_b, due, since = b, t + interval, interval

    def _md_next_frame(self, req: "Req", t: float) -> "float | None":
        """The first line time at or after ``t`` at which a byte of ``req``'s tracked WAN sends
        (its send and fill) leaves, up to now; None if none does."""
        got = [x for x in (self.wan.next_sent_s(g, t) for g in (req.wan_flow, req.fill_flow)
                           if g is not None and g.hist_t is not None) if x is not None]
        return min(got) if got else None

    def _progress_end(self, req: "Req") -> "float | None":
        """When the last of ``req``'s tracked sends left the line (MD's reports end there), or None
        while one is still on it."""
        flows = [x for x in (req.wan_flow, req.fill_flow) if x is not None and x.hist_t is not None]
        return max(x.t_end for x in flows) if all(x.t_end is not None for x in flows) else None

    def cutoff_remaining_wan_s(self, req: "Req") -> float:
        """Seconds left of ``req``'s WAN transfer as the gateway's cut-off reads them
        (``gateway.wan_booking._cutoff_remaining_wan_s``): from MD's last progress report
        (:meth:`md_progress`) the bytes left at the transfer's own rate less the report's age up
        to one report interval (``policy.wan_estimate.inflight_remaining_s``); before MD's first
        report, :meth:`remaining_wan_s` (the estimate of finished transfers)."""
        return self._cutoff_inputs(req)[0]

    def _cutoff_inputs(self, req: "Req") -> "tuple[float, float]":
        """(:meth:`cutoff_remaining_wan_s`, the share of the planned bytes MD last reported
        received: 0 before its first report), from one walk of MD's reports."""
        p = self.md_progress(req)
        if p is None:
            return self.remaining_wan_s(req), 0.0
        at, done, gbps = p
        planned = req.md_missing * self._wan_kvb(req)
        return (pol_west.inflight_remaining_s(planned, done, gbps, self.env.now - at),
                pol_cutoff.sent_fraction(done, planned))

    def _cut_off_due(self, req: "Req") -> bool:
        """Whether RLD having finished ``req`` cuts its WAN transfer off (``policy.cutoff.should_cut_off``
        with MD's KV state and :meth:`cutoff_remaining_wan_s`): when RLD finishes it and, for a
        transfer let through then, on each later progress report (the gateway's ``_cut_off_due``,
        with the share of the bytes MD last reported)."""
        remaining, frac = self._cutoff_inputs(req)
        return pol_cutoff.should_cut_off(True, req.md_kv_complete, remaining,
                                         self.cfg.cutoff_min_remaining_s, frac, self.cfg.cutoff_max_sent_fraction)

    # --- the policy calls (the runtime's functions; recorded live inputs can be fed here) ----------
    def decide_pipeline(self, inp: "pol_pipeline.PipelineInputs") -> Pipeline:
        """The gateway's pipeline decision (``pdd.policy.pipeline.choose_pipeline``)."""
        return pol_pipeline.choose_pipeline(inp)

    def decide_handoff(self, inp: "pol_handoff.HandoffInputs") -> "pol_handoff.HandoffDecision":
        """RLD's handoff decision (``pdd.policy.handoff.decide_handoff``)."""
        return pol_handoff.decide_handoff(inp)

    def _log_decision(self, req: "Req", policy: str, inputs, result) -> None:
        if self.record_decisions:
            self.decision_log.setdefault(req.rid, []).append(
                {"policy": policy, "inputs": asdict(inputs), "result": result})

    # --- helpers -------------------------------------------------------------------------------
    def after(self, delay: float, fn, *args) -> None:
        ev = self.env.timeout(delay)
        ev.callbacks.append(lambda _e: fn(*args))

    def _route(self, role: str, req: Req, with_cache: bool, policy: str | None = None) -> Instance:
        insts = self.tiers[role] if self.autoscaler is None else self.autoscaler.routable(role)
        if len(insts) == 1:
            return insts[0]
        pol = policy or self.cfg.routing
        # inst.load(hit) for every instance, inlined (the simulator's hottest loop: tens of
        # instances per routed request); the same InstanceLoad values the policy reads
        block = self.block
        blocks = req.blocks[: req.n_full] if with_cache else None
        new_load = load_maker()
        loads = []
        md = role == "MD"
        index = self.md_index if md and with_cache else None
        for inst in insts:
            c = inst.cache
            # an MD's requests: the gateway's in-flight count there (routed, not ended), as the
            # runtime's routing reads (its InstanceLoad running, nothing queued); P's, colocated's,
            # RLD's and D's: the sequences, queued admissions and requests routed on their way
            if md:
                running, queued = inst.assigned, 0
            else:
                running, queued = len(inst.seqs), len(inst.waiting) + inst.routed
            if index:  # the gateway's index of each MD stands for its cache (as the runtime routes)
                # a claim (KV still on its way) counts: the reservation waits for it (md_wait_claims)
                hit = index[inst.name].match_keys(self._page_keys(req, inst.page)) * inst.page
                # pages MD cannot free to admit: its private ones and locked cache blocks. Its
                # evictable cache is not used (the runtime passes routing no page counts), else an
                # MD whose cache had filled its pool dropped out of routing ("full") and the turns
                # it holds went cold to another MD, the whole prompt again over the WAN
                used = inst.private + (len(c.locks) * block if c is not None else 0)
                loads.append(new_load(inst.name, running, queued, used, inst.pool, hit))
            elif c is None:
                loads.append(new_load(inst.name, running, queued, inst.private, inst.pool, 0))
            else:
                lru = c.lru
                hit = 0
                if blocks is not None:
                    for b in blocks:
                        if b not in lru:
                            break
                        hit += 1
                    hit *= block
                loads.append(new_load(inst.name, running, queued, inst.private + len(lru) * block, inst.pool, hit))
        i = pol_routing.choose_instance(loads, pol, self.rr, self.cfg.md_load_slack if md else self.cfg.load_slack,
                                        prompt_tokens=req.prompt, min_hit_frac=self.cfg.min_hit_frac,
                                        load_cap=self.cfg.md_load_cap if md else 0)
        self.rr += 1
        return insts[i]

    def _next_order(self) -> int:
        self.order += 1
        return self.order

    # --- run -----------------------------------------------------------------------------------
    def run(self, records, until: float | None = None) -> "ClusterSim":
        """Simulate ``records`` (Mooncake format). Raises :class:`RequestTooLarge` (a ValueError)
        naming the first request whose KV can never fit one instance's pool (it would wait
        forever, as the engine refuses it), before simulating anything. A run whose KV
        admissions come to wait on each other ends with those requests unfinished:
        :attr:`stalled` then says so (else None)."""
        self.reqs = [Req(i, r, self.block) for i, r in enumerate(records)]
        # a tier's smallest pool (instances may have their own): routing may pick that instance
        pools = {role: min(i.pool for i in insts) for role, insts in self.tiers.items()}
        for r in self.reqs:
            for role, pool in pools.items():
                need = r.prompt + (r.out_len if role != "P" else 0)
                if need > pool:
                    out = max(q.out_len for q in self.reqs)  # the cap that fits every request
                    fit = min(pl - (out if ro != "P" else 0) for ro, pl in pools.items())
                    raise RequestTooLarge(r.rid, role, r.prompt, r.out_len, pool, fit)
        self.env.process(self._arrivals())
        if self.autoscaler is not None:
            self.env.process(self.autoscaler.run())
        self.env.run(until=until)
        if until is None:
            self.stalled = self._stall()
        return self

    def _stall(self) -> str | None:
        """One line on a run that ended with requests unfinished, else None: nothing left to
        happen, each waits for KV pages (or a decode slot) another one holds. E.g. P's pool held
        by prefills whose sends wait for MD's admission, MD's by reservations whose prefills
        wait for P's pool: the simulated tiers queue an admission that does not fit, where the
        live engine refuses it (``OutOfPages``)."""
        left = sum(1 for r in self.reqs if not r.finished)
        if not left:
            return None
        queued = ", ".join(f"{i.name} ({i.used:,} of {i.pool:,} tokens held, {len(i.waiting)} queued)"
                           for insts in self.tiers.values() for i in insts if i.waiting)
        return (f"the simulation stalled at {self.env.now:.6g} s with {left} of {len(self.reqs)} requests unfinished, "
                f"their KV admissions waiting on each other: {queued or 'none queued'}; the live engine would refuse "
                f"them (OutOfPages): give the tiers larger KV pools or a lower load")

    def _arrivals(self):
        env = self.env
        for req in sorted(self.reqs, key=lambda r: r.arrival):
            if req.arrival > env.now:
                yield env.timeout(req.arrival - env.now)
            self._on_arrival(req)

    # --- request life --------------------------------------------------------------------------
    def _to_p(self, p: Instance, req: Req) -> None:
        """``req`` goes to P (the gateway's dispatch: ``cfg.p_dispatch_s`` later; at once when 0)."""
        d = self.cfg.p_dispatch_s
        if d > 0:
            self.after(d, self._start_prefill, p, req)
        else:
            self._start_prefill(p, req)

    def _on_arrival(self, req: Req) -> None:
        mode = self.cfg.mode
        if mode == "colocated":
            c = self._route("C", req, True)
            req.pipeline = Pipeline.COLOCATED
            self._count_pipeline(req)
            self._start_prefill(c, req, colocated=True)
            return
        p = self._route("P", req, True)
        req.p = p
        p.routed += 1
        if mode == "same_dc_pd":
            req.pipeline = Pipeline.P_D
            self._count_pipeline(req)
            self._to_p(p, req)
            return
        # cross-DC: P prefills at once while MD is asked to reserve (a WAN round trip); the plan
        # follows MD's reply, and P's sends wait for it (the runtime's deferred targets). The relay
        # is planned at once with a zero TTFT budget (MD's cache state cannot change it), and with
        # a non-zero one when the gateway's index of MD says the missing KV does not fit it.
        md = self._route("MD", req, True)
        req.md = md
        md.assigned += 1  # counted against MD's load from now until the request ends (the gateway's _assign)
        req.md_counted = md
        ix = self.md_index.get(md.name)
        if ix is not None:  # the runtime's _record_route: what the index held, then the prompt recorded
            keys = list(self._page_keys(req, md.page))
            if self.cfg.md_wait_claims:
                held, landed = ix.match_landed_keys(keys)
                req.md_landed = landed * md.page
                claimer = self.md_claimer[md.name]
                if landed < held:  # the prefix ends in a claim: whose KV, still coming, brings its last page
                    req.md_after = claimer.get(keys[held - 1])
                    req.md_after = self._claim_pending(req)  # None unless that KV is still coming
                for k in keys:
                    claimer[k] = req
            req.md_held = ix.record_keys(keys) * md.page
        if self._always_relay(req):
            self._decide(req)
            predict = self.cfg.md_predicted_send and req.pipeline == Pipeline.P_RLD_MD
        else:  # a non-zero budget the index says the KV misses: relayed at once
            predict = self._relays_by_index(req) and self.cfg.md_predicted_send
        # a reservation that waits for a claim (md_wait_claims) is not a predicted send, as the
        # gateway's (its frames would wait at MD for as long as the claim)
        if req.md_after is not None and self._wait_for_claim(req):
            predict = False
        if predict:
            self._predict_md(req)
        self._to_p(p, req)
        self.after(self.owd, self._md_reserve, req)

    def _always_relay(self, req: Req) -> bool:
        """As the runtime (policy.pipeline.relays_every_request): pdd with a zero budget relays
        every request."""
        cfg = self.cfg
        return pol_pipeline.relays_every_request(cfg.mode, cfg.ttft_budget_ms, self._allow_p_rld(req))

    def _relays_by_index(self, req: Req) -> bool:
        """As the runtime (policy.pipeline.plans_from_index, ``gateway.launch``): with a non-zero
        budget the gateway plans on its prefix index of MD (here MD's cache match at arrival) and
        relays at once what does not fit (the decision, made here); what fits waits for MD's
        reservation, which re-plans (this prediction is not a decision)."""
        cfg = self.cfg
        if not pol_pipeline.plans_from_index(cfg.mode, cfg.ttft_budget_ms, self._allow_p_rld(req), False):
            return False
        req.md_hit = self._md_known(req)
        if req.md_after is not None:  # a prefix still coming is not there yet: the landed part is judged
            req.md_hit = req.md_landed
        inp = self._pipeline_inputs(req)
        if self.decide_pipeline(inp) != Pipeline.P_RLD_MD:
            return False
        self._decided(req, inp, Pipeline.P_RLD_MD)
        return True

    def _page_keys(self, req: Req, page: int, out_tokens: int = 0):
        """The keys of ``req``'s whole ``page``-token pages (its MD's page: ``Instance.page``) in
        the gateway's index (``PrefixIndex.match_keys``): the pages of the prompt's whole trace
        blocks, (hash id, page within the block), as MD's
        simulated cache holds whole blocks; then, with ``out_tokens`` output tokens after the
        prompt, a key of this request's own for each further page (the prompt's last part-block
        and the outputs: as the runtime's index, they take room; no later prompt matches them)."""
        ppb = self.block // page
        blocks = req.blocks
        n = min(req.n_full, len(blocks)) * ppb  # a trace may name fewer blocks than its length fills
        for i in range(n):
            yield blocks[i // ppb], i % ppb
        for j in range(n, (req.prompt + out_tokens) // page):
            yield "out", req.rid, j

    def _md_known(self, req: Req) -> int:
        """The prompt tokens the gateway reckons ``req``'s MD holds when it plans: its index's
        (``md_prefix_index``), else MD's cache match."""
        return req.md_held if req.md_held is not None else self._md_match(req)

    def _claim_pending(self, req: Req) -> "Req | None":
        """The request whose claim ``req`` waits for at MD (``md_wait_claims``): ``req.md_after``
        while its KV is still on its way to ``req``'s MD (not imported there, not cut off), else
        None (MD's ``reserve {after}``: it waits until that KV is in, or gone)."""
        w = req.md_after
        if w is None or w.md is not req.md or w.md_kv_complete or w.cut_off:
            return None
        return w

    def _wait_for_claim(self, req: Req) -> bool:
        """Whether ``req``'s reservation waits for the claim its prefix ends in (the gateway's
        choice when it sends the reservation, ``gateway.launch``): when the claim is still
        pending, worth a wait rather than a copy (``policy.siblings.claim_waits_for_kv``: the
        claimed pages' line time exceeds a round trip), and either ``req`` was relayed at arrival
        (RLD serves its first token, so its TTFT never waits for MD's reply) or the claim's
        transfer is already on the line (its KV lands no later than a copy sent now would: the
        copy queues behind or beside it). A claim whose
        transfer has not started (its prefill or its MD admission still queued) is not waited
        for by a request whose plan waits for MD's reply: it ships those pages itself. Clears
        ``req.md_after`` when not."""
        w = self._claim_pending(req)
        if w is not None and (req.pipeline == Pipeline.P_RLD_MD or w.wan_flow is not None):
            claimed = (req.md_held - req.md_landed) * self._wan_kvb(req)
            cfg = self.cfg
            rtt = cfg.wan_rtt_ms if cfg.wan_rtt_estimate_ms is None else cfg.wan_rtt_estimate_ms
            if pol_siblings.claim_waits_for_kv(claimed, self.wan_gbps_estimate(), rtt):
                return True
        req.md_after = None
        return False
    def _kv_settled(self, req: Req) -> None:
        """``req``'s KV is in its MD's cache, or will not come: the reservations waiting for it
        (``md_wait_claims``) go on now."""
        waiters, req.kv_waiters = req.kv_waiters, []
        for w in waiters:
            self._md_reserve(w)

    def _md_match(self, req: Req) -> int:
        """Tokens of ``req``'s prompt MD's cache holds now, in whole blocks: a prompt held whole
        counts whole, as MD's reservation matches it (MD computes none of the prompt: P sends its
        first token with the KV)."""
        md = req.md
        if md.cache is None:
            return 0
        return md.cache.match(req.blocks[: req.n_full]) * self.block

    def _predict_md(self, req: Req) -> None:
        """Predicted MD send (``policy.md_predicted_send``, ``gateway.launch``: ``route_and_reserve``): a
        request relayed at once sends MD the pages the gateway's prefix index says MD lacks as
        soon as P's prefill is done, without waiting for MD's reservation round trip.

        The prediction is made at arrival (when the runtime routes and predicts): ``md_hit`` =
        what the gateway's index of that MD held (``md_prefix_index``; else MD's cache match
        then). MD caps its reservation's match at the predicted page, so a longer match one
        one-way delay later changes nothing: the index forgot a prefix MD still holds, and P
        sends it again, as the runtime does. A shorter one (the index holds a prompt whose KV is
        still on the line, or was cut off with ``md_index_drops_cut_offs`` False, or MD evicted
        it) is the runtime's fill (``md_fill``):
        P sends MD's missing pages too, counted in ``md_predicted_short``; modelled as part of
        the one send, so only while that send has not started when the reservation reaches MD
        (a layer-wise send can start earlier: its fill is not modelled)."""
        req.md_predicted = True
        req.md_hit = self._md_known(req)
        req.md_missing = req.prompt - req.md_hit
        if req.md_missing > 0 and self.cfg.wan_backlog_in_plan:
            self.wan_planned[req.rid] = req
        self.md_predicted_sends += 1

    def _md_reserve(self, req: Req) -> None:
        """At MD: match DRC, answer the gateway; the lock + allocation are queued at MD (at the
        reply's arrival at the gateway, when the send waits for it; at once with a predicted
        send, whose KV MD holds until it has admitted the request, as ``roles.early_frames``).
        With ``md_wait_claims``, a reservation whose prefix ends in another request's claim
        on this MD waits here until that KV is in MD's cache or will not come
        (:meth:`_claim_pending`), then matches."""
        w = self._claim_pending(req)
        if w is not None:
            w.kv_waiters.append(req)
            return
        cached = self._md_match(req)
        if req.md_predicted:
            if cached < req.md_hit:
                self.md_predicted_short += 1
                if req.md_held is not None:
                    # MD lacks pages the index said it held: P sends them too (the runtime's fill,
                    # a second send once MD's reply is back at the gateway; in the one send when
                    # that has not started yet)
                    fill = req.md_hit - cached
                    req.md_hit = cached
                    if req.wan_flow is not None:
                        req.fill_pending = True
                        self.after(self.md_owd, self._send_fill, req, fill)
            self._md_enqueue(req, self.md_owd)
            return
        req.md_hit = cached
        self.after(self.md_owd, self._plan, req)

    def _plan(self, req: Req) -> None:
        """MD's reservation reply is back at the gateway: plan (unless planned at arrival), queue
        MD's admission, and release P's sends if its prefill is already done."""
        planned = req.pipeline is not None
        if not planned:
            self._decide(req)
        if req.pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD):
            self._md_enqueue(req)
        else:
            req.md = None
            self._kv_settled(req)
        if not planned and (req.prefill_done or req.rid in self.kv_ready):
            self._dispatch_kv(req)

    def _wan_kvb(self, req: Req) -> int:
        """Bytes a token of ``req``'s KV carries to its MD (that MD's ``Instance.kvb``: the wire
        format P sends it in); the model's when it has no MD."""
        return req.md.kvb if req.md is not None else self.model.kv_bytes_per_token

    def _fast_kvb(self, req: Req) -> int:
        """Bytes a token of ``req``'s KV carries on P's fast path (to its RLD, or D)."""
        to = req.rld if req.rld is not None else req.d
        return to.kvb if to is not None else self.model.kv_bytes_per_token

    def _allow_p_rld(self, req: Req) -> bool:
        return self.cfg.allow_p_rld and req.arrival >= self.cfg.allow_p_rld_after_s

    def _pipeline_inputs(self, req: Req) -> "pol_pipeline.PipelineInputs":
        """What the gateway knows when it plans ``req`` (MD holding ``req.md_hit`` tokens)."""
        cfg = self.cfg
        return pol_pipeline.PipelineInputs(
            mode=cfg.mode, prompt_tokens=req.prompt, md_cached_tokens=req.md_hit,
            kv_bytes_per_token=self._wan_kvb(req), wan_gbps_estimate=self.wan_gbps_estimate(),
            wan_rtt_ms=cfg.wan_rtt_ms if cfg.wan_rtt_estimate_ms is None else cfg.wan_rtt_estimate_ms,
            ttft_budget_ms=cfg.ttft_budget_ms, allow_p_rld=self._allow_p_rld(req), md_available=True,
            wan_backlog_bytes=self._wan_backlog_bytes(req) if cfg.wan_backlog_in_plan else 0.0)

    def _wan_backlog_bytes(self, req: Req) -> float:
        """The runtime gateway's ``_wan_backlog_bytes`` for ``req``'s MD: the planned bytes of the
        other transfers to it not yet delivered nor cut off, less what the line can have carried
        since the oldest of them finished its prefill (``policy.wan_estimate.queued_bytes``)."""
        now, planned, oldest = self.env.now, [], 0.0
        kvb = self._wan_kvb(req)
        for rid, o in list(self.wan_planned.items()):
            f = o.wan_flow
            if o.cut_off or (f is not None and f.done) or o.finished:
                del self.wan_planned[rid]
                continue
            if o is req or o.md is not req.md:
                continue
            planned.append(o.md_missing * kvb)
            if o.t_prefill_done is not None:
                oldest = max(oldest, now - o.t_prefill_done)
        return queued_bytes(planned, oldest, self.wan_gbps_estimate())

    def _decide(self, req: Req) -> None:
        """The pipeline decision (policy.pipeline, the runtime's function) for ``req``."""
        inp = self._pipeline_inputs(req)
        self._decided(req, inp, self.decide_pipeline(inp))

    def _decided(self, req: Req, inp: "pol_pipeline.PipelineInputs", pl: Pipeline) -> None:
        """Log and apply pipeline ``pl`` for ``req``, chosen on ``inp``."""
        self._log_decision(req, "pipeline", inp, pl.value)
        req.pipeline = pl
        self._count_pipeline(req)
        if pl in (Pipeline.P_RLD_MD, Pipeline.P_RLD):
            req.rld = self._route("RLD", req, False, policy="load")

    def _count_pipeline(self, req: Req) -> None:
        v = req.pipeline.value
        self.pipelines[v] = self.pipelines.get(v, 0) + 1
        self.decisions.append((req.rid, v))

    def _md_enqueue(self, req: Req, reply_owd: float | None = None) -> None:
        """Queue ``req``'s admission at MD; ``reply_owd``: seconds its reservation reply takes from
        MD to the gateway once admitted (a predicted send's: :attr:`md_owd`; else the line's
        one-way delay, admission queued at the gateway's plan)."""
        back = self.owd if reply_owd is None else reply_owd
        md = req.md
        blocks = req.blocks[: req.md_hit // self.block]
        missing = req.prompt - req.md_hit
        req.md_missing = missing
        req.md_queued = True
        if req.cut_off and req.wan_flow is None:  # cut off before the plan: none of it will be sent
            self.wan_saved_bytes += missing * md.kvb
        if missing > 0 and self.cfg.wan_backlog_in_plan:
            self.wan_planned[req.rid] = req

        def admit(n: int):
            if md.cache is not None and blocks:
                md.cache.lock(blocks)
                md.cache.touch(blocks)
            seq = Seq(req, req.prompt + 1, req.prompt, 0, "decode", n, blocks, self.md_owd)
            req.md_seq = seq
            req.md_reserved = True
            req.t_md_replied = self.env.now + back
            if req.early_pending:  # the early handoff waited for this reply
                req.early_pending = False
                self.after(back, self._early_handoff, req)
            if req.cut_off:
                self._md_release(req, cache=False)
                return
            if req.wan_landed:  # a predicted send's KV arrived first: MD imports the held frames
                self._kv_imported(req)
                return
            self._maybe_send_wan(req)

        md.enqueue(missing + req.out_len, admit, slot=True)

    def _start_prefill(self, inst: Instance, req: Req, colocated: bool = False) -> None:
        if not colocated:
            inst.routed -= 1
        full = req.blocks[: req.n_full]
        extra = req.out_len if colocated else 0

        def need() -> int:  # matched at admission time: the cache may change while waiting
            k = inst.cache.match(full) if inst.cache is not None else 0
            req.p_hit = min(k * self.block, (req.prompt - 1) // inst.page * inst.page)
            return req.prompt - req.p_hit + extra

        def admit(n: int):
            locked = full[: -(-req.p_hit // self.block)]  # a block the hit ends inside is read too
            if inst.cache is not None and locked:
                inst.cache.lock(locked)
                inst.cache.touch(locked)
            seq = Seq(req, req.prompt, req.p_hit, self._next_order(), "coloc" if colocated else "prefill",
                      n, locked, 0.0)
            inst.add(seq)
            if self.layerwise and not colocated:
                # the cached prefix holds every layer; P's sends start now when the plan is known
                self.kv_ready[req.rid] = [req.p_hit] * len(self.layer_groups)
                if req.pipeline is not None:
                    self._dispatch_kv(req)

        inst.enqueue(need, admit, prefill=True)

    # --- token events from instances --------------------------------------------------------------
    def on_tokens(self, inst: Instance, s: Seq, t_first: float, n: int, dt: float) -> None:
        req = s.req
        role = inst.role
        if s.kind == "prefill":
            # P sampled the first token at the end of prefill
            req.generated = 1
            inst.remove(req.rid)
            lag = self.cfg.p_reply_lag_s_per_token
            if lag > 0.0 and inst.role == "P":  # the reply trails the step; P's engine is free
                self.after(lag * inst.step_reply_tokens, self._prefill_done, inst, req, s)
            else:
                self._prefill_done(inst, req, s)
            return
        req.generated += n
        self.decode_tokens[role] = self.decode_tokens.get(role, 0) + n
        if role == "RLD":
            req.rld_tokens += n
        elif role == "MD":
            req.md_tokens += n
        self._emit(req, t_first, n, dt)
        if req.generated >= req.out_len:
            self._finish_on(inst, req, s)

    def _emit(self, req: Req, t: float, n: int, dt: float) -> None:
        t += self.cfg.client_delay_s
        if req.t_first is None:
            req.t_first = t
            req.t_last = t + (n - 1) * dt
            req.n_emitted = n
            if n > 1:
                self.itl_v.append(dt)
                self.itl_n.append(n - 1)
            return
        gap = t - req.t_last
        if gap > req.max_gap:
            req.max_gap = gap
        self.itl_v.append(gap)
        self.itl_n.append(1)
        if n > 1:
            self.itl_v.append(dt)
            self.itl_n.append(n - 1)
        req.t_last = t + (n - 1) * dt
        req.n_emitted += n

    def _prefill_done(self, p: Instance, req: Req, s: Seq) -> None:
        now = self.env.now
        req.prefill_done = True
        req.t_prefill_done = now
        if s.kind == "coloc":
            return
        # P caches the prompt's whole blocks, keeps them locked until its sends drain
        full = req.blocks[: req.n_full]
        if p.cache is not None:
            if s.locked:
                p.cache.unlock(s.locked)
            p.free(s.reserved)
            partial = req.prompt - req.n_full * self.block
            p.private += partial  # the partial last page stays private until sends drain
            p.cache.insert(full)
            p.cache.lock(full)
            req.p_locked = (full, partial)
            over = p.used - p.pool
            if over > 0:
                p.cache.evict(-(-over // self.block))
        else:
            req.p_locked = ((), s.reserved)
        if self.layerwise:
            self._kv_sealed(req)
        if req.at_seal is not None:  # sends whose bytes all left before the seal (P's reply lag)
            waiting, req.at_seal = req.at_seal, None
            for fn in waiting:
                fn()
        if req.rid in self.kv_dispatched:  # layer-wise: the sends started during the prefill
            self.kv_dispatched.discard(req.rid)
            if req.pipeline in (Pipeline.P_MD, Pipeline.P_RLD_MD):
                self._maybe_send_wan(req)  # an empty send waits for the prefill's end (its kv_done)
            if req.p_pending_flows == 0:
                self._p_release(req)
        elif req.pipeline is not None:  # else the plan (MD's reservation reply) dispatches
            self._dispatch_kv(req)

    # --- layer-wise streaming (policy.kv_stream: layerwise; pdd.transfer.kv.LayeredTransfer) ------
    def on_prefill_chunk(self, req: Req, end: int, dt: float) -> None:
        """P's step of ``dt`` seconds computes ``req``'s prompt up to token ``end``: layer group
        ``[l0, l1)`` of it is written ``dt * l1 / layers`` after the step starts (the step's time
        spread evenly over the model's layers, as the engine's forward pass runs them in turn)."""
        n = self.model.layers
        end = min(end, req.prompt)
        for g, (_l0, l1) in enumerate(self.layer_groups):
            self.after(dt * l1 / n, self._layers_ready, req, g, end)

    def _held(self, req: Req, lo: int, total: float, kvb: int) -> float:
        """Bytes of a send of the prompt's tokens ``[lo, prompt)`` (``total`` bytes, ``kvb`` a
        token) whose KV P has not computed yet: 0 unless layer-wise and the prefill is running."""
        if not self.layerwise or req.prefill_done or total <= 0:
            return 0.0
        ready = self.kv_ready.get(req.rid)
        if ready is None:
            return float(total)
        if min(ready) >= req.prompt:
            return 0.0
        rel = sum(max(0, min(r, req.prompt) - lo) * (l1 - l0) for r, (l0, l1) in zip(ready, self.layer_groups))
        return max(0.0, total - rel * kvb / self.model.layers)

    def _layers_ready(self, req: Req, g: int, end: int) -> None:
        ready = self.kv_ready.get(req.rid)
        if ready is None or end <= ready[g]:
            return
        ready[g] = end
        self._release_flows(req)

    def _release_flows(self, req: Req) -> None:
        for f, lo, kvb in ((req.fast_flow, 0, self._fast_kvb), (req.wan_flow, req.prompt - req.md_missing,
                                                                 self._wan_kvb)):
            if f is not None and not f.done and f.held > 0:
                f.line.release(f, self._held(req, lo, f.total, kvb(req)))

    def _kv_sealed(self, req: Req) -> None:
        """P's prefill is done: every layer of the prompt is written (the runtime's seal)."""
        self.kv_ready.pop(req.rid, None)
        self._release_flows(req)

    def _dispatch_kv(self, req: Req) -> None:
        """P's KV sends once both its prefill and the plan are done (each exactly once)."""
        p = req.p
        pl = req.pipeline
        if not req.prefill_done:
            self.kv_dispatched.add(req.rid)
        if pl == Pipeline.P_D:
            req.d = d = self._route("D", req, False, policy="load")
            req.p_pending_flows = 1
            total_d = req.prompt * d.kvb  # in D's wire format

            def admit_d(_n):
                seq = Seq(req, req.prompt + 1, req.prompt, 0, "decode", req.prompt + req.out_len)
                line = self.fast[p.name]
                req.fast_flow = line.send(req.rid, total_d, lambda: self._delivered(
                    req, line, lambda: self._kv_at_decoder(d, req, seq)), held=self._held(req, 0, total_d, d.kvb))

            d.enqueue(req.prompt + req.out_len, admit_d, slot=True)
            return
        if pl in (Pipeline.P_RLD_MD, Pipeline.P_RLD):
            rld = req.rld
            req.p_pending_flows += 1
            total = req.prompt * rld.kvb  # in RLD's wire format (P's dtype or RLD's, the narrower)

            def admit_rld(_n):
                seq = Seq(req, req.prompt + 1, req.prompt, 0, "decode", req.prompt + req.out_len)
                req.rld_seq = seq
                line = self.fast[p.name]
                req.fast_flow = line.send(req.rid, total, lambda: self._delivered(
                    req, line, lambda: self._kv_at_decoder(rld, req, seq)), held=self._held(req, 0, total, rld.kvb))

            rld.enqueue(req.prompt + req.out_len, admit_rld, slot=True)
        if pl in (Pipeline.P_MD, Pipeline.P_RLD_MD):
            req.p_pending_flows += 1
            self._maybe_send_wan(req)
        if req.p_pending_flows == 0 and req.prefill_done:
            self._p_release(req)

    def _maybe_send_wan(self, req: Req) -> None:
        """Start MD's WAN send once P's prefill is done (layer-wise: once P's sends are set up, its
        prefill running) and MD has reserved (or at once with a predicted send)."""
        if (not ((req.prefill_done or req.rid in self.kv_dispatched) and (req.md_reserved or req.md_predicted))
                or req.wan_flow is not None or req.cut_off):
            return
        kvb = req.md.kvb
        nbytes = req.md_missing * kvb
        if nbytes <= 0 and not req.prefill_done:
            return
        req.wan_bytes = nbytes
        on_sent = None
        if self.cfg.early_handoff and req.pipeline == Pipeline.P_RLD_MD:
            on_sent = lambda: self._kv_left_p(req)  # noqa: E731
        landed = lambda: self._delivered(req, self.wan, lambda: self._kv_at_md(req))  # noqa: E731
        req.wan_flow = self.wan.send(req.rid, nbytes, landed, on_sent,
                                     held=self._held(req, req.prompt - req.md_missing, nbytes, kvb),
                                     sent_lead=self.wan_written_lead, conn=(req.p.name, req.md.name),
                                     track=self._tracks_progress(req))
        if req.cutoff_watched:  # let through before its send started: MD's reports of it are watched
            self._watch_cutoff(req)

    def _tracks_progress(self, req: Req) -> bool:
        """Whether ``req``'s WAN sends record their bytes over time for MD's progress reports
        (:meth:`md_progress`): a relayed request's with the cut-off on (what reads them)."""
        return self.cfg.cutoff and req.pipeline == Pipeline.P_RLD_MD

    def _delivered(self, req: Req, line: Line, fn: Callable[[], None]) -> None:
        """A send of ``req``'s KV on ``line`` has landed (its last byte, ``line``'s one-way delay
        after it left): ``fn`` (the receiver takes it) runs now, or, when its bytes all left
        before P's prefill ended (layer-wise, P's reply lag), once the transfer's end has
        crossed after P's seal: the runtime's ``kv_done`` (with P's first token) follows the seal
        (``pdd.transfer.kv.LayeredTransfer``)."""
        if not req.prefill_done:
            self._at_seal(req, lambda: self.after(line.owd, fn))
            return
        wait = req.t_prefill_done + line.owd - self.env.now
        if wait > 0:
            self.after(wait, fn)
        else:
            fn()

    def _at_seal(self, req: Req, fn: Callable[[], None]) -> None:
        """Run ``fn`` when P's prefill of ``req`` ends (its seal: :meth:`_prefill_done`)."""
        if req.at_seal is None:
            req.at_seal = []
        req.at_seal.append(fn)

    def _flow_drained(self, req: Req) -> None:
        req.p_pending_flows -= 1
        if req.p_pending_flows == 0 and req.prefill_done:  # else the prefill's end releases
            self._p_release(req)

    def _p_release(self, req: Req) -> None:
        p = req.p
        if req.p_locked is None:
            return
        full, partial = req.p_locked
        req.p_locked = None
        if p.cache is not None and full:
            p.cache.unlock(full)
        p.free(partial)
        p.poke()

    def _kv_at_decoder(self, inst: Instance, req: Req, seq: Seq) -> None:
        """KV (and P's first token) arrived at RLD / D over the fast path."""
        self._flow_drained(req)
        self._emit(req, self.env.now, 1, 0.0)
        if req.generated >= req.out_len:
            inst.free(seq.reserved)
            inst.release_slot()
            if inst.role == "RLD":
                self._rld_finished(inst, req)
            else:
                self._complete(req)
            return

        def add():
            inst.add(seq)
            if req.handoff_deferred:
                req.handoff_deferred = False
                self._handoff_round(inst, req)

        inst.post(add)

    def _send_fill(self, req: Req, tokens: int) -> None:
        """The runtime's fill (``md_fill``): MD's reservation reply, back at the gateway, says MD
        lacks ``tokens`` of the prompt the predicted send left out; P sends them over the same
        connection, after the predicted send. Nothing once the transfer was cut off (the cut-off
        saved its bytes)."""
        if req.cut_off:
            req.fill_pending = False
            self.wan_saved_bytes += tokens * req.md.kvb
            return
        nbytes = tokens * req.md.kvb
        req.wan_bytes += nbytes
        req.p_pending_flows += 1
        req.fill_flow = self.wan.send(req.rid, nbytes, lambda: self._fill_at_md(req), conn=(req.p.name, req.md.name),
                                      track=self._tracks_progress(req))

    def _fill_at_md(self, req: Req) -> None:
        self._flow_drained(req)
        req.fill_pending = False
        if req.main_landed:
            self._kv_landed(req)

    def _kv_at_md(self, req: Req) -> None:
        """The WAN transfer of the missing KV completed (propagation included); with a fill still
        on its way, MD's KV is complete when that lands too."""
        self._flow_drained(req)
        self._wan_sample(req.wan_flow)
        if req.fill_pending:
            req.main_landed = True
            return
        self._kv_landed(req)

    def _kv_landed(self, req: Req) -> None:
        req.wan_landed = True
        if req.md_seq is None:  # predicted send ahead of MD's admission: imported when admitted
            return
        self._kv_imported(req)

    def _forget_claims(self, req: Req) -> None:
        """``req``'s KV landed on its MD or was cut off: the page keys it is the last claimer of
        are forgotten (a later request would not wait for it: its KV is complete or will not
        come), so ``md_claimer`` holds only claims still coming, not every key ever routed."""
        claimer = self.md_claimer.get(req.md.name)
        if claimer:
            for k in self._page_keys(req, req.md.page):
                if claimer.get(k) is req:
                    del claimer[k]

    def _kv_imported(self, req: Req) -> None:
        """MD holds all of the request's KV in its pool (MD's ``kv_ready``)."""
        req.md_kv_complete = True
        ix = self.md_index.get(req.md.name)
        if ix is not None:
            ix.landed_keys(self._page_keys(req, req.md.page))
            self._forget_claims(req)
        if req.kv_waiters:  # after the cache insert below: they match it
            self.after(0.0, self._kv_settled, req)
        req.t_md_kv = self.env.now
        md = req.md
        seq = req.md_seq
        if md.cache is not None and seq is not None and seq.reserved >= 0:
            # MD caches the prompt's whole pages on arrival (the runtime does the same), locked
            # by this request until it is released
            full = req.blocks[: req.n_full]
            if seq.locked:
                md.cache.unlock(seq.locked)
            md.free(seq.reserved)
            keep = req.prompt - req.n_full * self.block + req.out_len
            md.private += keep
            seq.reserved = keep
            md.cache.insert(full)
            md.cache.lock(full)
            seq.locked = full
            over = md.used - md.pool
            if over > 0:
                md.cache.evict(-(-over // self.block))
        if req.rld_finished or req.finished:
            self._md_release(req, cache=True)
            return
        if req.pipeline == Pipeline.P_MD:
            seq = req.md_seq
            self._emit(req, self.env.now + self.md_owd, 1, 0.0)
            if req.generated >= req.out_len:
                self._md_release(req, cache=True)
                self._complete(req)
                return
            md.post(lambda: md.add(seq))
            return
        # P->RLD->MD: handoff ids that came before the KV extend now; MD's kv_ready goes to the
        # gateway, which asks RLD for the handoff (unless an early handoff started it)
        waiting, req.md_waiting = req.md_waiting, []
        for fn in waiting:
            md.post(fn)
        self.after(self.md_owd, self._start_handoff, req)

    # --- handoff -----------------------------------------------------------------------------------
    def _kv_left_p(self, req: Req) -> None:
        """Early handoff (``policy.early_handoff``, ``gateway.handoff``: ``_handoff_at_landing``): P wrote
        MD's KV to the WAN (its ``xfer_done``: its sockets took the last byte, here the instant at
        most :attr:`wan_written_lead` bytes of the flow are still to go on the line; 0: its last byte left), so
        the gateway starts the handoff when that byte is expected to have left at its WAN
        estimate (:func:`pdd.policy.handoff.early_handoff_delay_s` of the planned bytes, counted
        from P's prefill end): RLD's ids then cross the WAN beside the KV's last bytes instead of
        after MD's kv_ready crossed back, a round trip earlier. With an exact estimate and the
        send started at prefill end the wait is 0; a send that queued or shared the line has
        waited already; an estimate below the rate the flow got waits on. Bytes that all left
        before P's prefill ended (layer-wise, P's reply lag) are written with its seal."""
        if not req.prefill_done:
            self._at_seal(req, lambda: self._kv_left_p(req))
            return
        if req.t_kv_written is None:
            req.t_kv_written = self.env.now
        if self._early_moot(req):
            return
        elapsed = self.env.now - req.t_prefill_done
        wait = pol_handoff.early_handoff_delay_s(req.wan_bytes, self.wan_gbps_estimate(), elapsed)
        self.after(wait, self._early_handoff, req)

    @property
    def wan_written_lead(self) -> float:
        """Bytes of MD's KV still to go on the line when P has written it (its ``xfer_done``):
        ``SimConfig.wan_written_lead_bytes``, else ``wan_send_buffer_bytes``."""
        lead = self.cfg.wan_written_lead_bytes
        return self.cfg.committed_bytes() if lead is None else lead

    def _early_moot(self, req: Req) -> bool:
        return req.handoff_started or req.finished or req.rld_finished or req.cut_off

    def _early_handoff(self, req: Req) -> None:
        """As the runtime, the early handoff also waits for MD's reservation reply at the gateway
        (MD admitted the request), so a refused or queued reservation never leaves RLD stopped."""
        if self._early_moot(req):
            return
        if not req.md_reserved:
            req.early_pending = True
            return
        if self.env.now < req.t_md_replied:
            self.after(req.t_md_replied - self.env.now, self._early_handoff, req)
            return
        self.early_handoffs += 1
        self._start_handoff(req)

    def _start_handoff(self, req: Req) -> None:
        """The gateway asks RLD for the first handoff round (once: MD's kv_ready, or the early
        handoff, whichever comes first)."""
        if req.handoff_started:
            return
        req.handoff_started = True
        req.t_handoff_start = self.env.now
        rld = req.rld
        rld.post(lambda: self._handoff_round(rld, req))

    def _ids_at_md(self, req: Req, fn: Callable[[], None]) -> None:
        """RLD's ids reached MD: MD extends over them once the KV is in its pool (an early
        handoff's ids may come first; ``roles.main_decode`` holds the extend for the KV)."""
        if req.md_kv_complete:
            req.md.post(fn)
        else:
            req.md_waiting.append(fn)

    def _handoff_round(self, rld: Instance, req: Req) -> None:
        if req.rld_finished or req.finished:
            return
        if req.rid not in rld.seqs:  # MD was faster than the fast path: hand over once RLD runs it
            req.handoff_deferred = True
            return
        if req.t_handoff is None:
            req.t_handoff = self.env.now
        cfg = self.cfg
        pending = req.generated - req.handed
        hin = pol_handoff.HandoffInputs(
            tokens_pending=pending, rld_running=len(rld.seqs), rld_capacity=rld.max_running,
            rld_pages_used=rld.used, rld_pages_total=rld.pool, threshold=cfg.catchup_threshold,
            mode_config=cfg.handoff_mode, current_mode=rld.handoff_state, round_index=req.handoff_round)
        dec = self.decide_handoff(hin)
        self._log_decision(req, "handoff", hin, {"mode": dec.mode, "final": dec.final})
        rld.handoff_state = dec.mode  # as RLD's current_mode (only auto reads it)
        req.handoff_mode = dec.mode
        req.handoff_round += 1
        n = dec.tokens_to_send
        req.handed += n
        upto = req.handed
        md = req.md
        if dec.final:
            key = f"{dec.mode}"
            self.handoffs[key] = self.handoffs.get(key, 0) + 1
            seq = rld.remove(req.rid)
            rld.free(seq.reserved)
            rld.release_slot()

            def at_md():
                if req.finished:
                    return
                md_seq = req.md_seq
                md_seq.num_tokens = req.prompt + upto
                if md_seq.num_computed >= md_seq.num_tokens:
                    md_seq.num_computed = md_seq.num_tokens - 1  # resample the last position
                md_seq.can_sample = True
                md_seq.arrival = self._next_order()
                if req.rid not in md.seqs:
                    md.add(md_seq)

            self.after(self.owd, self._ids_at_md, req, at_md)
        else:
            def at_md_partial():
                if req.finished or req.rld_finished:
                    return
                md_seq = req.md_seq
                md_seq.num_tokens = req.prompt + upto
                md_seq.can_sample = False
                md_seq.arrival = self._next_order()
                if req.rid not in md.seqs:
                    md.add(md_seq)

            self.after(self.owd, self._ids_at_md, req, at_md_partial)

    def on_caught_up(self, inst: Instance, s: Seq) -> None:
        """MD finished extending a catch-up round without sampling: tell RLD."""
        req = s.req
        rld = req.rld
        if rld is None or req.rld_finished or req.finished:
            return
        self.after(self.md_owd, lambda: rld.post(lambda: self._handoff_round(rld, req)))

    # --- finishing ---------------------------------------------------------------------------------
    def _finish_on(self, inst: Instance, req: Req, s: Seq) -> None:
        inst.remove(req.rid)
        role = inst.role
        if role == "RLD":
            inst.free(s.reserved)
            inst.release_slot()
            self._rld_finished(inst, req)
        elif role == "MD":
            self._md_release(req, cache=True)
            ix = self.md_index.get(inst.name)
            if ix is not None:  # the runtime's _record_decoded: the prompt and the outputs but the last
                ix.insert_keys(self._page_keys(req, inst.page, req.out_len - 1), landed=True)
            self._complete(req)
        elif role == "C":
            if inst.cache is not None:
                if s.locked:
                    inst.cache.unlock(s.locked)
                inst.free(s.reserved)
                inst.cache_insert(req.blocks[: req.n_full])
            else:
                inst.free(s.reserved)
            inst.poke()
            self._complete(req)
        else:  # D
            inst.free(s.reserved)
            inst.release_slot()
            self._complete(req)

    def _rld_finished(self, rld: Instance, req: Req) -> None:
        req.rld_finished = True
        if req.pipeline == Pipeline.P_RLD_MD:
            cut = self._cut_off_due(req)
            if cut or not req.md_kv_complete:
                if cut and self.cfg.cutoff:
                    self._cut_off_wan(req)
                elif self.cfg.cutoff:  # let through: MD's next progress report may show it crawling
                    self._watch_cutoff(req)
                # otherwise the transfer runs on; MD caches it on arrival
            else:
                # MD already holds the KV: nothing to hand over; MD caches and frees
                self._md_release(req, cache=True)
        self._complete(req)

    def _cut_off_wan(self, req: Req) -> None:
        """Anomaly filter: cancel ``req``'s WAN transfer (RLD finished it first); MD frees what it
        received and caches nothing."""
        req.cut_off = True
        self._kv_settled(req)
        ix = self.md_index.get(req.md.name)
        if ix is not None:
            self._forget_claims(req)
            if self.cfg.md_index_drops_cut_offs:
                ix.dropped_keys(self._page_keys(req, req.md.page))
        self.cutoffs += 1
        if req.wan_flow is not None and not req.wan_flow.done:
            left = self.wan.cancel(req.wan_flow, self.cfg.committed_bytes())
            self.wan_saved_bytes += left
            req.wan_bytes -= left
            self._flow_drained(req)
        elif req.wan_flow is None and req.prefill_done:
            # never started (MD reservation pending): nothing will be sent. Its
            # missing tokens are known once the plan queued it at MD (else
            # _md_enqueue counts them)
            if req.md_queued:
                self.wan_saved_bytes += req.md_missing * req.md.kvb
            self._flow_drained(req)
        if req.fill_flow is not None and not req.fill_flow.done:  # a fill follows only a started send
            left = self.wan.cancel(req.fill_flow, self.cfg.committed_bytes())
            self.wan_saved_bytes += left
            req.wan_bytes -= left
            self._flow_drained(req)
        self._md_release(req, cache=False)

    def _watch_cutoff(self, req: Req) -> None:
        """``req`` ended with its WAN transfer let through (the gateway's ``cutoff_watch``): the
        cut-off is checked again when each of MD's later progress reports reaches the gateway
        (:meth:`_recheck_cutoff`), until MD has the KV. A send not started yet (MD's admission
        pending) is watched from its start (:meth:`_maybe_send_wan`); one on the line whose first
        byte has not left P (queued behind others) is looked at again an interval later. The next
        report reaches the gateway a line and MD delay after its frame: at the mark plus an
        interval, or, on a line stalled then, the frame that ends the stall
        (:meth:`Line.when_sending`; :meth:`md_reports`)."""
        if req.cut_off or req.md_kv_complete:
            return
        interval = pol_west.KV_PROGRESS_INTERVAL_S
        f = req.wan_flow
        if f is None:
            req.cutoff_watched = True  # its send, when it starts, is watched
            return
        first = self.wan.first_sent_s(f) if f.hist_t is not None else None
        if first is None:
            if f.hist_t is None or f.done:
                return  # not tracked, or over without a frame: no report comes
            self.after(interval, self._recheck_cutoff, req)  # the line serves it in time
            return
        lag = self.wan.owd + self.md_owd
        now = self.env.now
        due = self._md_walk(req)[1]
        if due is None:
            return  # the transfer is over: no report comes (MD's kv_ready settles it)
        if due + lag > now + 1e-9:  # the next report comes then, if a frame leaves at ``due``
            self.after(due + lag - now, self._recheck_cutoff, req)
            return
        t = self._md_next_frame(req, due)
        if t is not None:  # a frame that reports has left, its report not at the gateway yet
            self.after(max(0.0, t + lag - now), self._recheck_cutoff, req)
            return
        # stalled since the report was due: the frame that ends the stall reports
        fired = []

        def resumed() -> None:
            if not fired:
                fired.append(True)
                self.after(lag, self._recheck_cutoff, req)

        for g in (req.wan_flow, req.fill_flow):
            if g is not None and g.hist_t is not None and not g.done:
                self.wan.when_sending(g, resumed)

    def _recheck_cutoff(self, req: Req) -> None:
        """A progress report of a let-through transfer may have reached the gateway: a new one
        (:meth:`md_progress`) is checked as at the request's end (a late cut-off); then watch on."""
        if req.cut_off or req.md_kv_complete:
            return
        p = self.md_progress(req)
        if p is not None and p[0] != req.progress_seen:
            req.progress_seen = p[0]
            if self._cut_off_due(req):
                self.late_cutoffs += 1
                self._cut_off_wan(req)
                return
        self._watch_cutoff(req)

    def _md_release(self, req: Req, cache: bool) -> None:
        req.md_waiting = []  # handoff rounds whose ids came before the KV: moot once MD lets go
        md = req.md
        seq = req.md_seq
        if md is None:
            return
        if seq is None:  # reservation still queued: its admission sees cut_off and releases
            return
        if seq.reserved < 0:
            return
        md.remove(req.rid)
        if md.cache is not None and seq.locked:
            md.cache.unlock(seq.locked)
        md.free(seq.reserved)
        md.release_slot()
        seq.reserved = -1
        if cache and md.cache is not None:
            md.cache_insert(req.blocks[: req.n_full])
        md.poke()

    def _complete(self, req: Req) -> None:
        if req.finished:
            return
        req.finished = True
        if req.md_counted is not None:  # the request ends: it leaves its MD's load (the gateway's _unassign)
            req.md_counted.assigned -= 1
            req.md_counted = None
        req.t_done = req.t_last if req.t_last is not None else self.env.now
