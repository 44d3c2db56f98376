"""One simulated deployment (:class:`SimConfig`): mode, model, chips, instance counts, link and
policy settings, and the tiers it derives from them."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, fields, is_dataclass, replace

from pdd.config import EngineConfig, LinkConfig, PolicyConfig
from pdd.engine.scheduler import PREFILL_ORDERS
from pdd.policy.routing import MIN_HIT_FRAC
from pdd.policy.tcp_model import check_loss_rate, check_schedule
from pdd.policy.wan_order import send_buffer_bytes
from pdd.sim.hardware import Efficiency, get_chip
from pdd.sim.models import get_model


BLOCK = 512  # tokens per trace block (Mooncake hash granularity)
KV_STREAMS = ("whole", "layerwise")  # config.PolicyConfig.kv_stream
# the WAN send orders the simulator models: the runtime's (config.PolicyConfig.wan_order: fifo,
# srf) and "ps", processor sharing (every queued transfer gets an equal share of the line at
# once), an idealisation no runtime mode implements, kept as an explicit modelling choice
WAN_ORDERS = ("fifo", "srf", "ps")


def _same(v):
    return v


# SimConfig field -> (runtime config model, its field, conversion to the simulator's units): the
# fields whose defaults are the runtime's (`pdd serve` with no such key in its config), read from
# the runtime's field defaults so that they cannot drift apart (tests/sim/test_runtime_defaults.py)
RUNTIME_MIRRORS = {
    "wan_order": (PolicyConfig, "wan_order", _same),
    "wan_express_lane_bdp": (PolicyConfig, "wan_express_lane_bdp", _same),
    "wan_send_buffer_bdp": (PolicyConfig, "wan_send_buffer_bdp", _same),
    "ttft_budget_ms": (PolicyConfig, "pipeline_ttft_budget_ms", _same),
    "handoff_mode": (PolicyConfig, "handoff_mode", _same),
    "catchup_threshold": (PolicyConfig, "catchup_threshold_tokens", _same),
    "allow_p_rld": (PolicyConfig, "allow_p_rld", _same),
    "md_predicted_send": (PolicyConfig, "md_predicted_send", _same),
    "md_wait_claims": (PolicyConfig, "md_wait_claims", _same),
    "early_handoff": (PolicyConfig, "early_handoff", _same),
    "cutoff": (PolicyConfig, "cutoff", _same),
    "cutoff_min_remaining_s": (PolicyConfig, "cutoff_min_remaining_s", _same),
    "cutoff_max_sent_fraction": (PolicyConfig, "cutoff_max_sent_fraction", _same),
    "wan_estimate": (PolicyConfig, "wan_estimate", _same),
    "routing": (PolicyConfig, "routing", _same),
    "load_slack": (PolicyConfig, "load_slack", _same),
    "md_load_slack": (PolicyConfig, "md_load_slack", _same),
    "md_load_cap": (PolicyConfig, "md_load_cap", _same),
    "kv_stream": (PolicyConfig, "kv_stream", _same),
    "kv_stream_layer_group": (PolicyConfig, "kv_stream_layer_group", _same),
    "wan_loss_rate": (LinkConfig, "wan_loss_rate", _same),
    "wan_mss_bytes": (LinkConfig, "wan_mss_bytes", _same),
    "wan_cross_traffic": (LinkConfig, "wan_cross_traffic", lambda v: tuple(tuple(p) for p in v)),
    "prefill_order": (EngineConfig, "prefill_order", _same),
    "min_step_s": (EngineConfig, "min_step_ms", lambda ms: ms / 1000.0),
}


def runtime_default(name: str):
    """The runtime's default of SimConfig field ``name`` (one of ``RUNTIME_MIRRORS``), in the
    simulator's units. KeyError for a field that mirrors no runtime setting."""
    model, rt_name, conv = RUNTIME_MIRRORS[name]
    return conv(model.model_fields[rt_name].get_default(call_default_factory=True))
DECODE_ROLES = ("RLD", "MD", "D", "C")  # the simulator's roles that run decode steps (SimConfig.tiers)


def runtime_wan_fields(cfg) -> dict:
    """The SimConfig fields a runtime ``ClusterConfig`` (``pdd.config``, the YAML ``pdd serve``,
    ``pdd bench`` and ``pdd sim validate`` read) sets for the WAN line and KV streaming:
    ``link.wan_gbps``, ``wan_rtt_ms``, ``wan_loss_rate``, ``wan_mss_bytes``, ``wan_cross_traffic``,
    ``policy.wan_order``, ``wan_express_lane_bdp``, ``kv_stream``, ``kv_stream_layer_group``."""
    link, pol = cfg.link, cfg.policy
    return dict(wan_gbps=link.wan_gbps, wan_rtt_ms=link.wan_rtt_ms, wan_loss_rate=link.wan_loss_rate,
                wan_mss_bytes=link.wan_mss_bytes, wan_cross_traffic=tuple(tuple(p) for p in link.wan_cross_traffic),
                wan_order=pol.wan_order, wan_express_lane_bdp=pol.wan_express_lane_bdp, kv_stream=pol.kv_stream,
                kv_stream_layer_group=pol.kv_stream_layer_group)


