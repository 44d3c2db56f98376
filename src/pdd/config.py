"""Configuration for a pdd topology (pydantic models; load from YAML or JSON).

Units are in the field names. Defaults describe the embedded single-machine topology used by
``pdd serve`` and ``pdd demo``; see docs/LINK.md for why the link numbers are what they are.
"""

from __future__ import annotations

import functools
import json
import re
import sys
import typing
from pathlib import Path
from types import UnionType
from typing import Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, ValidationInfo, field_validator, model_validator

from pdd.text import shown
from pdd.topology import layout, port_conflicts
from pdd.policy.routing import LOAD_SLACK, MD_LOAD_SLACK
from pdd.policy.tcp_model import MAX_LINE_DELAY_MS, slow_line_problem

Mode = Literal["colocated", "same_dc_pd", "cross_dc_pd", "pdd"]
MODES: tuple[str, ...] = ("colocated", "same_dc_pd", "cross_dc_pd", "pdd")


class _Strict(BaseModel):
    """Every config block: unknown fields refused; floats finite (a YAML ``.inf`` WAN RTT or
    timeout would only show as a hang); a value of the wrong YAML type refused rather than
    converted (below): a boolean or a quoted string for a number, anything but a boolean for a
    boolean, as the HTTP API refuses them."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    @field_validator("*", mode="before")
    @classmethod
    def _no_bool_for_number(cls, v, info: ValidationInfo):
        """A boolean where a number is expected (``pipeline_ttft_budget_ms: true``, ``wan_gbps: on``,
        ``autoscale: {min: {main_decode: yes}}``, a bare ``pdd+pipeline_ttft_budget_ms`` mode label)
        is refused (ValueError naming the field): pydantic's lax mode would read it as 1 (a 1 ms
        budget, a 1 Gbit/s line). YAML reads yes / no / on / off / true / false as booleans."""
        if info.field_name in _number_fields(cls) and _has_bool(v):
            raise ValueError(f"must be a number, got {_bool_text(v)} (YAML reads true/false, yes/no and on/off as "
                             f"booleans)")
        return v

    @field_validator("*", mode="before")
    @classmethod
    def _no_text_for_number(cls, v, info: ValidationInfo):
        """A string where only a number is expected (``page_size: '16'``, ``wan_gbps: '1.5'``,
        ``autoscale: {max: {main_decode: '2'}}``, ``wan_cross_traffic: [[0, '1']]``) is refused
        (ValueError naming the field and the string): pydantic's lax mode would parse it, where
        the HTTP API refuses ``"max_tokens": "5"``. A field that takes text too (a Literal of
        names, ``str | None``) keeps its strings; an int for a float field stays a number."""
        text = _text_for_number(cls.model_fields[info.field_name].annotation, v)
        if text is not None:
            at, s = text
            if isinstance(s, _BareNonFinite):  # NaN unquoted in a JSON file: not "the string 'NaN'"
                raise ValueError(f"must be a finite number; {s} is not a valid JSON number (JSON has no NaN or "
                                 f"Infinity)" + (f" at {at}" if at else ""))
            raise ValueError(f"must be a number written without quotes, got the string {shown(s)}"
                             + (f" at {at}" if at else ""))
        return v

    @field_validator("*", mode="before")
    @classmethod
    def _only_bool_for_bool(cls, v, info: ValidationInfo):
        """Anything but a boolean where a boolean is expected (``cutoff: 'yes'`` quoted, ``cutoff:
        1``, ``early_handoff: 'no'``) is refused (ValueError naming the field): pydantic's lax mode
        would read ``'no'`` as false and ``1`` as true. YAML's unquoted yes / no / on / off / true /
        false are booleans already."""
        if info.field_name in _bool_fields(cls) and not isinstance(v, bool):
            raise ValueError(f"must be true or false (YAML's yes/no and on/off unquoted too), got {_given(v)}")
        return v


def _mentions(ann, types: tuple) -> bool:
    """Whether a type annotation is, or holds anywhere (``int | None``, ``dict[str, int]``,
    ``list[tuple[float, float]]``), one of ``types``."""
    return ann in types or any(_mentions(a, types) for a in typing.get_args(ann))


@functools.lru_cache(maxsize=None)
def _number_fields(cls) -> frozenset[str]:
    """Names of ``cls``'s fields that take numbers (anywhere in their type) and never a boolean."""
    return frozenset(name for name, f in cls.model_fields.items()
                     if _mentions(f.annotation, (int, float)) and not _mentions(f.annotation, (bool,)))


@functools.lru_cache(maxsize=None)
def _bool_fields(cls) -> frozenset[str]:
    """Names of ``cls``'s fields whose type is ``bool`` (``bool | None``: None stays pydantic's)."""
    return frozenset(name for name, f in cls.model_fields.items()
                     if f.annotation is bool or set(union_arms(f.annotation)) == {bool, type(None)})


def union_arms(ann) -> tuple:
    """The alternatives of a union annotation, nested unions flattened (``int | None`` -> ``(int,
    NoneType)``), else ``(ann,)``."""
    if typing.get_origin(ann) in (typing.Union, UnionType):
        return tuple(x for a in typing.get_args(ann) for x in union_arms(a))
    return (ann,)


def _takes_text(ann) -> bool:
    """Whether a (non-union) annotation accepts a string: ``str``, or a Literal with a string."""
    return ann is str or (typing.get_origin(ann) is Literal and any(isinstance(x, str) for x in typing.get_args(ann)))


def _text_for_number(ann, v, at: str = "") -> tuple[str, str] | None:
    """The first string in ``v`` at a place where ``ann`` takes numbers and no text: ``(where,
    string)`` (where: ``""`` for ``v`` itself, ``main_decode`` for a mapping's value, ``[0][1]``
    inside lists), or None. Mapping keys are not numbers here (``Literal`` role names)."""
    arms = union_arms(ann)
    if isinstance(v, str):
        if any(a in (int, float) for a in arms) and not any(_takes_text(a) for a in arms):
            return at, v
        return None
    if isinstance(v, dict):
        for a in arms:
            if typing.get_origin(a) is dict:
                val_ann = typing.get_args(a)[1]
                for k, x in v.items():
                    hit = _text_for_number(val_ann, x, f"{at}.{k}" if at else str(k))
                    if hit:
                        return hit
        return None
    if isinstance(v, (list, tuple)):
        for a in arms:
            origin, args = typing.get_origin(a), typing.get_args(a)
            if origin is list or (origin is tuple and len(args) == 2 and args[1] is Ellipsis):
                elems = [args[0]] * len(v)
            elif origin is tuple:
                elems = list(args)
            else:
                continue
            for i, (e, x) in enumerate(zip(elems, v)):
                hit = _text_for_number(e, x, f"{at}[{i}]")
                if hit:
                    return hit
    return None


def _given(v) -> str:
    """What a config gave, in its own words: ``the string 'yes'``, ``the number 1``, ``null``, a list."""
    if isinstance(v, _BareNonFinite):
        return f"{v} (not a valid JSON number: JSON has no NaN or Infinity)"
    if isinstance(v, str):
        return f"the string {shown(v)}"
    if isinstance(v, (int, float)) and not isinstance(v, bool):
        return f"the number {v}"
    try:
        text = json.dumps(v)
    except (TypeError, ValueError):
        text = type(v).__name__
    return text if len(text) <= 60 else text[:56] + " ..."


def _has_bool(v) -> bool:
    """Whether ``v`` is a boolean or a list / tuple / mapping holding one (values, nested)."""
    if isinstance(v, bool):
        return True
    if isinstance(v, (list, tuple)):
        return any(_has_bool(x) for x in v)
    if isinstance(v, dict):
        return any(_has_bool(x) for x in v.values())
    return False


def _bool_text(v) -> str:
    """``v`` as the config wrote it: ``true`` / ``false``, or the container holding one."""
    return str(v).lower() if isinstance(v, bool) else json.dumps(v)


