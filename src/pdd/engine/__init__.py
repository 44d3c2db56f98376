"""Built-in LLM engine (torch): paged KV pool, radix prefix cache, pure scheduler, runner.

Names are imported lazily so that ``import pdd.engine.scheduler`` (the simulator's path) does
not pull in torch.
"""

from __future__ import annotations

import importlib

_EXPORTS = {
    "ModelConfig": "config",
    "LlamaModel": "model",
    "load_model": "model",
    "KVPool": "kv_pool",
    "OutOfPages": "kv_pool",
    "DoubleFree": "kv_pool",
    "RadixCache": "radix_cache",
    "PrefixMatch": "radix_cache",
    "Sequence": "sequence",
    "SeqStatus": "sequence",
    "SchedulerConfig": "scheduler",
    "SeqState": "scheduler",
    "PlanItem": "scheduler",
    "BatchPlan": "scheduler",
    "schedule": "scheduler",
    "Sampler": "sampler",
    "ModelRunner": "runner",
    "RunItem": "runner",
    "Engine": "engine",
    "TokenEvent": "engine",
    "load_tokenizer": "engine",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    mod = _EXPORTS.get(name)
    if mod is None:
        raise AttributeError(f"module 'pdd.engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(f".{mod}", __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return __all__
