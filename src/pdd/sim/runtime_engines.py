"""A runtime config's engine blocks as the simulator's engine settings (``pdd sim run --config``,
``pdd plan --config``; docs/SIM.md "Each tier's own engine"). Pure: a ``pdd.config.ClusterConfig``
in, :class:`pdd.sim.sim_config.SimConfig` keyword arguments out.

Only what the config *sets* is read, so a field it leaves out keeps the flag's value (or the
step model's pool), as ``--config``'s WAN fields replace their flags:

- the top-level ``engine``: ``max_batch_tokens``, ``prefill_chunk_tokens``, ``max_running``
  (``max_running_seqs``), ``prefill_order``, ``min_step_ms`` (``min_step_s``, seconds) and
  ``page_size`` (``page_tokens``) replace the flags; its KV pool (``num_pages x page_size``
  tokens, when it sets either) and ``profile`` become every simulated role's;
- ``tiers.<tier>.engine`` (``prefill``, ``relay_decode``, ``main_decode``, ``colocated``) and
  ``tiers.<instance>.engine`` (``md1``): the simulated role's (``MD``) or instance's (``MD1``)
  :class:`pdd.sim.sim_config.SimEngine`, an instance's over its role's as ``ClusterConfig.engine_for``
  merges them; its pool is the merged block's ``num_pages x page_size`` when the block sets
  either.

The runtime's tiers map to the *simulated* mode's roles (``--mode``; the config's ``mode`` is
not read): prefill -> P, relay_decode -> RLD (pdd), main_decode -> MD (pdd, cross_dc_pd) or D
(same_dc_pd), colocated -> C (colocated). Not simulated, so named in ``unread``: ``dtype`` (the
simulated model's KV size is ``--model`` / ``--kv-bytes-per-token``), ``device`` and
``torch_threads`` (the chips are ``--chip-a`` / ``--chip-b``), the top-level ``max_model_len``
and ``max_input_len`` (``--max-input`` clips prompts), and a tier the simulated mode has not. A
page that does not divide ``block_tokens`` counts as the block, as ``pdd sim validate`` does.
"""

from __future__ import annotations

from pdd.config import instance_tier
from pdd.sim.sim_config import SIM_ROLE

# runtime tier -> simulated role, per simulated mode (pdd.sim.sim_config.SimConfig.tiers)
ROLE_OF = {"colocated": {"colocated": "C"},
           "same_dc_pd": {"prefill": "P", "main_decode": "D"},
           "cross_dc_pd": {"prefill": "P", "main_decode": "MD"},
           "pdd": dict(SIM_ROLE)}
# engine fields -> SimEngine / SimConfig fields (min_step_ms is converted to seconds)
SAME = {"max_batch_tokens": "max_batch_tokens", "prefill_chunk_tokens": "prefill_chunk_tokens",
        "max_running": "max_running_seqs", "prefill_order": "prefill_order", "min_step_ms": "min_step_s"}
NOT_SIMULATED = ("dtype", "device", "torch_threads")
NOT_SIMULATED_TOP = NOT_SIMULATED + ("max_model_len", "max_input_len")


def sim_engine_fields(e, block_tokens: int, kv_bytes_per_token: int) -> dict:
    """The :class:`pdd.sim.sim_config.SimEngine` fields of a runtime engine block ``e``
    (``pdd.config.EngineConfig``): its batch limits, step floor (s), KV page (tokens; the block
    when it does not divide ``block_tokens``), pool (``num_pages x page_size`` tokens) and
    ``kv_bytes_per_token`` (bytes a token of KV sent to it carries)."""
    return dict(max_batch_tokens=e.max_batch_tokens, prefill_chunk_tokens=e.prefill_chunk_tokens,
                max_running_seqs=e.max_running, prefill_order=e.prefill_order, min_step_s=e.min_step_ms / 1000.0,
                page_tokens=e.page_size if block_tokens % e.page_size == 0 else block_tokens,
                kv_pool_tokens=e.num_pages * e.page_size, kv_bytes_per_token=kv_bytes_per_token)


def _fields(own: dict, merged, block_tokens: int) -> dict:
    """The SimEngine fields of the engine settings ``own`` sets (:func:`sim_engine_fields` of
    ``merged``, the block's effective engine, ``ClusterConfig.engine_for``: ``own``'s values, and
    its pool)."""
    full = sim_engine_fields(merged, block_tokens, 0)
    keys = [SAME[k] for k in own if k in SAME]
    if "page_size" in own:
        keys.append("page_tokens")
    if "num_pages" in own or "page_size" in own:
        keys.append("kv_pool_tokens")
    out = {k: full[k] for k in keys}
    if own.get("profile") is not None:
        out["profile"] = str(own["profile"])
    return out


def runtime_engine_fields(cfg, mode: str, block_tokens: int) -> tuple[dict, list[str]]:
    """``(SimConfig keyword arguments, unread settings)`` for ``cfg``'s ``engine`` and ``tiers``
    simulated in ``mode`` (module docstring): the top-level fields it sets and ``tier_engines``
    (absent when nothing goes there), and the settings not simulated, each as its config path
    (``tiers.main_decode.engine.dtype``). Raises ValueError for an unknown ``mode``."""
    if mode not in ROLE_OF:
        raise ValueError(f"unknown mode {mode!r}; expected one of {', '.join(ROLE_OF)}")
    roles = ROLE_OF[mode]
    unread: list[str] = []
    kw: dict = {}
    te: dict[str, dict] = {}
    top = set(cfg.engine.model_fields_set) if "engine" in cfg.model_fields_set else set()
    own = {k: getattr(cfg.engine, k) for k in sorted(top)}
    unread += [f"engine.{k}" for k in own if k in NOT_SIMULATED_TOP]
    base = _fields(own, cfg.engine, block_tokens)
    for k in ("kv_pool_tokens", "profile"):  # no top-level SimConfig field: every role's
        v = base.pop(k, None)
        if v is not None:
            for role in roles.values():
                te.setdefault(role, {})[k] = v
    kw.update(base)
    for name, block in cfg.tiers.items():
        tier = instance_tier(name) or name
        role = roles.get(tier)
        mine = block.engine.model_dump(exclude_none=True)
        if role is None:
            if mine:
                unread.append(f"tiers.{name} (the simulated {mode} mode has no {tier} tier)")
            continue
        unread += [f"tiers.{name}.engine.{k}" for k in mine if k in NOT_SIMULATED]
        fields = _fields(mine, cfg.engine_for(name), block_tokens)
        if fields:
            key = role if name == tier else f"{role}{name[len(name.rstrip('0123456789')):]}"
            te.setdefault(key, {}).update(fields)
    if te:
        kw["tier_engines"] = te
    return kw, unread


__all__ = ["ROLE_OF", "runtime_engine_fields", "sim_engine_fields"]