class EngineConfig(_Strict):
    """One engine instance (P, RLD, MD or colocated)."""

    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: str = Field("cpu", description="torch device of the engines: cpu, cuda or cuda:N")
    page_size: int = Field(16, ge=1, description="tokens per KV page (a power of two, so every tier's page size "
                           "divides or is a multiple of every other's)")
    num_pages: int = Field(2048, ge=4, description="KV pages in the pool")
    max_batch_tokens: int = Field(512, ge=1, description="token budget of one forward pass")
    prefill_chunk_tokens: int = Field(512, ge=1)
    prefill_order: Literal["fcfs", "short_first"] = Field(
        "fcfs", description="order of prefill chunks in a batch (pdd.engine.scheduler): fcfs by arrival, or "
        "short_first (short prefills beside a long one's chunk; the oldest keeps >= half the budget)")
    max_running: int = Field(64, ge=1, description="sequences in one batch at most")
    max_model_len: int = Field(4096, ge=2, description="prompt + output tokens at most; <= the KV pool "
                               "(num_pages x page_size tokens) of every tier and instance (left out: the smallest "
                               "pool's tokens when that is below 4096)")
    max_input_len: int = Field(4000, ge=1, description="prompt tokens at most; <= max_model_len (left out: "
                               "max_model_len when that is below 4000)")
    torch_threads: int = Field(1, ge=1)
    min_step_ms: float = Field(
        0.0, ge=0, le=10_000, allow_inf_nan=False, description="emulated accelerator: every forward pass takes at least this long, "
        "ms (its tokens are released at the end); 0 = off. A memory-bound step reads all weights once "
        "whatever the batch, so a GPU decode step has a floor; the PDD report's ITL is 30-50 ms. On this "
        "CPU the small model steps in ~1.3 ms, ~15x under the emulated WAN's round trip (docs/LINK.md)")
    profile: str | None = Field(
        None, description="step-time profile written by `pdd profile` (pdd-profile/1 JSON): the engine emulates "
        "that chip, every forward pass is held to the profile's predicted time for its batch "
        "(pdd.step_profile.MeasuredStepModel; at least min_step_ms); None: off")

    @field_validator("page_size")
    @classmethod
    def _page_size(cls, v: int) -> int:
        """A power of two: KV crossing between tiers of different page sizes is re-chunked
        (pdd.transfer.layout), and cache matches stay whole pages of either side."""
        if v & (v - 1):
            raise ValueError(f"page_size must be a positive power of two, got {v}")
        return v

    @field_validator("profile")
    @classmethod
    def _profile(cls, v: str | None) -> str | None:
        """The file must exist and be a pdd-profile/1 with enough rows to fit (read at load, not
        as one instance's start-up error). Raises ValueError."""
        if v is None:
            return v
        try:
            mtime = Path(v).stat().st_mtime_ns
        except OSError:
            mtime = None
        _checked_profile(v, mtime)
        return v

    @model_validator(mode="after")
    def _fits(self) -> "EngineConfig":
        """A page fits in one sequence of max_model_len tokens. Raises ValueError."""
        if self.page_size > self.max_model_len:
            raise ValueError(f"page_size {self.page_size} does not fit max_model_len {self.max_model_len}")
        return self

    @model_validator(mode="after")
    def _pool_fits(self) -> "EngineConfig":
        """The KV pool (``num_pages x page_size`` tokens) holds one sequence of ``max_model_len``
        tokens, as vLLM requires at start-up: else a request with no output limit is admitted and
        fails part-way with ``OutOfPages`` once its context outgrows the pool. Given larger,
        ValueError naming both; left out, ``max_model_len`` is the pool's tokens (still not
        counted as given: ``model_fields_set``)."""
        pool = self.num_pages * self.page_size
        if pool < self.max_model_len:
            if "max_model_len" in self.model_fields_set:
                raise ValueError(f"max_model_len {self.max_model_len} is above the KV pool (num_pages {self.num_pages} "
                                 f"x page_size {self.page_size} = {pool} tokens): one sequence that long cannot be "
                                 f"held; raise num_pages or lower max_model_len")
            _derive(self, "max_model_len", pool)
        return self

    @model_validator(mode="after")
    def _input_fits(self) -> "EngineConfig":
        """``max_input_len`` <= ``max_model_len``: a longer prompt passes the gateway's input check
        only to be refused by the context check. Given larger, ValueError naming both; left out
        under a ``max_model_len`` below its default (4000), it is ``max_model_len`` (a block that
        lowers only ``max_model_len`` stays valid, and so does its dump read back)."""
        if self.max_input_len > self.max_model_len:
            if "max_input_len" in self.model_fields_set:
                raise ValueError(f"max_input_len {self.max_input_len} is above max_model_len {self.max_model_len} "
                                 f"(prompt + output tokens): no prompt that long fits; lower max_input_len or raise "
                                 f"max_model_len")
            _derive(self, "max_input_len", self.max_model_len)
        return self

    @field_validator("device")
    @classmethod
    def _device(cls, v: str) -> str:
        """Refused at load, not as a torch error in every engine: only CPU and CUDA are supported."""
        if not re.fullmatch(r"cpu|cuda(:\d+)?", v):
            raise ValueError(f"device must be 'cpu', 'cuda' or 'cuda:N', got {v!r}")
        return v


def _derive(model: BaseModel, field: str, value) -> None:
    """Set a field a validator derives (a default lowered to fit) without counting it as given
    (``model_fields_set``): a later check (:meth:`ClusterConfig._tiers`) may lower it again, and
    refuses only what the config itself set."""
    setattr(model, field, value)
    model.__pydantic_fields_set__.discard(field)


@functools.lru_cache(maxsize=64)
def _checked_profile(path: str, mtime_ns: int | None) -> None:
    """Load (and fit) the profile once per file version; raises ValueError as
    ``pdd.step_profile.load_step_model``."""
    from pdd.step_profile import load_step_model

    load_step_model(path)


class LinkConfig(_Strict):
    """The emulated links.

    ``wan_*``: the one line between datacenter A and B that every A<->B byte crosses.
    ``fast_*``: the in-datacenter path P -> RLD (stands in for RDMA).
    """

    wan_gbps: float = Field(0.05, gt=0, description="WAN line rate per direction, Gbit/s (>= 1e-6: 1 kbit/s)")
    wan_rtt_ms: float = Field(20.0, ge=0, le=MAX_LINE_DELAY_MS, description="WAN round trip, ms (<= 60,000)")
    wan_jitter_ms: float = Field(1.0, ge=0, le=MAX_LINE_DELAY_MS)
    fast_gbps: float = Field(4.0, gt=0, description="fast path rate, Gbit/s (paced at the sender; >= 1e-6)")
    fast_rtt_ms: float = Field(0.1, ge=0, le=MAX_LINE_DELAY_MS)
    wan_loss_rate: float = Field(
        0.0, ge=0, lt=1, description="WAN packet loss probability p: each connection's throughput is capped at "
        "TCP's loss-limited rate MSS*8/RTT * sqrt(3/2)/sqrt(p) (Mathis et al. 1997; pdd.policy.tcp_model); 0 = no cap")
    wan_mss_bytes: int = Field(1460, ge=64, le=65535, description="TCP segment size in that formula, bytes")
    wan_connections: int = Field(
        1, ge=1, le=16, description="connections P's bulk KV lane to each WAN target is striped over (frames of "
        "one transfer go over all of them, reassembled in order at the receiver; the express lane stays one "
        "connection of its own); 1 = one connection (pdd.transfer.kv.KVSender, docs/LINK.md)")
    wan_cross_traffic: list[tuple[float, float]] = Field(
        default_factory=list, description="other traffic sharing the WAN line, per direction: [[t_s, gbps], ...] "
        "from t_s seconds after the line started, piecewise constant, 0 before the first point; each rate below "
        "wan_gbps (pdd bench --cross-traffic-gbps X / --cross-traffic 0:0.5,10:2.0)")

    @field_validator("wan_gbps", "fast_gbps")
    @classmethod
    def _line_rate(cls, v: float, info: ValidationInfo) -> float:
        """At least ``pdd.policy.tcp_model.MIN_LINK_GBPS`` (1e-6 Gbit/s): a subnormal rate
        (1e-312) passed ``gt=0`` and overflowed the emulated line's chunk times. Raises ValueError."""
        slow = slow_line_problem(v, "")  # the location names the field (link.wan_gbps / --wan-gbps)
        if slow:
            raise ValueError(slow)
        return v

    @field_validator("wan_cross_traffic")
    @classmethod
    def _cross(cls, v: list, info: ValidationInfo) -> list:
        """Times >= 0 and increasing, rates >= 0 and below the line's (``wan_gbps``). Raises ValueError."""
        from pdd.policy.tcp_model import check_schedule

        return [tuple(p) for p in check_schedule(v, "", info.data.get("wan_gbps"))]


