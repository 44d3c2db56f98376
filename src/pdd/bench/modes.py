"""Mode labels (``pdd+allow_p_rld``, ``pdd+engine.prefill_order=short_first``,
``pdd+vllm.main_decode``) and flag overrides turned into the :class:`~pdd.config.ClusterConfig` a
benchmarked mode runs."""

from __future__ import annotations

from typing import Any

import pydantic

from pdd.bench import vllm_mode
from pdd.config import MODES, PDD_ONLY_POLICY, ClusterConfig
from pdd.vllm_tier.venv import VllmMissing, check_vllm_importable
from pdd.vllm_tier.venv import vllm_python as vllm_python_of


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
# the modes whose topology crosses the WAN (pdd.topology.layout: a link emulator and datacenter B);
# colocated and same_dc_pd keep every instance in datacenter A
WAN_MODES = ("cross_dc_pd", "pdd")
AUTOSCALE = "autoscale"  # mode suffix: pdd+autoscale runs the config's autoscale block (pdd serve --autoscale)
STANDBY = "standby"  # mode suffix: pdd+standby=none starts every slot (the topology fixed at its full size)


_LABEL_SUFFIXES = (f"a label is MODE+SETTING[=VALUE]+...; SETTING is {AUTOSCALE}[=true|false], {STANDBY}=none, a "
                   f"policy setting, {', '.join(LINK_MODE_KEYS)} (link), engine.<setting> or vllm.<setting>")


def parse_mode_label(label: str) -> tuple[str, dict]:
    """A mode label -> ``(mode, overrides)``.

    ``"pdd"`` -> ``("pdd", {})``; ``"pdd+allow_p_rld"`` -> ``("pdd", {"allow_p_rld": True})``;
    ``"pdd+routing=round_robin+handoff_mode=auto"`` -> ``("pdd", {"routing": "round_robin",
    "handoff_mode": "auto"})``. Keys are :class:`pdd.config.PolicyConfig` fields, one of
    :data:`LINK_MODE_KEYS` (a :class:`pdd.config.LinkConfig` field, ``cross_dc_pd+wan_connections=4``),
    ``engine.<field>`` for an :class:`pdd.config.EngineConfig` one (``pdd+engine.prefill_order=short_first``),
    or ``vllm.<field>`` for a :class:`pdd.config.VllmTierConfig` one (``pdd+vllm.main_decode``: the
    mode's main-decode instances run on vLLM through pdd's KV connector, docs/VLLM_TIER.md;
    ``extra_args`` is not settable from a label); values are validated by them, each read as its
    field's type first (:func:`typed_overrides`: ``true``/``false`` for flags, numbers), and
    returned as the label's text. ``autoscale``
    (``pdd+autoscale``, ``+autoscale=false``) switches the config's ``autoscale`` block on (off):
    the same topology, its standby slots added and drained by the gateway's loop; ``standby=none``
    starts every slot of the config (the same topology fixed at its largest size). A link setting
    is refused on a mode not in :data:`WAN_MODES`, a :data:`pdd.config.PDD_ONLY_POLICY` setting other
    than its default on any mode but pdd (at its default it is a no-op that tells two runs of one
    configuration apart, e.g. ``cross_dc_pd+cutoff=true`` in A B B A order), and a bare setting
    that is not on/off (``pdd+pipeline_ttft_budget_ms`` would read as 1): each would change nothing
    or something else than meant. A variant runs
    on its own fresh topology beside the others, so ablations are compared side by side in one
    invocation; its records and report entry carry the whole label. Raises ValueError naming the
    bad part.
    """
    from pdd.config import EngineConfig, LinkConfig, PolicyConfig, VllmTierConfig

    sections = {"engine": EngineConfig, "vllm": VllmTierConfig}

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
        if not key:
            raise ValueError(f"mode {label!r}: an empty setting after '+'; {_LABEL_SUFFIXES}")
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
        typed = key
        if key in LINK_MODE_KEYS:
            key = "link." + key
        section, dot, field = key.partition(".")
        if dot and section == "link":
            known = set(LINK_MODE_KEYS)
        elif dot:
            known = set(sections[section].model_fields) - {"extra_args"} if section in sections else set()
        else:
            known = PolicyConfig.model_fields
        if field not in known if dot else key not in known:
            raise ValueError(f"mode {label!r}: {key!r} is neither {AUTOSCALE}[=true|false], {STANDBY}=none, a policy "
                             f"setting ({sorted(PolicyConfig.model_fields)}), "
                             f"a link setting ({', '.join(LINK_MODE_KEYS)}), engine.<setting> "
                             f"({sorted(EngineConfig.model_fields)}) nor vllm.<setting> "
                             f"({sorted(set(VllmTierConfig.model_fields) - {'extra_args'})})")
        if section == "link" and base not in WAN_MODES:  # nothing of the mode crosses the WAN: it would do nothing
            raise ValueError(f"mode {label!r}: {field} is a WAN setting and no instance of {base} crosses the "
                             f"WAN (modes that do: {', '.join(WAN_MODES)})")
        if not eq and _field_of(key, sections).annotation is not bool:  # a bare number would read as 1
            raise ValueError(f"mode {label!r}: {typed} takes a value ({base}+{typed}=VALUE); only on/off settings "
                             f"may be given bare")
        over[key] = True if not eq else val.strip()
    values = typed_overrides(label, over)
    try:
        PolicyConfig.model_validate({k: v for k, v in values.items() if "." not in k and k not in (AUTOSCALE, STANDBY)})
        LinkConfig.model_validate({k.partition(".")[2]: v for k, v in values.items() if k.startswith("link.")})
        for name, model in sections.items():
            model.model_validate({k.partition(".")[2]: v for k, v in values.items() if k.partition(".")[0] == name})
    except pydantic.ValidationError as ex:
        err = ex.errors()[0]
        raise ValueError(f"mode {label!r}: {'.'.join(map(str, err['loc']))}: "
                         f"{err['msg'].removeprefix('Value error, ')}") from None
    if base != "pdd":  # no relay tier nor pipeline choice there: a changed pdd-only setting would do nothing
        changed = PolicyConfig.model_validate({k: v for k, v in values.items() if k in PDD_ONLY_POLICY})
        moved = [k for k in over if k in PDD_ONLY_POLICY and getattr(changed, k) != getattr(PolicyConfig(), k)]
        if moved:
            verb = "acts" if len(moved) == 1 else "act"
            raise ValueError(f"mode {label!r}: {', '.join(moved)} {verb} on pdd's relay tier or pipeline choice, which "
                             f"{base} does not have (pdd-only settings: {', '.join(PDD_ONLY_POLICY)}; one at its "
                             f"default, e.g. +cutoff=true, is allowed as a no-op that tells two runs apart)")
    return base, over


