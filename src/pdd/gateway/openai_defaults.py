"""Sampling defaults of a checkpoint: its ``generation_config.json``, as vLLM and SGLang read it.

A request that leaves ``temperature``, ``top_p``, ``top_k``, ``min_p`` or ``repetition_penalty``
out (or sends null) is sampled with the value the model's creator recommends there (vLLM's
``--generation-config auto``, its default; SGLang's "user value > model generation_config >
OpenAI defaults"), else with the API's (1.0, 1.0, off, 0, 1.0). As vLLM reads them through
transformers' ``GenerationConfig.to_diff_dict``, a value equal to transformers' own default
(``temperature`` 1.0, ``top_p`` 1.0, ``top_k`` 50, ``repetition_penalty`` 1.0) is not a default:
such a ``top_k: 50`` leaves top-k off. ``max_new_tokens`` is not taken (pdd's ``max_tokens``
defaults stay the API's).
"""

from __future__ import annotations

import json
import logging
import math
import os

log = logging.getLogger(__name__)

# the keys taken, with transformers' GenerationConfig defaults (a value equal to it is no default)
TAKEN = {"temperature": 1.0, "top_p": 1.0, "top_k": 50, "min_p": None, "repetition_penalty": 1.0}


def _valid(key: str, v) -> bool:
    """Whether ``v`` is a value the API itself would accept for ``key`` (openai_schemas' ranges)."""
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        return False
    if key == "top_k":
        return isinstance(v, int) and v >= -1
    if key == "temperature":
        return v >= 0.0
    if key == "top_p":
        return 0.0 < v <= 1.0
    if key == "min_p":
        return 0.0 <= v <= 1.0
    return 0.0 < v <= 10.0  # repetition_penalty


def generation_defaults(model_path: str) -> dict[str, float | int]:
    """``{key: value}`` of :data:`TAKEN` keys that ``model_path/generation_config.json`` sets to
    something other than transformers' default; {} when the file is missing or not a JSON object.
    A value the API would refuse (``temperature: -1``, a string) is skipped with a warning in the
    log. Raises nothing."""
    path = os.path.join(model_path, "generation_config.json")
    try:
        with open(path, encoding="utf-8") as f:
            d = json.load(f)
    except (OSError, ValueError):
        return {}
    if not isinstance(d, dict):
        return {}
    out: dict[str, float | int] = {}
    for key, hf_default in TAKEN.items():
        v = d.get(key)
        if v is None or v == hf_default:
            continue
        if not _valid(key, v):
            log.warning("generation_config.json: %s %r is not a value the API takes; ignored", key, v)
            continue
        out[key] = v
    if out:
        log.info("sampling defaults from the checkpoint's generation_config.json (a request's own values win): %s",
                 out)
    return out