class PolicyConfig(_Strict):
    """Knobs of the pure policy layer (pdd.policy)."""

    pipeline_ttft_budget_ms: float = Field(
        50.0,
        ge=0,
        description="P->MD is chosen when the missing KV's expected WAN time (RTT + missing bytes "
        "at the WAN rate) fits this budget, so short and well-cached requests skip the relay; 0 "
        "always relays in pdd mode. The default's measurements: docs/BENCH.md \"Choosing the "
        "pipeline budget\"",
    )
    handoff_mode: Literal["one_shot", "catch_up", "auto"] = "one_shot"
    catchup_threshold_tokens: int = Field(64, ge=1)
    wan_order: Literal["fifo", "srf"] = "fifo"
    wan_send_buffer_bdp: float = Field(
        1.0,
        ge=0,
        description="kernel send buffer of P's WAN KV connections, in bandwidth-delay products of the "
        "line (at least 64 KiB; pdd.policy.wan_order.send_buffer_bytes): bytes past it wait for the "
        "send order; 0 = the OS default (autotuned, MBs, which the order cannot reorder)",
    )
    wan_express_lane_bdp: float = Field(
        2.0,
        ge=0,
        description="P's WAN transfers of at most this many bandwidth-delay products of the line take a "
        "second connection to the target (the express lane), so a high-hit increment shares the line with a "
        "large transfer instead of waiting behind what its connection committed "
        "(pdd.policy.wan_order.wan_lane); 0 = one connection per target (ablation)",
    )
    kv_whole_pages: bool = Field(
        False,
        description="ablation: send a prompt's partial last KV page whole (page-granular, as block "
        "transfers do) instead of its filled token slots only (pdd.transfer.kv.prompt_kv_bytes)",
    )
    wan_probe_interval_s: float = Field(
        0.0, ge=0, description="the gateway probes each WAN MD that got no KV receive sample nor probe for this many "
        "seconds (a timed empty and a wan_probe_bytes request: RTT and goodput samples of its estimate, "
        "pdd.policy.wan_estimate.probe_due); 0 = off")
    wan_probe_bytes: int = Field(
        131072, ge=0, le=16 << 20, description="payload bytes of a WAN probe's second request (its goodput "
        "sample); 0 = RTT only")
    kv_stream: Literal["whole", "layerwise"] = Field(
        "whole", description="when P sends a request's KV: 'whole' after its prefill (and first token); "
        "'layerwise' each layer group's pages of the prompt as soon as that group's forward pass over the "
        "prefill chunk is done, so the WAN and the fast path start before the prefill ends (docs/LINK.md)")
    kv_stream_layer_group: int = Field(
        1, ge=1, description="layerwise: layers per wire unit (request, layer range, page range); a model whose "
        "layer count it does not divide gets a shorter last group")
    sibling_kv_once: bool = Field(
        True, description="the n choices of a prompt ship its KV across the WAN once: the others reserve on the "
        "first choice's MD after its KV arrived, when copies would cost the line more than a round trip "
        "(pdd.policy.siblings); false: every choice ships its own (ablation)")
    md_wait_claims: bool = Field(
        True, description="a request whose prefix the gateway's index of its MD holds as another request's claim "
        "(routed there, its KV still crossing the WAN) reserves there once that KV is in MD's cache (reserve "
        "{after}) and ships only what MD then lacks, when relayed before MD's reservation or when that KV is "
        "already being sent; its TTFT budget is judged on the landed prefix. false: MD matches only what landed "
        "and the claimed pages cross again (ablation; with the cut-off off they ran the WAN away in the simulator)")
    md_predicted_send: bool = Field(
        True, description="a request relayed before MD's reservation (pdd, zero TTFT budget) also starts MD's WAN "
        "send before it: P sends the pages the gateway's prefix index says MD lacks at once, MD caps its match "
        "there and any pages it lacks besides follow as a second transfer once its reply is in; false: MD's send "
        "waits a WAN round trip for the reservation (ablation)")
    early_handoff: bool = Field(
        True, description="a relayed request's handoff starts once P has written MD's KV to the WAN and it is "
        "predicted to land (at the live WAN rate) a one-way delay later, so RLD's ids cross beside the KV's last "
        "bytes; MD's extend waits for the KV if they come first. false: the handoff waits for MD's kv_ready to "
        "cross back (ablation)")
    md_route_peek: bool = Field(
        False, description="ablation: cache-aware routing asks each main-decode instance across the WAN what its "
        "cache holds (a round trip before the reservation) instead of the gateway's own record of what it routed "
        "there (pdd.policy.prefix_index)")
    load_slack: int = Field(
        LOAD_SLACK, ge=0, description="cache-aware routing on prefill and colocated instances (requests): the one "
        "holding the longest prefix of the prompt is chosen only while it has at most this many more requests in "
        "flight than the idlest (pdd.policy.routing; relay-decode holds no cache and is routed by load). The "
        "simulator's SimConfig.load_slack, one default (pdd.policy.routing.LOAD_SLACK)")
    md_load_slack: int = Field(
        MD_LOAD_SLACK, ge=0, description="load_slack on main-decode instances (requests): larger, since a decoder "
        "holds tens of sequences and a prefix it holds saves that KV's transfer across the WAN. The simulator's "
        "SimConfig.md_load_slack, one default (pdd.policy.routing.MD_LOAD_SLACK)")
    md_load_cap: int = Field(
        0, ge=0, description="an MD with this many requests in flight is routed to only when every MD has as "
        "many (0: no cap). Set it to the decode batch that meets the TPOT SLO at the workload's context "
        "(pdd.sim.experiments.slo_batch): cache-aware routing's slack otherwise lets the MD holding the most "
        "requested prefixes run past it while other MDs idle (pdd.policy.routing)")
    wan_estimate: Literal["live", "config"] = Field(
        "live", description="what the pipeline choice and cache-aware MD routing read for each MD's WAN path: "
        "live, its measured goodput (median of MD's recent KV receive rates) and RTT (minimum of recent reservation "
        "round trips), the configured link until measured (pdd.policy.wan_estimate.PeerWanEstimates); config, the "
        "configured link.wan_gbps (capped at the configured loss's TCP rate) and link.wan_rtt_ms (baseline)")
    routing: Literal["cache_aware", "load", "round_robin"] = Field(
        "cache_aware", description="instance choice for P and MD (RLD: load unless round_robin)")
    allow_p_rld: bool = False
    cutoff: bool = Field(True, description="anomaly filter: cancel the WAN transfer of a request RLD finished first")
    cutoff_min_remaining_s: float = Field(
        0.5, ge=0,
        description="cut off only when the rest of the transfer would take at least this long at the live WAN "
        "rate; shorter remainders finish, so MD's cache keeps the prompt for the next turn (0: always cut off)")
    cutoff_max_sent_fraction: float = Field(
        0.25, ge=0, le=1,
        description="let a transfer finish, whatever its remaining time, once MD has reported this share of its "
        "bytes received: a cut-off throws away what was sent and the next turn sends it all again "
        "(pdd.policy.cutoff.should_cut_off; 1: only the remaining time decides)")
    cancel_on_disconnect: bool = Field(
        True, description="the gateway watches a request's connection while it starts (P prefilling, RLD and MD "
        "reserving): a client gone before its first byte aborts it on every tier, P at its next prefill chunk "
        "boundary (pdd.gateway.disconnect); false: the start runs to P's first token and the disconnect is seen "
        "when the response begins (baseline)")
    handoff_min_tokens: int = Field(
        0,
        ge=0,
        description="hand over only once RLD has streamed at least this many tokens (0: as soon as "
        "MD has its KV and RLD has streamed its first). For tests and experiments that force the "
        "handoff point; a request that finishes first is never handed over",
    )


# policy settings that act on the relay tier or the pipeline choice, which only pdd mode has
# (pdd.policy.pipeline.choose_pipeline, the relay decoder's handoff, the cut-off of a relayed
# request's WAN transfer): in colocated, same_dc_pd and cross_dc_pd they change nothing
PDD_ONLY_POLICY: tuple[str, ...] = (
    "pipeline_ttft_budget_ms", "allow_p_rld", "handoff_mode", "catchup_threshold_tokens", "early_handoff",
    "md_predicted_send", "handoff_min_tokens", "cutoff", "cutoff_min_remaining_s", "cutoff_max_sent_fraction")


class SecurityConfig(_Strict):
    """Security of the links (``pdd.security``; docs/SECURITY.md)."""

    tls: bool = Field(
        True,
        description="mutual TLS on every connection that leaves a datacenter and on all control traffic "
        "(gateway <-> instances); false is the off switch for benchmarking (plain, unauthenticated)",
    )
    fast_path: Literal["mac", "tls", "plain"] = Field(
        "mac",
        description="the in-datacenter fast path P -> RLD (stands in for RDMA): a keyed MAC on every frame "
        "(a frame that fails it is dropped and its connection closed), TLS, or plain",
    )
    cert_dir: str | None = Field(
        None,
        description="CA, per-instance certificates and fastpath.key (pdd certs); None: pdd serve and the "
        "demo make them in <log_dir>/certs",
    )
    api_keys: list[str] = Field(
        default_factory=list,
        description="gateway API keys (Authorization: Bearer KEY); empty: no key needed. Each a non-empty string "
        "without surrounding whitespace or control characters (what an HTTP header can carry)",
    )

    @field_validator("api_keys")
    @classmethod
    def _api_keys(cls, v: list[str]) -> list[str]:
        """Every key one a client can send: the gateway's ``pdd.security.ApiKeyMiddleware`` drops
        empty keys (``['']`` alone meant no auth, caught only by pdd serve's start-up check after the
        whole topology started) and compares the header's value trimmed, so a key with whitespace
        around it, or a control character an HTTP header cannot carry, could never match. Raises
        ValueError naming the key by position, not its text (a secret)."""
        for i, key in enumerate(v):
            which = f"key {i + 1} of {len(v)}"
            if not key.strip():
                raise ValueError(f"{which} is empty or only whitespace: no client can send it (the gateway drops an "
                                 f"empty key; with no other key it would serve without auth); give a key or leave "
                                 f"it out")
            if key != key.strip():
                raise ValueError(f"{which} has whitespace before or after it, which no Authorization header can "
                                 f"carry (the value is trimmed): it could never match; remove the whitespace")
            if any(ord(c) < 0x20 and c != "\t" or ord(c) == 0x7F for c in key):
                raise ValueError(f"{which} holds a control character, which no HTTP header can carry: it could "
                                 f"never match")
        return v