# the words a label may write a boolean setting's value with (pdd+cutoff=false, +allow_p_rld=yes):
# those pydantic's lax mode took from the text, before the config took only real booleans
_LABEL_TRUE = ("true", "yes", "on", "1", "y", "t")
_LABEL_FALSE = ("false", "no", "off", "0", "n", "f")


def typed_overrides(label: str, over: dict) -> dict:
    """``over`` of :func:`parse_mode_label` (``label``'s settings, their values as the label's
    text) with each text value read as the type of the field it sets: ``"80"`` -> 80 for
    ``pipeline_ttft_budget_ms``, ``"2.5"`` -> 2.5, ``"false"`` / ``"no"`` / ``"off"`` / ``"0"``
    -> False for an on/off setting; a field that takes names (``routing=round_robin``,
    ``vllm.python=/path``) keeps its text. The config refuses a string where a number or a boolean
    is expected (a quoted YAML value); a label has only text. Raises ValueError naming the label
    and the setting for a value that is not one (``pdd+pipeline_ttft_budget_ms=fast``)."""
    from pdd.config import EngineConfig, VllmTierConfig, union_arms

    sections = {"engine": EngineConfig, "vllm": VllmTierConfig}
    out = {}
    for key, val in over.items():
        if key in (AUTOSCALE, STANDBY) or not isinstance(val, str):
            out[key] = val
            continue
        field = key.partition(".")[2] or key
        arms = union_arms(_field_of(key, sections).annotation)
        if bool in arms:
            word = val.strip().lower()
            if word not in _LABEL_TRUE + _LABEL_FALSE:
                raise ValueError(f"mode {label!r}: {field}: must be true or false, got {val!r}")
            out[key] = word in _LABEL_TRUE
        elif any(a in (int, float) for a in arms) and str not in arms:
            try:
                out[key] = int(val)
            except ValueError:
                try:
                    out[key] = float(val)
                except ValueError:
                    raise ValueError(f"mode {label!r}: {field}: must be a number, got {val!r}") from None
        else:
            out[key] = val
    return out