def in_range(x, lo: float, hi: float, closed_hi: bool = False) -> bool:
    """``x`` is a number (not a bool) with ``lo <= x < hi`` (``<= hi`` when ``closed_hi``); NaN is not."""
    return (not isinstance(x, bool) and isinstance(x, (int, float))
            and lo <= x and (x <= hi if closed_hi else x < hi))


ENGINE_ROLES = ("P", "RLD", "MD", "D", "C")  # the simulator's roles (SimConfig.tiers)
SIM_ROLE = {"prefill": "P", "relay_decode": "RLD", "main_decode": "MD"}  # config role -> simulator tier (pdd mode)


@dataclass(frozen=True)
class SimEngine:
    """A simulated tier's (key ``"MD"``) or one instance's (``"MD1"``: role and index, as
    ``ClusterSim`` names its instances) own engine settings: the runtime's ``tiers.<tier>.engine``
    (``pdd.config.TierEngine``) as the simulator models them. A field left None inherits: an
    instance's from its role's entry, a role's from :class:`SimConfig`'s top-level fields
    (:meth:`SimConfig.engine_of` resolves them)."""

    max_batch_tokens: int | None = None  # new tokens of one step (engine.max_batch_tokens)
    prefill_chunk_tokens: int | None = None  # tokens of one prompt in one step
    max_running_seqs: int | None = None  # sequences of one step (engine.max_running)
    prefill_order: str | None = None  # pdd.engine.scheduler.PREFILL_ORDERS
    # every step takes at least this long, seconds (engine.min_step_ms / 1000: the emulated
    # accelerator's floor, the live worker holding a faster step; 0 = none)
    min_step_s: float | None = None
    # the KV page, tokens (dividing block_tokens): P's cache hit computes the prompt's last page;
    # the gateway's prefix index of MD counts MD's pages (engine.page_size)
    page_tokens: int | None = None
    # the KV pool, tokens (engine.num_pages x page_size); None: the step model's
    # (``kv_capacity_tokens``: a measured profile's engine, or the chip's HBM)
    kv_pool_tokens: int | None = None
    # bytes one token of KV occupies on a transfer *to* this tier (P's KV in the narrower of the
    # two tiers' dtypes, pdd.transfer.layout.wire_dtype); None: the model's kv_bytes_per_token
    kv_bytes_per_token: int | None = None
    # the step profile of this tier's engine (its engine.profile); None: its chip side's
    # (SimConfig.profile_a / profile_b)
    profile: str | None = None

    def check(self, at: str, block_tokens: int) -> None:
        """Raises ValueError naming ``at.<field>`` for a value the engine would refuse: counts
        below 1, an unknown prefill order, a negative or non-finite step floor, a page that does
        not divide ``block_tokens``."""
        def whole(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v >= 1

        for f in ("max_batch_tokens", "prefill_chunk_tokens", "max_running_seqs", "kv_pool_tokens",
                  "kv_bytes_per_token"):
            v = getattr(self, f)
            if v is not None and not whole(v):
                raise ValueError(f"{at}.{f} must be a whole number >= 1, got {v!r}")
        if self.prefill_order is not None and self.prefill_order not in PREFILL_ORDERS:
            raise ValueError(f"{at}.prefill_order must be one of {PREFILL_ORDERS}, got {self.prefill_order!r}")
        v = self.min_step_s
        if v is not None and not (in_range(v, 0.0, math.inf)):
            raise ValueError(f"{at}.min_step_s must be a finite number of seconds >= 0, got {v!r}")
        v = self.page_tokens
        if v is not None and not (whole(v) and block_tokens % v == 0):
            raise ValueError(f"{at}.page_tokens must be a whole number of tokens >= 1 dividing block_tokens "
                             f"({block_tokens}), got {v!r}")
        if self.profile is not None and not isinstance(self.profile, str):
            raise ValueError(f"{at}.profile must be a path, got {self.profile!r}")


_ENGINE_KEY = re.compile(r"(P|RLD|MD|D|C)(\d+)?")


def _sim_engine(v, at: str) -> SimEngine:
    """``v`` (a :class:`SimEngine` or a dict of its fields) as a SimEngine; ValueError naming a
    field it does not have."""
    if isinstance(v, SimEngine):
        return v
    if not isinstance(v, dict):
        raise ValueError(f"{at} must be a SimEngine or a dict of its fields, got {type(v).__name__}")
    known = {f.name for f in fields(SimEngine)}
    bad = sorted(set(v) - known)
    if bad:
        raise ValueError(f"{at}: unknown field(s) {', '.join(map(str, bad))} (fields: {', '.join(sorted(known))})")
    return SimEngine(**v)


# the most instances of one tier the CLIs build (each a SimPy process; a deployment of more is a
# typo, whose instances alone would take minutes and gigabytes to set up)
MAX_INSTANCES = 10_000
P_DISPATCH_MAX_S = 60.0  # SimConfig.p_dispatch_s above this is no trip to P (a hand-edited profile)
P_REPLY_LAG_MAX_S = 0.01  # SimConfig.p_reply_lag_s_per_token above this (5 s a 512-token chunk): hand-edited


@dataclass
class SimConfig:
    """One simulated deployment. Counts are instances (each ``model.gpus_per_instance`` chips)."""

    mode: str = "pdd"  # colocated | same_dc_pd | cross_dc_pd | pdd
    model: str = "llama-3.1-8b"
    kv_bytes_per_token: int | None = None  # override the model's
    chip_a: str = "H100-SXM5-80GB"  # P, RLD, same-DC D, colocated
    chip_b: str = "H200-SXM-141GB"  # MD
    price_a: float | None = None  # USD per GPU-hour, overrides the chip profile
    price_b: float | None = None
    n_p: int = 1
    n_rld: int = 1
    n_md: int = 1
    n_d: int = 1  # same_dc_pd decode instances (chip A)
    n_c: int = 1  # colocated instances (chip A)
    wan_gbps: float = 100.0
    wan_rtt_ms: float = 20.0
    # the WAN send order (the runtime's policy.wan_order: fifo | srf), or "ps" (WAN_ORDERS):
    # processor sharing, an idealisation the runtime cannot run, for explicit what-ifs only
    wan_order: str = runtime_default("wan_order")
    # the runtime's express lane (policy.wan_express_lane_bdp, pdd.policy.wan_order.wan_lane): a
    # WAN transfer of at most this many bandwidth-delay products has a connection of its own, so
    # with a send order it is written to its sockets without waiting for the queue ahead of it
    # (its xfer_done); 0: every transfer on one connection per target
    wan_express_lane_bdp: float = runtime_default("wan_express_lane_bdp")
    # the WAN line as the runtime's link emulator models it (pdd.policy.tcp_model, docs/SIM.md):
    # packet loss probability p in [0, 1) capping each transfer at one TCP connection's Mathis rate
    # (MSS wan_mss_bytes, RTT wan_rtt_ms), and cross traffic ((t_s, gbps), ...) taking its rate off
    # the line from t_s seconds of simulated time (the runtime's link.wan_loss_rate, wan_mss_bytes,
    # wan_cross_traffic)
    wan_loss_rate: float = runtime_default("wan_loss_rate")
    wan_mss_bytes: int = runtime_default("wan_mss_bytes")
    wan_cross_traffic: tuple = runtime_default("wan_cross_traffic")
    # when P sends a request's KV (the runtime's policy.kv_stream, kv_stream_layer_group): whole,
    # after its prefill; layerwise, each group of this many layers as P's step writes it
    kv_stream: str = runtime_default("kv_stream")
    kv_stream_layer_group: int = runtime_default("kv_stream_layer_group")
    wan_usd_per_hour: float = 0.0  # the cross-DC line's price
    fast_gbps: float | None = None  # per P instance; default chip nic_gbps x gpus
    fast_rtt_ms: float = 0.02
    max_batch_tokens: int = 8192
    max_running_seqs: int = 256
    prefill_chunk_tokens: int = 8192
    prefill_order: str = runtime_default("prefill_order")  # the engine scheduler's (pdd.engine.scheduler.PREFILL_ORDERS)
    min_step_s: float = runtime_default("min_step_s")  # every engine step takes at least this long, seconds (engine.min_step_ms)
    # each tier's (key "MD") or instance's ("MD1") own engine settings over the fields above and
    # page_tokens (the runtime's tiers.<tier>.engine): role or instance name -> SimEngine (or a
    # dict of its fields). None: every instance runs the top-level ones
    tier_engines: dict | None = None
    max_prefill_inflight: int = 0  # admission: sequences in prefill at once per instance (0 = any)
    # decode admission caps per tier (sequences holding a decode slot; 0 = only KV limits), the
    # operator's max-running-requests per decoder, e.g. sized so a full batch meets the TPOT SLO
    # (see experiments.slo_batch)
    max_running_d: int = 0
    max_running_rld: int = 0
    max_running_md: int = 0
    ttft_budget_ms: float = runtime_default("ttft_budget_ms")  # pipeline budget (pdd: P->MD if the WAN fits it)
    handoff_mode: str = runtime_default("handoff_mode")
    catchup_threshold: int = runtime_default("catchup_threshold")
    allow_p_rld: bool = runtime_default("allow_p_rld")
    allow_p_rld_after_s: float = 0.0  # the ablation applies to arrivals from this time on
    # MD's WAN send of a request relayed at once (pdd, zero TTFT budget) starts when P's prefill
    # is done, from the gateway's predicted MD prefix, instead of after MD's reservation round
    # trip (the runtime's policy.md_predicted_send)
    md_predicted_send: bool = runtime_default("md_predicted_send")
    # the gateway plans and routes on its prefix index of each MD (pdd.policy.prefix_index: every
    # prompt routed there and every output decoded there, LRU at MD's pool size), as the runtime
    # does, and MD caps its match at a predicted send's first page; False: on MD's cache itself
    md_prefix_index: bool = True
    # ... and takes a cut-off prompt's pages back out of it (PrefixIndex.dropped; the runtime's
    # gateway.routing._index_dropped); False: they stay until they age out (the gateway before)
    md_index_drops_cut_offs: bool = True
    # a request whose prefix the index holds as a claim on its MD (pages routed there whose KV is
    # still on its way) is judged for its TTFT budget on the landed prefix only, and its MD
    # reservation waits until that claim's KV is in MD's cache (or cut off), as a radix cache's
    # in-flight insert, shipping only what MD then lacks: when relayed at arrival, or when the
    # claim's transfer is already on the line (ClusterSim._wait_for_claim; the gateway's reserve
    # {after}). False: MD's reservation matched only what landed and the claimed pages crossed
    # again (with the cut-off off, or cross-DC PD at 3 req/s, the WAN ran away)
    md_wait_claims: bool = runtime_default("md_wait_claims")
    # a relayed request's handoff starts when MD's KV is expected to have left P (at the gateway's
    # WAN estimate), not when MD's kv_ready is back at the gateway (the runtime's
    # policy.early_handoff)
    early_handoff: bool = runtime_default("early_handoff")
    cutoff: bool = runtime_default("cutoff")
    cutoff_min_remaining_s: float = runtime_default("cutoff_min_remaining_s")  # shorter remainders finish
    cutoff_max_sent_fraction: float = runtime_default("cutoff_max_sent_fraction")  # a transfer that share received finishes
    wan_estimate: str = runtime_default("wan_estimate")  # live: median of MD's recent receive rates (the gateway's); config: wan_gbps
    drc: bool = True  # decode-side radix cache on MD
    p_cache: bool = True
    routing: str = runtime_default("routing")
    # cache-aware routing slack (requests) on P / colocated, and on MD (decoders hold tens of
    # sequences, affinity matters more): the runtime's policy.load_slack / md_load_slack defaults
    load_slack: int = runtime_default("load_slack")
    md_load_slack: int = runtime_default("md_load_slack")
    # an MD with this many requests (running + queued) is routed to only when every MD has them
    # (0: no cap; the runtime's policy.md_load_cap, pdd.policy.routing's load_cap)
    md_load_cap: int = runtime_default("md_load_cap")
    min_hit_frac: float = MIN_HIT_FRAC  # cache-aware routing ignores hits below this share of the prompt (the gateway's)
    md_cache_frac: float = 1.0  # fraction of MD's free KV pool the DRC may keep (capacity studies)
    p_cache_frac: float = 1.0
    slo_ttft_s: float = 5.0
    slo_tpot_s: float = 0.05
    warmup_frac: float = 0.1  # leading fraction of (measured) requests excluded from the metrics
    measure_from_s: float = 0.0  # requests arriving earlier are warm-up, never measured
    profile_a: str | None = None  # measured profile JSON (fits the roofline efficiencies)
    profile_b: str | None = None
    efficiency: Efficiency | None = None
    model_spec: dict | None = None  # ModelProfile fields (e.g. a measured profile's "model"), overrides `model`
    block_tokens: int = BLOCK  # tokens per hash block of the records (= cache page granularity)
    # P's KV page, tokens (dividing block_tokens): a prompt P holds whole in its cache still
    # computes its last page (the engine keeps at least one token to compute and matches whole
    # pages: pdd.engine's min_uncached). None: block_tokens (the last block is computed)
    page_tokens: int | None = None
    host_cores: float = 0.0  # >0: all instances share this many CPU cores (validating a one-machine topology)
    # factor on a role's decode step ("RLD", "MD", ...) while a P instance on the shared host
    # (host_cores > 0) runs a prefill step: on one CPU machine a prefill slows the
    # decoders beside it beyond what their share of the cores says (memory bandwidth, the
    # gateway's and link emulator's threads). Measured from a live run's token gaps
    # (live_measures.live_decode_interference); absent roles 1
    decode_interference: dict | None = None  # role in DECODE_ROLES -> factor >= 1
    # the converse: factor on P's prefill step while a decoding instance (RLD, MD, D, C) on the
    # shared host (host_cores > 0) is in a step. Live, each decoded token also keeps the gateway
    # (relaying it) and the client (reading it) busy on the same cores. A step is re-timed when
    # the decoders start or stop: its remaining work goes at the new pace. Measured as the factor
    # at which the simulated mean P step equals a live run's (calibrate.calibrate_p_interference:
    # engine_busy_s / engine_steps); 1 is none
    prefill_interference: float = 1.0
    # seconds from a request's arrival at the gateway to its admission at P: the live P
    # interval's part that is neither engine steps nor the reply lag, the same for every request
    # (the gateway's RLD expect call, P's RPC). Measured on a live run
    # (calibrate.calibrate_p_dispatch); 0 = P starts at arrival
    p_dispatch_s: float = 0.0
    # seconds per token of a prefill's largest step (its computed tokens, at most
    # min(prefill_chunk_tokens, max_batch_tokens)) from its last step's end to P's reply (its
    # first token) reaching the gateway: on the CPU testbed the live P interval outgrows the
    # engine's steps by about a tenth of a chunk's step, whatever the number of steps. P's
    # engine is free meanwhile; the reply and P's KV sends wait. The prefills one step finishes
    # reply together, in batch order, after the largest of their lags (the runtime's P resolves
    # a step's first tokens in one pass and starts their KV sends in that order). Measured on a
    # live run's quiet isolated prefills (calibrate.fit_quiet_step); 0 = the reply at the last
    # step's end
    p_reply_lag_s_per_token: float = 0.0
    # seconds added to every engine step of a role ("P", "RLD", "MD", ...): what a live role's
    # step costs beyond the bare engine's (RPC and token-streaming threads contending for the
    # GIL, per-step bookkeeping), measured from a live run (calibrate.calibrate_role_overheads)
    step_overhead_s: dict | None = None
    # factor on every engine step of a role ("P", ...) before its overhead: a live role's step is
    # ``scale x profile step + overhead`` (the engine's compute slowed in proportion, e.g. by the
    # role's own threads sharing the cores), fitted from a live run's isolated prefills
    # (calibrate.fit_quiet_step); absent roles 1
    step_scale: dict | None = None
    # the WAN RTT the gateway's pipeline decision reads (ms), when it differs from the line's
    # wan_rtt_ms: the live gateway's estimate is its windowed minimum of MD reservation round
    # trips, software included. Measured on a live run (live_measures.live_gateway_rtt_ms); None: wan_rtt_ms
    wan_rtt_estimate_ms: float | None = None
    # the gateway's pipeline inputs carry the WAN backlog to the chosen MD (the runtime's
    # gateway.wan_booking._wan_backlog_bytes: planned bytes of transfers to it not yet delivered,
    # less what the line can have carried since the oldest started), as the runtime gateway always
    # does (it has no switch). Off: 0 (the simulator before 2026-12-07)
    wan_backlog_in_plan: bool = True
    # bytes of a WAN transfer already handed to the sockets (P's send buffer, the link's receive
    # buffer) that a cut-off cannot recall: they still cross the line, ahead of later transfers.
    # 0 = a cut-off stops the flow at once. Measured on a live run (calibrate.calibrate_wan_buffer).
    # None: P's kernel send buffer as the runtime sizes it, wan_send_buffer_bdp bandwidth-delay
    # products of the line (policy.wan_send_buffer_bdp, pdd.policy.wan_order.send_buffer_bytes;
    # :meth:`committed_bytes`)
    wan_send_buffer_bytes: float | None = None
    wan_send_buffer_bdp: float = runtime_default("wan_send_buffer_bdp")
    # P's xfer_done of MD's KV (which starts an early handoff's wait) comes when its sockets took
    # the last byte: this many bytes before the flow's last byte leaves the line (0: when it
    # leaves). Measured on a live run's xfer_done events (calibrate.calibrate_wan_written_lead);
    # None: wan_send_buffer_bytes
    wan_written_lead_bytes: float | None = None
    # from the gateway receiving a token to the client seeing it (HTTP streaming): shifts every
    # token of a request alike (TTFT, not TPOT). Measured on a live run's recorded events.
    client_delay_s: float = 0.0

    def __post_init__(self) -> None:
        """Checks the WAN and streaming fields; raises ValueError naming the field."""
        if self.wan_order not in WAN_ORDERS:
            raise ValueError(f"wan_order must be one of {WAN_ORDERS}, got {self.wan_order!r}")
        self.wan_loss_rate = check_loss_rate(self.wan_loss_rate, "wan_loss_rate")
        if not (self.wan_mss_bytes >= 1):
            raise ValueError(f"wan_mss_bytes must be >= 1, got {self.wan_mss_bytes!r}")
        self.wan_cross_traffic = check_schedule(self.wan_cross_traffic, "wan_cross_traffic", self.wan_gbps)
        if self.kv_stream not in KV_STREAMS:
            raise ValueError(f"kv_stream must be one of {KV_STREAMS}, got {self.kv_stream!r}")
        if not (self.kv_stream_layer_group >= 1):
            raise ValueError(f"kv_stream_layer_group must be >= 1, got {self.kv_stream_layer_group!r}")
        for role, f in (self.decode_interference or {}).items():
            if role not in DECODE_ROLES:  # P's own steps are the prefills: no factor applies to them
                raise ValueError(f"decode_interference has role {role!r}; it applies to the decoding roles "
                                 f"{', '.join(DECODE_ROLES)}")
            if not in_range(f, 1.0, float("inf")):
                raise ValueError(f"decode_interference[{role!r}] must be a finite factor >= 1, got {f!r}")
        if not in_range(self.p_dispatch_s, 0.0, P_DISPATCH_MAX_S, closed_hi=True):
            raise ValueError(f"p_dispatch_s must be a number of seconds in [0, {P_DISPATCH_MAX_S:g}] (a request's "
                             f"trip to P, milliseconds when measured), got {self.p_dispatch_s!r}")
        if self.page_tokens is not None and not (isinstance(self.page_tokens, int) and self.page_tokens >= 1
                                                 and self.block_tokens % self.page_tokens == 0):
            raise ValueError(f"page_tokens must be a whole number of tokens >= 1 dividing block_tokens "
                             f"({self.block_tokens}), got {self.page_tokens!r}")
        if not in_range(self.p_reply_lag_s_per_token, 0.0, P_REPLY_LAG_MAX_S, closed_hi=True):
            raise ValueError(f"p_reply_lag_s_per_token must be a number of seconds in [0, {P_REPLY_LAG_MAX_S:g}] "
                             f"(microseconds when measured), got {self.p_reply_lag_s_per_token!r}")
        if self.wan_written_lead_bytes is not None and not in_range(self.wan_written_lead_bytes, 0.0, float("inf")):
            raise ValueError(f"wan_written_lead_bytes must be a finite number of bytes >= 0 or None, got "
                             f"{self.wan_written_lead_bytes!r}")
        if not in_range(self.prefill_interference, 1.0, float("inf")):
            raise ValueError(f"prefill_interference must be a finite factor >= 1, got {self.prefill_interference!r}")
        if not in_range(self.min_step_s, 0.0, math.inf):
            raise ValueError(f"min_step_s must be a finite number of seconds >= 0, got {self.min_step_s!r}")
        if self.tier_engines is not None:
            if not isinstance(self.tier_engines, dict):
                raise ValueError(f"tier_engines must be a dict of role or instance name -> SimEngine, got "
                                 f"{type(self.tier_engines).__name__}")
            te = {}
            for k, v in self.tier_engines.items():
                if not (isinstance(k, str) and _ENGINE_KEY.fullmatch(k)):
                    raise ValueError(f"tier_engines has key {k!r}: a role ({', '.join(ENGINE_ROLES)}) or an "
                                     f"instance of one (MD1)")
                te[k] = _sim_engine(v, f"tier_engines[{k!r}]")
                te[k].check(f"tier_engines[{k!r}]", self.block_tokens)
            self.tier_engines = te

    def replace(self, **kw) -> "SimConfig":
        return replace(self, **kw)

    def committed_bytes(self) -> float:
        """Bytes of a WAN transfer handed to the sockets that a cut-off cannot recall:
        ``wan_send_buffer_bytes``, or when None the runtime's send buffer of this line
        (``wan_send_buffer_bdp`` BDPs of ``wan_gbps`` x ``wan_rtt_ms``, at least 64 KiB; 0 when
        the factor is 0, which leaves the runtime's buffer to the OS)."""
        if self.wan_send_buffer_bytes is not None:
            return float(self.wan_send_buffer_bytes)
        b = send_buffer_bytes(self.wan_gbps, self.wan_rtt_ms, self.wan_send_buffer_bdp)
        return float(b or 0)

    def engine_of(self, name: str) -> SimEngine:
        """The engine settings of instance ``name`` (``"MD1"``) or role (``"MD"``): the top-level
        fields with its role's ``tier_engines`` entry over them, then the instance's own. Every
        field is set but ``kv_pool_tokens``, ``kv_bytes_per_token`` and ``profile`` (None: the
        step model's pool, the model's KV size, the chip side's profile). Raises ValueError for a
        name that is not a role or an instance of one."""
        m = _ENGINE_KEY.fullmatch(name)
        if m is None:
            raise ValueError(f"{name!r} is not a role ({', '.join(ENGINE_ROLES)}) or an instance of one (MD1)")
        kw = dict(max_batch_tokens=self.max_batch_tokens, prefill_chunk_tokens=self.prefill_chunk_tokens,
                  max_running_seqs=self.max_running_seqs, prefill_order=self.prefill_order,
                  min_step_s=self.min_step_s, page_tokens=self.page_tokens or self.block_tokens)
        te = self.tier_engines or {}
        for key in (m.group(1), name) if m.group(2) is not None else (name,):
            over = te.get(key)
            if over is not None:
                kw.update({f.name: getattr(over, f.name) for f in fields(SimEngine)
                           if getattr(over, f.name) is not None})
        return SimEngine(**kw)

    # derived --------------------------------------------------------------------------------
    def model_profile(self):
        if self.model_spec is not None:
            from pdd.sim.models import ModelProfile

            m = ModelProfile(name=self.model, **self.model_spec)
            return m.with_kv_bytes(self.kv_bytes_per_token) if self.kv_bytes_per_token else m
        m = get_model(self.model)
        return m.with_kv_bytes(self.kv_bytes_per_token) if self.kv_bytes_per_token else m

    def chip(self, which: str):
        c = get_chip(self.chip_a if which == "a" else self.chip_b)
        p = self.price_a if which == "a" else self.price_b
        return c.priced(p) if p is not None else c

    def tiers(self) -> dict[str, tuple[int, str]]:
        """role -> (count, chip side)."""
        if self.mode == "colocated":
            return {"C": (self.n_c, "a")}
        if self.mode == "same_dc_pd":
            return {"P": (self.n_p, "a"), "D": (self.n_d, "a")}
        if self.mode == "cross_dc_pd":
            return {"P": (self.n_p, "a"), "MD": (self.n_md, "b")}
        if self.mode == "pdd":
            return {"P": (self.n_p, "a"), "RLD": (self.n_rld, "a"), "MD": (self.n_md, "b")}
        raise ValueError(f"unknown mode {self.mode!r}")

    def cross_dc(self) -> bool:
        return self.mode in ("cross_dc_pd", "pdd")

    def gpus(self) -> dict[str, int]:
        g = self.model_profile().gpus_per_instance
        out = {"a": 0, "b": 0}
        for _, (n, side) in self.tiers().items():
            out[side] += n * g
        return out

    def cost_per_hour(self) -> float:
        g = self.gpus()
        c = g["a"] * self.chip("a").usd_per_hour + g["b"] * self.chip("b").usd_per_hour
        return c + (self.wan_usd_per_hour if self.cross_dc() else 0.0)

    def describe(self) -> str:
        t = self.tiers()
        parts = [f"{n}{r}" for r, (n, _) in t.items()]
        return f"{self.mode}[{'+'.join(parts)}]"


# the runtime config's block of each model RUNTIME_MIRRORS reads (pdd.config.ClusterConfig's fields)
RUNTIME_SECTION = {PolicyConfig: "policy", LinkConfig: "link", EngineConfig: "engine"}
# SimConfig field -> its value in the runtime's units, where RUNTIME_MIRRORS converts (the inverse)
_TO_RUNTIME = {"min_step_s": lambda s: s * 1000.0}


def _json(v):
    """``v`` as plain JSON values: a dataclass as a dict of its fields, a tuple as a list."""
    if is_dataclass(v) and not isinstance(v, type):
        return {f.name: _json(getattr(v, f.name)) for f in fields(v)}
    if isinstance(v, (list, tuple)):
        return [_json(x) for x in v]
    if isinstance(v, dict):
        return {str(k): _json(x) for k, x in v.items()}
    return v


def settings_of(cfg: SimConfig) -> dict:
    """The settings a simulation of ``cfg`` runs with, as plain JSON values (what ``pdd sim run
    --json`` and ``pdd sim experiment``'s ``result.json`` record as ``settings``):

    - ``sim_config``: every :class:`SimConfig` field by name, as set (tuples as lists,
      ``SimEngine`` / ``Efficiency`` as dicts of their fields); :func:`config_from_settings`
      rebuilds the SimConfig from it;
    - ``runtime``: each ``RUNTIME_MIRRORS`` field under the runtime config key it mirrors
      (``policy.pipeline_ttft_budget_ms``, ``engine.min_step_ms``, ...), in the runtime's units;
    - ``resolved``: what a field left None (or 0) defers to, as the simulation uses it:
      ``wan_send_buffer_bytes`` (:meth:`SimConfig.committed_bytes`), ``wan_written_lead_bytes``,
      ``wan_rtt_estimate_ms``, ``fast_gbps`` (chip A's NIC x GPUs an instance), ``page_tokens``,
      ``kv_bytes_per_token`` (the model's), ``price_a`` / ``price_b`` (USD per GPU-hour) and
      ``engines``: :meth:`SimConfig.engine_of` of each simulated role and of each instance
      ``tier_engines`` names."""
    rt = {}
    for name, (model, rt_name, _) in RUNTIME_MIRRORS.items():
        v = getattr(cfg, name)
        rt[f"{RUNTIME_SECTION[model]}.{rt_name}"] = _json(_TO_RUNTIME.get(name, _same)(v))
    m = cfg.model_profile()
    committed = cfg.committed_bytes()
    names = list(cfg.tiers()) + [k for k in (cfg.tier_engines or {}) if _ENGINE_KEY.fullmatch(k).group(2)]
    resolved = {
        "wan_send_buffer_bytes": committed,
        "wan_written_lead_bytes": committed if cfg.wan_written_lead_bytes is None else cfg.wan_written_lead_bytes,
        "wan_rtt_estimate_ms": cfg.wan_rtt_ms if cfg.wan_rtt_estimate_ms is None else cfg.wan_rtt_estimate_ms,
        "fast_gbps": cfg.fast_gbps or cfg.chip("a").nic_gbps * m.gpus_per_instance,  # as ClusterSim reads it
        "page_tokens": cfg.page_tokens or cfg.block_tokens,
        "kv_bytes_per_token": m.kv_bytes_per_token,
        "price_a": cfg.chip("a").usd_per_hour,
        "price_b": cfg.chip("b").usd_per_hour,
        "engines": {n: _json(cfg.engine_of(n)) for n in names},
    }
    return {"sim_config": {f.name: _json(getattr(cfg, f.name)) for f in fields(SimConfig)},
            "runtime": rt, "resolved": resolved}


def config_from_settings(sim_config: dict) -> SimConfig:
    """The :class:`SimConfig` of a record's ``settings["sim_config"]`` (:func:`settings_of`):
    its lists back to tuples, its ``efficiency`` to an ``Efficiency``. ValueError (TypeError for
    a field SimConfig lacks) as SimConfig raises them."""
    kw = dict(sim_config)
    if kw.get("wan_cross_traffic") is not None:
        kw["wan_cross_traffic"] = tuple(tuple(p) for p in kw["wan_cross_traffic"])
    if isinstance(kw.get("efficiency"), dict):
        kw["efficiency"] = Efficiency(**kw["efficiency"])
    return SimConfig(**kw)


# what ``pdd sim calibrate-roles`` writes into a profile from a live run (pdd.sim.calibrate) and
# :func:`with_live_fit` applies
LIVE_FIT_FIELDS = ("role_step_overhead_s", "role_step_scale", "decode_interference", "prefill_interference",
                   "p_dispatch_s", "p_reply_lag_s_per_token", "wan_send_buffer_bytes", "wan_written_lead_bytes",
                   "client_delay_s", "gateway_rtt_ms", "fast_path")


def live_fit_of(prof: dict) -> list[str]:
    """The live-run fit fields (``LIVE_FIT_FIELDS``) a profile dict carries with a value."""
    return [k for k in LIVE_FIT_FIELDS if prof.get(k)]


def with_live_fit(scfg: SimConfig, prof: dict, overheads: dict | None = None,
                  wan_buffer: float | None = None) -> SimConfig:
    """``scfg`` with a profile's live-run fit (``pdd sim calibrate-roles``, docs/SIM.md): per-role
    step factors (``role_step_scale``) and seconds a step (``role_step_overhead_s``, or
    ``overheads`` when given), the WAN send buffer (bytes; ``wan_buffer`` when given) and the
    bytes of MD's KV still to go when P has written it (``wan_written_lead_bytes``), the client
    delay (s), the gateway's RTT estimate (ms: ``scfg``'s line RTT plus what the measured one was
    above the line it was measured on, ``gateway_rtt_line_ms``), the decode and prefill
    interference factors (applied only on a shared host, ``host_cores`` > 0), P's dispatch
    delay (s) and the measured P -> RLD fast path (Gbit/s and one-way
    latency s, as an RTT of twice it in ms). Fields the profile lacks leave ``scfg``'s."""
    kw = {}
    ovh = overheads if overheads is not None else prof.get("role_step_overhead_s")
    if ovh:
        kw["step_overhead_s"] = dict(ovh)
    if prof.get("role_step_scale"):
        kw["step_scale"] = dict(prof["role_step_scale"])
    if prof.get("client_delay_s"):
        kw["client_delay_s"] = float(prof["client_delay_s"])
    if prof.get("gateway_rtt_ms"):
        line = prof.get("gateway_rtt_line_ms")
        # the software's share (the measured RTT less the line's it was measured on) on top of
        # this deployment's line; a profile without the line's RTT gives its measured RTT as is
        kw["wan_rtt_estimate_ms"] = float(prof["gateway_rtt_ms"]) if line is None else \
            max(0.0, scfg.wan_rtt_ms + float(prof["gateway_rtt_ms"]) - float(line))
    if prof.get("decode_interference"):
        kw["decode_interference"] = dict(prof["decode_interference"])
    if prof.get("prefill_interference"):
        kw["prefill_interference"] = float(prof["prefill_interference"])
    if prof.get("p_dispatch_s"):
        kw["p_dispatch_s"] = float(prof["p_dispatch_s"])
    if prof.get("p_reply_lag_s_per_token"):
        kw["p_reply_lag_s_per_token"] = float(prof["p_reply_lag_s_per_token"])
    fp = prof.get("fast_path")
    if fp:  # measured on a live run (live_fast_path): the Python KV path, not the configured pacing
        kw.update(fast_gbps=float(fp["gbps"]), fast_rtt_ms=2000.0 * float(fp["latency_s"]))
    wb = prof.get("wan_send_buffer_bytes", 0.0) if wan_buffer is None else wan_buffer
    if wb:
        kw["wan_send_buffer_bytes"] = float(wb)
    if prof.get("wan_written_lead_bytes") is not None:
        kw["wan_written_lead_bytes"] = float(prof["wan_written_lead_bytes"])
    return scfg.replace(**kw) if kw else scfg