class LimitsConfig(_Strict):
    """Overload protection (docs/OVERLOAD.md): gateway admission and bounded tier queues.

    What the gateway cannot take gets HTTP 429 with ``Retry-After`` (``pdd.gateway.admission``).
    A ``None`` limit is derived from the tiers' own sizes (``engine.max_running``, the KV pool) and
    instance counts, as stated per field; 0 turns that limit off. The latency targets
    (``max_queue_wait_s``, ``ttft_target_ms``, ``tpot_target_ms``) are the operator's SLO and off
    by default.
    """

    max_inflight_requests: int | None = Field(
        None, ge=0,
        description="requests (choices) in flight at the gateway; None: the decode tier's batch slots plus its "
        "queues, i.e. (engine.max_running + tier_max_waiting) x decode instances")
    max_queue_wait_s: float = Field(
        0.0, ge=0,
        description="refuse a request when the prompt tokens queued for prefill (its own included) would take "
        "longer than this to drain at P's measured prefill rate (tokens/s, busy periods only); 0: off")
    max_queued_prompt_tokens: int | None = Field(
        None, ge=0,
        description="prompt tokens admitted and not yet prefilled; None: P's KV pool in tokens (engine.num_pages "
        "x engine.page_size x prefill instances): more than that cannot be in prefill at once")
    tier_max_waiting: int | None = Field(
        None, ge=0,
        description="sequences an engine holds beyond one full batch (engine.max_running) before it refuses new "
        "ones with TierBusy (the gateway answers 429); a request with more choices than the decoding tier's "
        "max_running + this hold together (or more prefills at once than P's) is refused up front with 400 "
        "(docs/OVERLOAD.md); None: engine.max_running")
    retry_after_max_s: int = Field(30, ge=1, description="cap of the Retry-After seconds a 429 carries")
    ttft_target_ms: float = Field(
        0.0, ge=0,
        description="adaptive in-flight limit (AIMD, pdd.gateway.admission.next_limit): a request whose first "
        "token took longer than this at the gateway (admission to first token) shrinks the limit x0.75, one "
        "under it grows it; set it below the TTFT SLO (docs/OVERLOAD.md uses half); 0: off")
    tpot_target_ms: float = Field(
        0.0, ge=0, description="as ttft_target_ms for a finished request's mean time per output token; 0: off")
    min_inflight_requests: int = Field(
        2, ge=1, description="the adaptive limit never goes below this (nor above max_inflight_requests)")
    max_wan_backlog_s: float = Field(
        0.0, ge=0,
        description="refuse new requests while the KV planned for the WAN and not yet sent would take longer than "
        "this at the live WAN rate (the relay keeps TTFT low while MD's transfers pile up; MD's queue fills "
        "behind them); 0: off")

    def waiting(self, max_running: int) -> int:
        """Sequences an engine may hold beyond ``max_running`` (``tier_max_waiting``, default one batch)."""
        return max_running if self.tier_max_waiting is None else self.tier_max_waiting


class LivenessConfig(_Strict):
    """Dead-peer detection and recovery (``pdd.transfer.peer`` heartbeats, the gateway's recovery).

    Every persistent connection between pdd processes sends a heartbeat frame each
    ``heartbeat_interval_s``; a side that has received no byte for ``dead_after_s`` (bytes of a
    slow KV stream count) closes the connection, so a dead or unreachable peer (SIGKILL, WAN
    outage: packets dropped, no reset) is found in seconds. A KV chunk whose write makes no
    progress for ``kv_stall_timeout_s`` while it is the one being sent closes its connection.
    """

    heartbeat_interval_s: float = Field(1.0, gt=0, description="seconds between heartbeat frames")
    dead_after_s: float = Field(5.0, gt=0, description="no byte received for this long: the peer is dead")
    kv_stall_timeout_s: float = Field(
        30.0, gt=0, description="one KV chunk's write blocked this long (while scheduled to send): fail the link")
    recovery_attempts: int = Field(
        2, ge=0, description="times a request whose tier died is re-prefilled (prompt + streamed tokens) elsewhere")
    reconnect_interval_s: float = Field(
        1.0, gt=0, description="the gateway tries to reach every instance whose connection is closed this often "
        "(a restarted instance rejoins, and /health recovers, without waiting for traffic)")

    @model_validator(mode="after")
    def _dead_after_spans_heartbeats(self) -> "LivenessConfig":
        """``dead_after_s`` >= 2 x ``heartbeat_interval_s``: a quiet peer shows life only once per
        heartbeat, and silence is looked for once per heartbeat too, so a shorter wait declares
        live peers dead whenever one heartbeat is late (``dead_after_s: 0.1`` with
        ``heartbeat_interval_s: 5`` dropped every idle connection every 5 s, the gateway's to each
        instance and md0's to the gateway, and recovered their requests). Raises ValueError."""
        if self.dead_after_s < 2 * self.heartbeat_interval_s:
            raise ValueError(f"dead_after_s {self.dead_after_s:g} must be at least twice heartbeat_interval_s "
                             f"{self.heartbeat_interval_s:g} (a quiet peer shows life once per heartbeat: a "
                             f"shorter wait declares live peers dead); raise dead_after_s or lower "
                             f"heartbeat_interval_s")
        return self


class InstanceCounts(_Strict):
    """How many instances of each tier (modes without a tier ignore its count)."""

    prefill: int = Field(1, ge=1, le=10)
    relay_decode: int = Field(1, ge=1, le=10)
    main_decode: int = Field(1, ge=1, le=10)


TIERS: tuple[str, ...] = ("prefill", "relay_decode", "main_decode", "colocated")
# instance names of pdd.topology.layout: prefix -> (tier, the InstanceCounts field that counts them)
_INSTANCE_PREFIX = {"p": ("prefill", "prefill"), "rld": ("relay_decode", "relay_decode"),
                    "md": ("main_decode", "main_decode"), "d": ("main_decode", "main_decode"),
                    "c": ("colocated", "prefill")}
TIER_ENGINE_FIELDS: tuple[str, ...] = (
    "device", "dtype", "page_size", "num_pages", "max_batch_tokens", "prefill_chunk_tokens", "prefill_order",
    "max_running", "min_step_ms", "profile", "torch_threads")


def instance_tier(name: str) -> str | None:
    """The tier of an instance name of ``pdd.topology.layout`` (``p0`` -> prefill, ``rld1`` ->
    relay_decode, ``md0`` / ``d0`` -> main_decode, ``c0`` -> colocated), or None."""
    m = re.fullmatch(r"(rld|md|p|d|c)(\d+)", name)
    return _INSTANCE_PREFIX[m.group(1)][0] if m else None


class TierEngine(_Strict):
    """A tier's (or one instance's) own engine settings: the emulated hardware it runs on. Every
    field left out inherits the top-level ``engine`` block (an instance's block: its tier's
    first). The merged block is checked as an ``EngineConfig``. ``max_model_len`` and
    ``max_input_len`` are not here: the gateway applies them to every request, whatever tier, so
    every block's pool holds ``max_model_len`` tokens (:meth:`ClusterConfig._pools_fit`)."""

    device: str | None = None
    dtype: str | None = None
    page_size: int | None = None
    num_pages: int | None = None
    max_batch_tokens: int | None = None
    prefill_chunk_tokens: int | None = None
    prefill_order: str | None = None
    max_running: int | None = None
    min_step_ms: float | None = None
    profile: str | None = None
    torch_threads: int | None = None


class TierConfig(_Strict):
    """One entry of ``tiers``: ``{engine: {...}}``."""

    engine: TierEngine = TierEngine()


class VllmTierConfig(_Strict):
    """``vllm``: run a tier on vLLM's own engine through pdd's KV connector (docs/VLLM_TIER.md)."""

    main_decode: bool = Field(
        False, description="every main-decode instance is pdd's MD endpoint (wire, DRC, staging) in front of a vLLM "
        "server it starts with pdd.vllm_tier.connector.PddConnector (pdd.vllm_tier.md); P and RLD stay pdd's")
    python: str | None = Field(
        None, description="Python of vLLM's venv (default: $PDD_VLLM_PYTHON, else .venv-vllm/bin/python: `make vllm`)")
    kvcache_gib: int = Field(1, ge=1, description="VLLM_CPU_KVCACHE_SPACE of the vLLM server, GiB")
    start_timeout_s: float = Field(400.0, gt=0, description="seconds the vLLM server may take to be ready")
    extra_args: list[str] = Field(default_factory=list, description="more arguments of vLLM's OpenAI server")


