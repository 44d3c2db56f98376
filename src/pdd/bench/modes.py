"""Mode labels (``pdd+allow_p_rld``, ``pdd+engine.prefill_order=short_first``) and flag overrides
turned into the :class:`~pdd.config.ClusterConfig` a benchmarked mode runs."""

from __future__ import annotations

from typing import Any

import pydantic

from pdd.bench import vllm_mode
from pdd.config import MODES, ClusterConfig


def apply_overrides(cfg: ClusterConfig, **kw) -> ClusterConfig:
    """``cfg`` with flag overrides (None = keep), validated. Keys: ``wan_gbps``, ``wan_rtt_ms``,
    ``wan_jitter_ms``, ``fast_gbps``, ``wan_loss_rate``, ``wan_cross_traffic``, ``wan_connections`` (link), ``allow_p_rld``, ``wan_order``, ``handoff_mode``,
    ``pipeline_ttft_budget_ms``, ``kv_stream`` (policy), ``min_step_ms`` (engine), ``base_port``, ``gateway_port``, ``model_path``,
    ``served_model_name``, ``request_timeout_s`` (top level)."""
    sections = {"link": ("wan_gbps", "wan_rtt_ms", "wan_jitter_ms", "fast_gbps", "wan_loss_rate", "wan_cross_traffic",
                         "wan_connections"),
                "policy": ("allow_p_rld", "wan_order", "handoff_mode", "pipeline_ttft_budget_ms", "kv_stream"),
                "engine": ("min_step_ms",),
                "": ("base_port", "gateway_port", "model_path", "served_model_name", "request_timeout_s")}
    data = cfg.model_dump()
    known = {k for ks in sections.values() for k in ks}
    bad = set(kw) - known
    if bad:
        raise TypeError(f"unknown overrides: {sorted(bad)}")
    for sec, keys in sections.items():
        for k in keys:
            if kw.get(k) is None:
                continue
            (data[sec] if sec else data)[k] = kw[k]
    return ClusterConfig.model_validate(data)


# link settings a mode label may set (per mode, side by side): a bare key or ``link.<key>``
LINK_MODE_KEYS = ("wan_connections",)
AUTOSCALE = "autoscale"  # mode suffix: pdd+autoscale runs the config's autoscale block (pdd serve --autoscale)
STANDBY = "standby"  # mode suffix: pdd+standby=none starts every slot (the topology fixed at its full size)


def parse_mode_label(label: str) -> tuple[str, dict]:
    """A mode label -> ``(mode, overrides)``.

    ``"pdd"`` -> ``("pdd", {})``; ``"pdd+allow_p_rld"`` -> ``("pdd", {"allow_p_rld": True})``;
    ``"pdd+routing=round_robin+handoff_mode=auto"`` -> ``("pdd", {"routing": "round_robin",
    "handoff_mode": "auto"})``. Keys are :class:`pdd.config.PolicyConfig` fields, one of
    :data:`LINK_MODE_KEYS` (a :class:`pdd.config.LinkConfig` field, ``cross_dc_pd+wan_connections=4``), or
    ``engine.<field>`` for an :class:`pdd.config.EngineConfig` one (``pdd+engine.prefill_order=short_first``);
    values are validated by them (``true``/``false`` for flags, numbers as text). ``autoscale``
    (``pdd+autoscale``, ``+autoscale=false``) switches the config's ``autoscale`` block on (off):
    the same topology, its standby slots added and drained by the gateway's loop; ``standby=none``
    starts every slot of the config (the same topology fixed at its largest size). A variant runs
    on its own fresh topology beside the others, so ablations are compared side by side in one
    invocation; its records and report entry carry the whole label. Raises ValueError naming the
    bad part.
    """
    from pdd.config import EngineConfig, LinkConfig, PolicyConfig

    base, *parts = [x.strip() for x in label.split("+")]
    if base == vllm_mode.VLLM_MODE:  # stock vLLM (pdd.bench.vllm_mode): pdd's policies do not apply
        if parts:
            raise ValueError(f"mode {label!r}: {base} takes no overrides (it runs stock vLLM)")
        return base, {}
    if base not in MODES:
        raise ValueError(f"mode {label!r}: unknown mode {base!r}; choose from {', '.join(MODES)}, "
                         f"{vllm_mode.VLLM_MODE}")
    over: dict[str, Any] = {}
    for part in parts:
        key, eq, val = part.partition("=")
        key = key.strip()
        if key == AUTOSCALE:  # the config's autoscale block switched on (or off) for this mode
            v = val.strip().lower() if eq else "true"
            if v not in ("true", "false"):
                raise ValueError(f"mode {label!r}: {AUTOSCALE} takes true or false, got {val.strip()!r}")
            over[AUTOSCALE] = v == "true"
            continue
        if key == STANDBY:  # +standby=none: every slot of the config starts active (fixed at its full size)
            if val.strip().lower() != "none":
                raise ValueError(f"mode {label!r}: {STANDBY} takes none (every slot started), got {val.strip()!r}")
            over[STANDBY] = []
            continue
        if key in LINK_MODE_KEYS:
            key = "link." + key
        section, dot, field = key.partition(".")
        known = EngineConfig.model_fields if dot and section == "engine" else (
            {k: None for k in LINK_MODE_KEYS} if dot and section == "link" else ({} if dot else PolicyConfig.model_fields))
        if field not in known if dot else key not in known:
            raise ValueError(f"mode {label!r}: {key!r} is neither a policy setting ({sorted(PolicyConfig.model_fields)}), "
                             f"a link setting ({', '.join(LINK_MODE_KEYS)}) nor engine.<setting> "
                             f"({sorted(EngineConfig.model_fields)})")
        over[key] = True if not eq else val.strip()
    try:
        PolicyConfig.model_validate({k: v for k, v in over.items() if "." not in k and k not in (AUTOSCALE, STANDBY)})
        EngineConfig.model_validate({k.partition(".")[2]: v for k, v in over.items() if k.startswith("engine.")})
        LinkConfig.model_validate({k.partition(".")[2]: v for k, v in over.items() if k.startswith("link.")})
    except pydantic.ValidationError as ex:
        err = ex.errors()[0]
        raise ValueError(f"mode {label!r}: {'.'.join(map(str, err['loc']))}: {err['msg']}") from None
    return base, over


def mode_config(config: ClusterConfig, label: str) -> ClusterConfig:
    """``config`` for one mode label (:func:`parse_mode_label`): its mode, policy and engine
    overrides, and ``autoscale.enabled``. Raises ValueError (the config's own message) when the
    result is not a valid config, e.g. ``+autoscale`` with no ``autoscale.max`` in the config."""
    base, over = parse_mode_label(label)
    data = config.model_dump()
    data["mode"] = "colocated" if base == vllm_mode.VLLM_MODE else base  # vLLM: colocated's engine settings
    for key, val in over.items():
        section, dot, field = key.partition(".")
        if key == AUTOSCALE:
            data["autoscale"]["enabled"] = bool(val)
        elif key == STANDBY:
            data["standby"] = list(val)
        elif dot:
            data[section][field] = val
        else:
            data["policy"][key] = val
    try:
        return ClusterConfig.model_validate(data)
    except pydantic.ValidationError as ex:
        from pdd.config import validation_summary

        raise ValueError(f"mode {label!r}: {validation_summary(ex)}") from None