def _field_of(key: str, sections: dict):
    """The pydantic field a checked label key sets (``pipeline_ttft_budget_ms``, ``link.wan_connections``,
    ``engine.min_step_ms``)."""
    from pdd.config import LinkConfig, PolicyConfig

    section, dot, field = key.partition(".")
    model = (LinkConfig if section == "link" else sections[section]) if dot else PolicyConfig
    return model.model_fields[field if dot else key]


def mode_config(config: ClusterConfig, label: str, vllm_python: str | None = None) -> ClusterConfig:
    """``config`` for one mode label (:func:`parse_mode_label`): its mode, policy, link, engine and
    vllm overrides, and ``autoscale.enabled``. ``vllm_python`` (``pdd bench --vllm-python``)
    becomes ``vllm.python`` of a mode whose MD runs on vLLM when the config leaves it unset.
    Raises ValueError (the config's own message) when the result is not a valid config, e.g.
    ``+autoscale`` with no ``autoscale.max`` in the config."""
    base, over = parse_mode_label(label)
    over = typed_overrides(label, over)  # the label's text as numbers and booleans
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
        cfg = ClusterConfig.model_validate(data)
    except pydantic.ValidationError as ex:
        from pdd.config import validation_summary

        raise ValueError(f"mode {label!r}: {validation_summary(ex)}") from None
    if vllm_python and cfg.vllm.main_decode and cfg.vllm.python is None:
        cfg = cfg.model_copy(update={"vllm": cfg.vllm.model_copy(update={"python": str(vllm_python)})})
    return cfg


def check_vllm_tiers(config: ClusterConfig, labels, vllm_python: str | None = None) -> None:
    """Refuse, before anything runs, a mode whose MD runs on vLLM (``vllm.main_decode`` from its
    label, ``pdd+vllm.main_decode``, or from the config) when vLLM's venv is missing or has no
    ``vllm`` package (:func:`pdd.vllm_tier.venv.vllm_python`, :func:`~pdd.vllm_tier.venv.
    check_vllm_importable`; the interpreter is looked up once per distinct ``vllm.python``).
    Raises ValueError: one line naming the mode and ``make vllm``."""
    checked: set[str | None] = set()
    for label in labels:
        if parse_mode_label(label)[0] == vllm_mode.VLLM_MODE:
            continue  # stock vLLM: pdd bench's argument check covers it
        cfg = mode_config(config, label, vllm_python)
        if not cfg.vllm.main_decode or cfg.vllm.python in checked:
            continue
        who = f"{label} (MD on vLLM, vllm.main_decode)"
        try:
            check_vllm_importable(vllm_python_of(cfg.vllm.python, who=who), who=who)
        except VllmMissing as ex:
            raise ValueError(str(ex)) from None
        checked.add(cfg.vllm.python)


REFERENCE_MODE = "same_dc_pd"  # the mode of the reference run that fixes the SLO (pdd.bench.bench)


class PortsTaken(ValueError):
    """A port a topology of the run needs is taken (:func:`check_ports_free`); its message is
    the one line ``pdd serve`` and ``pdd demo`` refuse with (:func:`pdd.topology.ports_taken_refusal`)."""


def check_ports_free(config: ClusterConfig, labels, reference: bool = False) -> None:
    """Refuse, before anything starts, a port that a topology of ``labels`` (and, with
    ``reference``, the ``same_dc_pd`` reference run's own topology) will listen on and that
    cannot be bound now (:func:`pdd.topology.ports_in_use`, the check ``pdd serve`` makes).
    ``vllm_colocated`` is skipped: stock vLLM's server takes a free port. Raises
    :class:`PortsTaken` (a ValueError): one line naming each busy port (the first five), what
    listens on it in the config (``gateway: gateway_port``, ``d0, md0: base_port + 70``) and the
    flags that move them (:func:`pdd.topology.ports_taken_refusal`)."""
    from pdd.topology import ports_taken_refusal

    cfgs = [mode_config(config, label) for label in labels if parse_mode_label(label)[0] != vllm_mode.VLLM_MODE]
    if reference:
        cfgs.append(config.model_copy(update={"mode": REFERENCE_MODE}))
    taken = ports_taken_refusal(cfgs, "pdd bench", port_flag="--gateway-port") if cfgs else None
    if taken:
        raise PortsTaken(taken)