class AutoscaleConfig(_Strict):
    """The planner in the loop (``pdd serve --autoscale``; ``pdd.gateway.autoscale`` applies the
    rule of ``pdd.policy.autoscale``; docs/SERVE.md "Autoscaling"). Off by default."""

    enabled: bool = Field(False, description="run the autoscaling loop in the gateway (pdd serve --autoscale)")
    interval_s: float = Field(5.0, ge=0.1, description="seconds between decisions (>= 0.1)")
    sample_s: float = Field(0.25, ge=0.01, description="seconds between load samples within an interval (>= 0.01, "
                            "at most interval_s)")
    cooldown_s: float = Field(30.0, ge=0, description="no change within this many seconds of the last one")
    min: dict[Literal["prefill", "relay_decode", "main_decode", "colocated"], int] = Field(
        default_factory=dict, description="fewest active instances per role (default 1; at least 1)")
    max: dict[Literal["prefill", "relay_decode", "main_decode", "colocated"], int] = Field(
        default_factory=dict, description="most active instances per role (at most its slots, instances.<role>); "
        "a role not named is not scaled")
    up_at: float = Field(0.75, gt=0, le=1, description="scale a role up when its interval's mean utilisation "
                         "(in-flight / (active * max_running)) reaches this")
    down_at: float = Field(0.25, ge=0, description="scale down at or below this; must be < up_at / 2 (no flapping)")
    start: bool = Field(True, description="the gateway starts the process of a slot it adds (pdd serve); false: "
                        "the slot's instance must already run (pdd launch)")

    @model_validator(mode="after")
    def _rule(self) -> "AutoscaleConfig":
        for role, n in self.min.items():
            if n < 1:
                raise ValueError(f"min.{role}: must be >= 1 (the last active instance of a role is never removed)")
        for role, n in self.max.items():
            if n < self.min.get(role, 1):
                raise ValueError(f"max.{role}: {n} is below min.{role} ({self.min.get(role, 1)})")
        if self.enabled and not self.max:
            raise ValueError("max: name the roles to scale and their most active instances (e.g. {main_decode: 2}); "
                             "with none the loop would change nothing")
        if self.sample_s > self.interval_s:
            raise ValueError(f"sample_s: {self.sample_s:g} must be <= interval_s ({self.interval_s:g}): a decision "
                             "reads the load sampled within its interval")
        if self.down_at >= self.up_at / 2:
            raise ValueError(f"down_at: {self.down_at} must be < up_at / 2 = {self.up_at / 2} (hysteresis: no "
                             "flapping)")
        return self


class ConfigFileError(ValueError):
    """A config file that does not hold a mapping of config fields (:meth:`ClusterConfig.load`):
    not UTF-8 text, not YAML / JSON, or its top level a list, string, number or boolean. The
    message (one line) starts with the file's path; the CLIs print it as a usage error naming
    ``--config``."""


def _kind(x) -> str:
    """What a parsed config's top level is, in JSON's words (``a list``, ``a number``, ...)."""
    if isinstance(x, bool):
        return "a boolean"
    if isinstance(x, (int, float)):
        return "a number"
    if isinstance(x, _BareNonFinite):
        return f"{x} (not a valid JSON number)"
    return {str: "a string", list: "a list"}.get(type(x), f"a {type(x).__name__}")


class _ConfigLoader(yaml.SafeLoader):
    """PyYAML's safe loader, with YAML 1.2's (and JSON's) numbers in exponent form: unquoted
    ``1e3``, ``5e-7`` and ``1.0e12`` are floats. YAML 1.1 reads them as strings (its floats need
    a dot and a signed exponent), which a config's number fields refuse as quoted text. A key
    given twice in one mapping is refused (``engine: {page_size: 16, page_size: 32}``: PyYAML
    kept the last, silently)."""

    def construct_mapping(self, node, deep=False):
        """The mapping of ``node``; ``yaml.constructor.ConstructorError`` naming a key given twice
        in it and both lines (a key a ``<<`` merge brings in may be overridden, as YAML allows)."""
        if isinstance(node, yaml.MappingNode):
            first: dict = {}
            for key_node, _ in node.value:
                if not isinstance(key_node, yaml.ScalarNode) or key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node)
                try:
                    seen = first.setdefault(key, key_node.start_mark)
                except TypeError:  # an unhashable key: the base class says so
                    continue
                if seen is not key_node.start_mark:
                    raise yaml.constructor.ConstructorError(
                        None, None, f"duplicate key {key!r}, given first on line {seen.line + 1}", key_node.start_mark)
        return super().construct_mapping(node, deep=deep)


_ConfigLoader.add_implicit_resolver(
    "tag:yaml.org,2002:float", re.compile(r"^[-+]?(?:[0-9][0-9_]*(?:\.[0-9_]*)?|\.[0-9_]+)[eE][-+]?[0-9]+$"),
    list("-+0123456789."))


class _BareNonFinite(str):
    """An unquoted ``NaN``, ``Infinity`` or ``-Infinity`` (any case, ``inf`` too) in a config file:
    what Python's ``json.dumps`` writes for a non-finite float, which JSON does not allow and
    YAML reads as text. It stays that text (a field that takes text keeps it); a number field
    refuses it as not a valid JSON number rather than as "the string 'NaN'", which the file
    did not quote."""


_ConfigLoader.add_implicit_resolver("tag:pdd,2026:bare-non-finite",
                                    re.compile(r"^[-+]?(?i:nan|inf|infinity)$"), list("-+nNiI"))
_ConfigLoader.add_constructor("tag:pdd,2026:bare-non-finite",
                              lambda loader, node: _BareNonFinite(loader.construct_scalar(node)))


MAX_CONFIG_BYTES = 1 << 20  # a config file's size; the largest in the repo is a few KiB
MAX_CONFIG_DEPTH = 64  # lists and mappings nested in a config file (its fields nest at most 4)
# values (lists, mappings, scalars) in a config once YAML aliases are expanded: more than an alias-free
# file of MAX_CONFIG_BYTES could hold of any real config (the largest in the repo has a few hundred)
MAX_CONFIG_NODES = 100_000
_TOO_MANY = (f"holds more than {MAX_CONFIG_NODES:,} values once its YAML aliases are expanded (lists, mappings and "
             "scalars); no config is that large (an alias bomb?)")
_TOO_DEEP = (f"nested too deeply: lists and mappings (JSON arrays and objects) may nest at most {MAX_CONFIG_DEPTH} "
             "levels deep")


def _read_config_bytes(path) -> bytes:
    """The bytes of config file ``path``, at most :data:`MAX_CONFIG_BYTES` (``pdd.files.read_bytes``):
    ConfigFileError (one line naming the file) when it is not a regular file or is larger;
    IsADirectoryError for a directory; OSError when it cannot be opened."""
    from pdd import files

    try:
        return files.read_bytes(path, MAX_CONFIG_BYTES, what="give a YAML or JSON file")
    except files.InputFileError as e:
        raise ConfigFileError(str(e)) from None


def _height(data) -> float:
    """How deeply lists and dicts nest in ``data`` (a scalar 0, ``[]`` 1, ``{"a": [1]}`` 2);
    infinite for a cycle (YAML ``&a [*a]``). Iterative, and each shared object (a YAML alias) is
    walked once: no RecursionError, no blow-up on nested aliases."""
    memo: dict[int, float] = {}
    path: set[int] = set()
    stack: list = [(data, False)]
    while stack:
        o, done = stack.pop()
        if not isinstance(o, (dict, list)):
            continue
        kids = [k for k in (o.values() if isinstance(o, dict) else o) if isinstance(k, (dict, list))]
        if done:
            path.discard(id(o))
            memo[id(o)] = 1 + max((memo[id(k)] for k in kids), default=0)
            if memo[id(o)] > MAX_CONFIG_DEPTH:
                return memo[id(o)]
        elif id(o) in path:
            return float("inf")
        elif id(o) not in memo:
            path.add(id(o))
            stack.append((o, True))
            stack.extend((k, False) for k in kids)
    return memo.get(id(data), 0)


def _expanded_size(data, cap: int = MAX_CONFIG_NODES) -> int:
    """How many values (each list, dict, key and scalar) ``data`` holds with every shared object (a
    YAML alias) counted each time it appears, as pydantic's validation walks it; stops counting
    past ``cap`` (returns a number above it). ``data`` must hold no cycle (:func:`_height` finds
    them). Iterative; each shared object is sized once, so a "billion laughs" file of a few
    hundred bytes is sized in microseconds."""
    memo: dict[int, int] = {}
    stack: list = [(data, False)]
    while stack:
        o, done = stack.pop()
        if not isinstance(o, (dict, list)) or (id(o) in memo and not done):
            continue
        kids = [k for k in (o.values() if isinstance(o, dict) else o) if isinstance(k, (dict, list))]
        if done:
            n = 1 + (2 * len(o) if isinstance(o, dict) else len(o)) - len(kids)  # itself, its keys and scalars
            memo[id(o)] = min(cap + 1, n + sum(memo[id(k)] for k in kids))
        else:
            stack.append((o, True))
            stack.extend((k, False) for k in kids)
    return memo.get(id(data), 1)


class _JsonConfigDecoder(json.JSONDecoder):
    """JSON as Python's ``json`` reads it, with the YAML loader's rules for a config: a bare
    ``NaN`` / ``Infinity`` is :class:`_BareNonFinite`, and a key given twice in one object raises
    ``json.JSONDecodeError`` at its second place, naming the line of its first."""

    def __init__(self):
        super().__init__(parse_constant=_BareNonFinite)
        self.parse_object = self._object
        self.scan_once = json.scanner.py_make_scanner(self)  # (the C scanner calls no parse_object)

    @staticmethod
    def _object(s_and_end, strict, scan_once, object_hook, object_pairs_hook, memo=None):
        s, start = s_and_end
        pairs, end = json.decoder.JSONObject(s_and_end, strict, scan_once, None, list, memo)
        if len({k for k, _ in pairs}) == len(pairs):
            return dict(pairs), end
        ws, first, i = json.decoder.WHITESPACE.match, {}, start  # parsed already: walk it for the keys' places
        while True:
            i = ws(s, i).end()
            key, j = json.decoder.scanstring(s, i + 1, strict)
            if key in first:
                line = s.count("\n", 0, first[key]) + 1
                raise json.JSONDecodeError(f"duplicate key {key!r}, given first on line {line}", s, i)
            first[key] = i
            j = scan_once(s, ws(s, ws(s, j).end() + 1).end())[1]  # past ':' and the value
            i = ws(s, j).end() + 1  # past ','


def _json_problem(e: json.JSONDecodeError) -> str:
    """Python's JSON error on one line, its place as :func:`_yaml_problem` gives it (line and
    column from 1), not "line 4 column 1 (char 43)"."""
    return f"{e.msg} (line {e.lineno}, column {e.colno})"


def _yaml_problem(e: yaml.YAMLError) -> str:
    """PyYAML's error on one line: what is wrong and where (line and column from 1), not its
    several lines that show the text as "<unicode string>" with a caret under the column."""
    if isinstance(e, yaml.reader.ReaderError):
        return f"unacceptable character #x{e.character:04x} at position {e.position}: {e.reason}"
    if isinstance(e, yaml.MarkedYAMLError) and e.problem:
        mark = e.problem_mark or e.context_mark
        at = f" (line {mark.line + 1}, column {mark.column + 1})" if mark is not None else ""
        return (f"{e.context}: " if e.context else "") + e.problem + at
    return " ".join(str(e).split())


def check_served_model_name(name: str) -> str:
    """``name`` if it can be a served model name (what clients send as ``"model"`` and
    ``/v1/models`` lists); ValueError for an empty or whitespace-only one. The rule of
    ``served_model_name`` in a config, and of the flags that set it (``pdd bench --model``)."""
    if not name.strip():
        raise ValueError(f'served_model_name must be the name clients send as "model", not empty nor only '
                         f"whitespace; got {name!r}")
    return name


_HOST_LABEL = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?")


def _check_host(host: str) -> str:
    """``host`` (the config's) if the topology can listen on it: an IP address (IPv4, IPv6: ``127.0.0.1``,
    ``0.0.0.0``, ``::1``) or a hostname by RFC 1123's syntax (``localhost``, ``node-1.dc.example``:
    dot-separated labels of letters, digits and hyphens, 1-63 characters each, no hyphen at
    either end, 253 at most, one trailing dot allowed; the last label not all digits, which
    would be a malformed IPv4 address). No DNS lookup. ValueError otherwise (the config names
    the field): an empty host started the topology and failed later with socket.gaierror, and ``'not a host!'``
    was reported as its ports already in use."""
    import ipaddress

    try:
        ipaddress.ip_address(host)
        return host
    except ValueError:
        pass
    name = host[:-1] if host.endswith(".") else host
    labels = name.split(".")
    if (name and len(name) <= 253 and all(_HOST_LABEL.fullmatch(x) for x in labels)
            and not labels[-1].isdigit()):
        return host
    raise ValueError(f"must be an IP address (e.g. 127.0.0.1, 0.0.0.0, ::1) or a hostname (RFC 1123: "
                     f"dot-separated labels of letters, digits and hyphens, e.g. localhost), got {shown(host)}")


_ORIGIN = re.compile(r"[a-z][a-z0-9+.-]*://(\[[0-9a-f:.]+\]|[a-z0-9.-]+)(:[0-9]{1,5})?")
_METHOD = re.compile(r"[A-Z]+")
_HEADER_NAME = re.compile(r"[A-Za-z0-9!#$%&'*+.^_`|~-]+")  # an HTTP token (RFC 9110 5.6.2)


class CorsConfig(_Strict):
    """``cors``: which web pages may call the gateway from a browser (CORS; Starlette's
    CORSMiddleware, as vLLM's ``--allowed-origins``, ``--allow-credentials``, ``--allowed-methods``,
    ``--allowed-headers`` and their defaults: no origin, so no cross-origin access)."""

    allowed_origins: list[str] = Field(
        default_factory=list,
        description="origins (scheme://host[:port], as a browser's Origin header has it: lowercase, no path or "
        "trailing slash) whose pages may call the gateway, or '*' for any; empty: none (vLLM's default)")
    allow_credentials: bool = Field(
        False, description="let those pages send cookies / HTTP auth (Access-Control-Allow-Credentials); with '*' "
        "every origin is then answered by name")
    allowed_methods: list[str] = Field(
        default_factory=lambda: ["*"], description="methods a cross-origin request may use (GET, POST, ...), '*': any")
    allowed_headers: list[str] = Field(
        default_factory=lambda: ["*"], description="request headers it may send (Authorization, Content-Type, "
        "X-Request-Id, ...), '*': any")

    @field_validator("allowed_origins")
    @classmethod
    def _origins(cls, v: list[str]) -> list[str]:
        """Each ``*`` or an origin a browser sends: CORS compares the Origin header as a string, so
        ``http://localhost:3000/`` (a trailing slash), a path or upper case could never match.
        Raises ValueError naming the entry."""
        return _star_or(v, _ORIGIN, "an origin as a browser sends it: scheme://host[:port] in lower case, without "
                        "a path or trailing slash (e.g. 'https://app.example.com'), or '*' for any")

    @field_validator("allowed_methods")
    @classmethod
    def _methods(cls, v: list[str]) -> list[str]:
        """Each ``*`` or a method in upper case (compared as the browser sends it). Raises ValueError."""
        return _star_or(v, _METHOD, "an HTTP method in upper case (GET, POST, OPTIONS, ...) nor '*'")

    @field_validator("allowed_headers")
    @classmethod
    def _headers(cls, v: list[str]) -> list[str]:
        """Each ``*`` or a header name (an HTTP token: no spaces, commas or colons). Raises ValueError."""
        return _star_or(v, _HEADER_NAME, "a header name (letters, digits and !#$%&'*+.^_`|~-) nor '*'")


def _star_or(v: list[str], pattern: "re.Pattern[str]", what: str) -> list[str]:
    """``v`` when each entry is ``*`` or matches ``pattern`` whole; else ValueError naming the
    first other entry (1-based) and ``what`` it should be."""
    for i, x in enumerate(v):
        if x != "*" and not pattern.fullmatch(x):
            raise ValueError(f"entry {i + 1} {x!r} is not {what}")
    return v


class ClusterConfig(_Strict):
    """A whole topology: the instances of each tier, the links and the policies."""

    mode: Mode = "pdd"
    model_path: str = "models/small"
    model_preset: Literal["tiny", "small"] = "small"
    model_seed: int = 0
    host: str = Field("127.0.0.1", description="address every process of the topology listens on: an IP address "
                      "or a hostname (RFC 1123 syntax; checked at load, not looked up)")
    base_port: int = Field(18000, ge=1024, le=65400, description="the topology uses base_port .. base_port+99")
    gateway_port: int = Field(8000, ge=1, le=65535)
    served_model_name: str = "pdd-small"
    tool_call_parser: Literal["auto", "hermes", "llama3_json", "mistral", "none"] = Field(
        "auto", description="how /v1/chat/completions parses tool calls out of the generated text (vLLM's "
        "--tool-call-parser): hermes (Qwen2.5 / Qwen3 <tool_call> blocks), llama3_json (Llama 3.1+ JSON), mistral "
        "([TOOL_CALLS]), none (tool_choice auto refused); auto: the checkpoint's family's "
        "(pdd.gateway.tool_parsers.family_default)")
    engine: EngineConfig = EngineConfig()

    @model_validator(mode="before")
    @classmethod
    def _path_of_preset(cls, data):
        """``model_path`` left out is ``models/<model_preset>`` (docs/SERVE.md): ``model_preset:
        tiny`` alone looked in ``models/small`` and wrote a tiny checkpoint there."""
        if isinstance(data, dict) and "model_path" not in data and isinstance(data.get("model_preset"), str):
            data = {**data, "model_path": f"models/{data['model_preset']}"}
        return data
    link: LinkConfig = LinkConfig()
    policy: PolicyConfig = PolicyConfig()
    security: SecurityConfig = SecurityConfig()
    instances: InstanceCounts = InstanceCounts()
    tiers: dict[str, TierConfig] = Field(
        default_factory=dict,
        description="per-tier (prefill, relay_decode, main_decode, colocated) or per-instance (p0, rld0, md1, ...) "
        "engine blocks, e.g. {main_decode: {engine: {dtype: bfloat16, page_size: 32, min_step_ms: 20}}}: each tier "
        "emulates its own hardware; unset fields inherit the top-level engine (an instance's: its tier's first). "
        "KV between tiers of different page size or dtype is converted (pdd.transfer.layout)")
    limits: LimitsConfig = LimitsConfig()
    request_timeout_s: float = Field(
        300.0, gt=0,
        description="seconds a request may wait for its next event (a token, a tier's reply or plan) before it "
        "fails; an idle timeout between events, not a limit on the request's total time")
    shutdown_timeout_s: float = Field(
        30.0, ge=0,
        description="seconds the gateway lets requests in flight finish after SIGTERM or Ctrl-C (pdd serve "
        "--shutdown-timeout), new ones refused with 503; those still running then end with an error (a stream: an "
        "SSE error event and [DONE]) and are aborted on every tier. 0: end them at once (vLLM's --shutdown-timeout "
        "0). The instances stop after the gateway (docs/SERVE.md \"Stop it\")")
    liveness: LivenessConfig = LivenessConfig()
    gateway_switch_interval_ms: float = Field(
        1.0, gt=0, le=100,
        description="the gateway process's Python thread switch interval (sys.setswitchinterval), ms: the longest "
        "the event loop waits for the interpreter lock while the grammar compiler thread runs Python (a GBNF "
        "grammar's conversion to Lark), i.e. what each streamed token can be delayed then. Python's default is 5")
    cors: CorsConfig = CorsConfig()
    vllm: VllmTierConfig = VllmTierConfig()
    cpu_affinity: dict[Literal["prefill", "relay_decode", "main_decode", "colocated", "gateway", "link"],
                       list[int]] = Field(
        default_factory=dict,
        description="CPU cores each role's processes may run on (Linux sched_setaffinity), e.g. {prefill: [0], "
        "relay_decode: [1], main_decode: [1]}; a role not named runs on every core. On a CPU-only machine this "
        "gives each tier its own cores, as each instance has its own accelerator in a deployment")

    standby: list[str] = Field(
        default_factory=list,
        description="instances of the layout (e.g. md1 with instances.main_decode: 2) that start in standby: "
        "not started by pdd serve / Topology and not awaited by the gateway, until an operator adds them at "
        "run time (POST /pdd/instances, pdd launch --join; docs/SERVE.md \"Elastic topology\"); their ports, "
        "WAN link route and certificates are provisioned at start")

    rerole: list[str] = Field(
        default_factory=list,
        description="relay decoders (pdd mode, e.g. [rld0]) an operator may re-role to main-decode duty in "
        "datacenter A at run time and back (POST /pdd/instances/{name}/role; docs/SERVE.md \"Re-role\"): "
        "as an MD in A it serves requests P->MD over the fast path, no WAN; its engine block stays its tier's. "
        "An instance not listed cannot change role")

    autoscale: AutoscaleConfig = AutoscaleConfig()

    process_nice: int | None = Field(
        None, ge=-20, le=19,
        description="nice value every process of a topology runs at (Linux setpriority: instances, gateway, "
        "link emulator), None: inherited. Below 0 (needs CAP_SYS_NICE, e.g. root) they take the CPU before "
        "other work on the machine, so each tier computes, and the link emulator keeps time, as on the "
        "dedicated hardware it stands for; the same value for every mode, so modes compare under the same "
        "conditions. A refused value is logged and the process runs at the inherited one")

    @field_validator("cpu_affinity")
    @classmethod
    def _cpus(cls, v: dict) -> dict:
        """Every core named must exist on this machine (os.sched_getaffinity of this process):
        a wrong core would only show at start as one instance's OSError. Raises ValueError."""
        import os

        have = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else list(range(os.cpu_count() or 1))
        for role, cpus in v.items():
            if not cpus:
                raise ValueError(f"{role}: name at least one core (or leave the role out)")
            bad = sorted(set(cpus) - set(have))
            if bad:
                raise ValueError(f"{role}: cores {bad} are not available here (available: {have})")
        return v

    @model_validator(mode="after")
    def _tiers(self) -> "ClusterConfig":
        """Every ``tiers`` key names a tier or an instance some mode has (``md2`` needs three
        main-decode instances), every block's KV pool holds one sequence of ``engine.max_model_len``
        tokens (:meth:`_pools_fit`), and every merged block is a valid ``EngineConfig``. Raises
        ValueError naming the field (``tiers.main_decode.engine.page_size: ...``)."""
        for name in self.tiers:
            tier = name if name in TIERS else instance_tier(name)
            if tier is None:
                raise ValueError(f"tiers.{name}: unknown tier or instance name (tiers: {', '.join(TIERS)}; instances: "
                                 f"p0.., rld0.., md0.., d0.., c0..)")
            if name not in TIERS:
                prefix = re.match(r"[a-z]+", name).group(0)
                count = getattr(self.instances, _INSTANCE_PREFIX[prefix][1])
                if int(name[len(prefix):]) >= count:
                    raise ValueError(f"tiers.{name}: no such instance (instances.{_INSTANCE_PREFIX[prefix][1]} is "
                                     f"{count})")
        self._pools_fit()
        for name in self.tiers:
            try:
                self.engine_for(name)
            except ValidationError as e:
                raise ValueError(_prefixed(e, f"tiers.{name}.engine")) from None
        return self

    def _pools_fit(self) -> None:
        """``engine.max_model_len`` is the context window of every request, whatever tier serves
        it, so every tier's and instance's KV pool (its ``tiers`` block's ``num_pages x page_size``
        merged over ``engine``, as :meth:`engine_for`) holds one sequence that long, as
        :meth:`EngineConfig._pool_fits` for the top-level block. ``max_model_len`` given (or
        ``max_input_len`` given, above a pool): ValueError naming the block's field
        (``tiers.main_decode.engine.num_pages: ...``); left out, it is lowered to the smallest
        pool's tokens (and ``max_input_len`` left out follows), the same in every mode."""
        e = self.engine
        small = None  # (pool tokens, name, field, num_pages, page_size) of the smallest pool
        for name, block in self.tiers.items():
            own = block.engine.model_dump(exclude_none=True)
            if "num_pages" not in own and "page_size" not in own:
                continue  # its pool is its tier's or the top-level one, checked as such
            over = self._overrides(name)
            pages, ps = over.get("num_pages", e.num_pages), over.get("page_size", e.page_size)
            if pages < 4 or ps < 1 or ps & (ps - 1):
                continue  # not a valid block: engine_for's check names the field
            if small is None or pages * ps < small[0]:
                small = (pages * ps, name, "num_pages" if "num_pages" in own else "page_size", pages, ps)
        if small is None:
            return
        pool, name, field, pages, ps = small
        what = f"the KV pool (num_pages {pages} x page_size {ps} = {pool} tokens)"
        for key, why in (("max_model_len", "one sequence that long cannot be held"),
                         ("max_input_len", "no prompt that long fits")):
            if key in e.model_fields_set and getattr(e, key) > pool:
                raise ValueError(f"tiers.{name}.engine.{field}: {what} is below engine.{key} {getattr(e, key)}: "
                                 f"{why}; raise {field} or lower engine.{key}")
        if e.max_model_len <= pool:
            return
        try:
            lowered = EngineConfig.model_validate({**e.model_dump(include=e.model_fields_set), "max_model_len": pool})
        except ValidationError as err:
            raise ValueError(f"tiers.{name}.engine.{field}: engine.max_model_len lowered to {what}: "
                             + _prefixed(err, "engine")) from None
        lowered.__pydantic_fields_set__.discard("max_model_len")
        given = "engine" in self.model_fields_set
        self.engine = lowered
        if not given:
            self.__pydantic_fields_set__.discard("engine")

    def bounded_queue(self, name: str) -> tuple[int, int]:
        """``(max_running, waiting)`` of instance ``name``'s engine (:meth:`engine_for`,
        :meth:`LimitsConfig.waiting`): it holds their sum of sequences and refuses another with
        ``TierBusy``. What the gateway's routing and choices cap count an instance's queue as."""
        run = self.engine_for(name).max_running
        return run, self.limits.waiting(run)

    def engine_for(self, name: str) -> EngineConfig:
        """The engine block of an instance (``p0``, ``md1``) or a tier (``main_decode``): the
        top-level ``engine`` with its tier's ``tiers`` block over it, then the instance's own.
        A name that is neither gets the top-level block. Raises ``pydantic.ValidationError`` for
        a merged block that is not valid (the config validator has checked every one at load)."""
        over = self._overrides(name)
        return EngineConfig.model_validate({**self.engine.model_dump(), **over}) if over else self.engine

    def _overrides(self, name: str) -> dict:
        """The engine fields the ``tiers`` blocks of ``name`` set over the top-level ``engine``:
        its tier's, then (an instance) its own, unvalidated (:meth:`engine_for` validates the
        merge; :meth:`_pools_fit` reads the pool before it)."""
        tier = name if name in TIERS else instance_tier(name)
        blocks = [self.tiers.get(tier)] + ([self.tiers.get(name)] if name != tier else [])
        return {k: v for b in blocks if b is not None for k, v in b.engine.model_dump(exclude_none=True).items()}

    def unused_settings(self) -> list[str]:
        """The ``policy`` settings the config sets (explicitly, ``model_fields_set``) that its mode
        does not use: :data:`PDD_ONLY_POLICY` outside pdd mode (``policy.pipeline_ttft_budget_ms``
        in a colocated config). What ``pdd serve`` notes at start; a config shared by several modes
        (``pdd bench --config``) may set them."""
        if self.mode == "pdd":
            return []
        return [f"policy.{k}" for k in PDD_ONLY_POLICY if k in self.policy.model_fields_set]

    def unused_sections(self) -> list[str]:
        """The ``tiers`` blocks and ``instances`` counts the config sets (explicitly) that name no
        instance of its mode's topology (:func:`pdd.topology.layout`): ``tiers.prefill`` in
        colocated mode (its one tier is ``colocated``, instances ``c0``..), ``tiers.md0`` in
        same_dc_pd (its decoders are ``d0``..), ``tiers.d0`` outside it, ``instances.relay_decode``
        outside pdd, ``instances.main_decode`` in colocated mode (which counts ``c0``.. by
        ``instances.prefill``). Their settings apply to nothing in this mode; ``pdd serve`` notes
        them (a config shared by modes may set them). In the order the config gives them."""
        from pdd.topology import layout

        names = {s.name for s in layout(self).instances}
        tiers = {instance_tier(n) for n in names} - {None}
        out = [f"tiers.{k}" for k in self.tiers if k not in names and k not in tiers]
        return out + [f"instances.{f}" for f in ("relay_decode", "main_decode")
                      if f in self.instances.model_fields_set and f not in tiers]

    def hardware_profile(self, name: str) -> dict:
        """What ``/pdd/stats`` and the bench report show of an instance's emulated hardware."""
        e = self.engine_for(name)
        return {"device": e.device, "dtype": e.dtype, "page_size": e.page_size, "num_pages": e.num_pages,
                "max_batch_tokens": e.max_batch_tokens, "max_running": e.max_running, "min_step_ms": e.min_step_ms,
                "profile": e.profile, "torch_threads": e.torch_threads}

    @field_validator("served_model_name")
    @classmethod
    def _served_model_name(cls, v: str) -> str:
        return check_served_model_name(v)

    @field_validator("host")
    @classmethod
    def _host(cls, v: str) -> str:
        return _check_host(v)

    @field_validator("shutdown_timeout_s")
    @classmethod
    def _shutdown_timeout(cls, v: float) -> float:
        return v + 0.0  # -0 is 0 ("may finish for up to -0 s")

    @field_validator("mode")
    @classmethod
    def _mode(cls, v: str) -> str:
        if v not in MODES:
            raise ValueError(f"mode must be one of {MODES}")
        return v

    @model_validator(mode="after")
    def _standby(self) -> "ClusterConfig":
        """Every ``standby`` name is an engine instance of the layout, and each tier keeps one
        instance started. Raises ValueError naming the field."""
        lay = layout(self)
        engines = {s.name: s.role for s in lay.instances if s.role not in ("gateway", "link")}
        for name in self.standby:
            if name not in engines:
                raise ValueError(f"standby: {name!r} is not an instance of the {self.mode} topology (instances: "
                                 f"{', '.join(engines)})")
        for role in sorted(set(engines.values())):
            if all(n in self.standby for n, r in engines.items() if r == role):
                raise ValueError(f"standby: every {role} instance is in standby; keep at least one started")
        twice = sorted({n for n in self.rerole if self.rerole.count(n) > 1})
        if twice:
            raise ValueError(f"rerole: {', '.join(map(repr, twice))} listed more than once; list each relay decoder once")
        for name in self.rerole:
            if engines.get(name) != "relay_decode":
                rlds = [n for n, r in engines.items() if r == "relay_decode"]
                raise ValueError(f"rerole: {name!r} is not a relay_decode instance of the {self.mode} topology "
                                 f"(relay decoders: {', '.join(rlds) or 'none'})")
        return self

    @model_validator(mode="after")
    def _autoscale(self) -> "ClusterConfig":
        """``autoscale.min`` / ``max`` name roles of this mode, and ``max`` fits the role's slots
        (``instances``: provision them, listing the extra ones in ``standby``). Raises ValueError
        naming the field."""
        lay = layout(self)
        slots: dict[str, int] = {}
        for s in lay.instances:
            if s.role not in ("gateway", "link"):
                slots[s.role] = slots.get(s.role, 0) + 1
        for key in ("min", "max"):
            for role, n in getattr(self.autoscale, key).items():
                if role not in slots:
                    raise ValueError(f"autoscale.{key}.{role}: the {self.mode} topology has no {role} instances "
                                     f"(roles: {', '.join(sorted(slots))})")
                if n > slots[role]:
                    raise ValueError(f"autoscale.{key}.{role}: {n} is more than the role's {slots[role]} slot(s); "
                                     f"raise instances and list the extra ones in standby")
        return self

    @model_validator(mode="after")
    def _ports_distinct(self) -> "ClusterConfig":
        """Every port the topology binds (pdd.topology.layout: instances, their metrics, MD's WAN
        ports, the link's control port, the gateway) must be distinct: a collision would only show
        at start as "address already in use" from one process. Raises ValueError naming them."""
        clashes = port_conflicts(layout(self))
        if clashes:
            raise ValueError("ports collide: " + "; ".join(clashes) + " (move gateway_port or base_port, or use "
                             "fewer instances)")
        return self

    @classmethod
    def load(cls, path: str | Path | None = None, **overrides) -> "ClusterConfig":
        """Load from a YAML/JSON file (or defaults), then apply keyword overrides. An empty file
        (or ``null``) holds no settings: the defaults.

        A field the file sets and an override replaces (``pdd serve --port`` over ``gateway_port``)
        is checked as the file has it all the same: ``gateway_port: 70000`` is refused whatever
        flags are given.

        A file named ``*.json`` is read as JSON (its errors in JSON's words: "not valid JSON:
        Expecting ',' delimiter (line 3, column 5)"), any other as YAML (which JSON mostly is).

        Raises ``pydantic.ValidationError`` naming the bad field; :class:`ConfigFileError` naming
        the file (one line) when it is not UTF-8 text, not YAML / JSON, or its top level is not a
        mapping (a list, an empty one too, a string, number or boolean), is not a regular file, is
        larger than :data:`MAX_CONFIG_BYTES`, nests more than :data:`MAX_CONFIG_DEPTH` levels or
        holds more than :data:`MAX_CONFIG_NODES` values once its YAML aliases are expanded;
        OSError when it cannot be read.
        """
        data: dict = {}
        if path is not None:
            try:
                text = _read_config_bytes(path).decode().replace("\r\n", "\n").replace("\r", "\n")
            except UnicodeDecodeError:
                raise ConfigFileError(f"{path}: not UTF-8 text (a YAML or JSON config)") from None
            try:
                if Path(path).suffix.lower() == ".json":  # JSON's errors, and what YAML refuses (tabs)
                    text = text.removeprefix("\ufeff")
                    data = _JsonConfigDecoder().decode(text) if text.strip() else None
                else:  # YAML is a superset of JSON: one parser for .yaml, .yml and anything else
                    data = yaml.load(text, Loader=_ConfigLoader)  # noqa: S506 (a safe loader)
            except json.JSONDecodeError as e:
                raise ConfigFileError(f"{path}: not valid JSON: {_json_problem(e)}") from None
            except yaml.YAMLError as e:
                raise ConfigFileError(f"{path}: not valid YAML/JSON: {_yaml_problem(e)}") from None
            except ValueError:  # an integer past Python's digit limit (its message advises a sys call)
                raise ConfigFileError(f"{path}: a number in it has more than {sys.get_int_max_str_digits()} "
                                      f"digits; no setting takes one that large") from None
            except RecursionError:  # the parsers recurse per level: past a few hundred, Python's stack limit
                raise ConfigFileError(f"{path}: {_TOO_DEEP}") from None
            if _height(data) > MAX_CONFIG_DEPTH:
                raise ConfigFileError(f"{path}: {_TOO_DEEP}")
            if _expanded_size(data) > MAX_CONFIG_NODES:  # after _height: no cycle left to size
                raise ConfigFileError(f"{path}: {_TOO_MANY}")
            if data is None:
                data = {}
            if not isinstance(data, dict):  # `[]` and `false` too: they are not "no settings"
                raise ConfigFileError(f"{path}: expected a JSON object (a YAML mapping) of config fields, "
                                      f"got {_kind(data)}")
        over = {k: v for k, v in overrides.items() if v is not None}
        shadowed = [k for k in over if k in data]
        if shadowed:  # the file's own value is checked too: a flag overriding it must not hide a bad file
            try:
                cls.model_validate(data)
            except ValidationError as e:
                bad = [err for err in e.errors() if err["loc"] and err["loc"][0] in shadowed]
                if bad:
                    raise ValidationError.from_exception_data(cls.__name__, bad) from None
        data.update(over)
        return cls.model_validate(data)


def _prefixed(e: ValidationError, where: str) -> str:
    """``where.field: message`` for each error of ``e`` (as :func:`validation_summary`)."""
    return "; ".join(f"{where}{'.' if err['loc'] else ''}{'.'.join(str(x) for x in err['loc'])}: "
                     + err["msg"].removeprefix("Value error, ") for err in e.errors())


def validation_summary(e: ValidationError) -> str:
    """One line per pydantic ``ValidationError``: ``field.path: message`` for each error, joined by
    ``; `` (a whole-config check, e.g. colliding ports, has no field location: its message names
    them). What every CLI prints for a bad config, instead of pydantic's multi-line text."""
    return "; ".join((f"{'.'.join(str(x) for x in err['loc'])}: " if err["loc"] else "")
                     + err["msg"].removeprefix("Value error, ") for err in e.errors())
