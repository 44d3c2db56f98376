"""Real instances on the tiny model, in this process, and P's KV for them: what the roles tests
that drive one instance over its own protocol share (no gateway, no other instance)."""

import os

from pdd.config import ClusterConfig
from pdd.topology import ROLE_MAIN, ROLE_PREFILL, ROLE_RELAY, InstanceSpec, free_port_block, layout
from pdd.transfer.kv import KVSender

PROMPT = list(range(10, 28))  # 18 tokens = 4 whole pages of 4 + 2

_ROLES = {"p0": (ROLE_PREFILL, "A"), "rld0": (ROLE_RELAY, "A"), "md0": (ROLE_MAIN, "B")}


def tiny_config(tiny_model, instances: dict | None = None, policy: dict | None = None) -> ClusterConfig:
    """A pdd topology on a free port block (64 pages of 4 tokens, plain transport) of
    ``instances`` (the embedded counts when None), with ``policy`` over the default one."""
    base = free_port_block()
    return ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "model_preset": "tiny",
                                         "base_port": base, "gateway_port": base + 95, "request_timeout_s": 30,
                                         "security": {"tls": False, "fast_path": "plain"},
                                         **({"instances": instances} if instances else {}),
                                         **({"policy": policy} if policy else {}),
                                         "engine": {"num_pages": 64, "page_size": 4, "max_model_len": 256}})


async def start_instance(tiny_model, name: str, instances: dict | None = None, policy: dict | None = None):
    """``(cfg, inst)``: instance ``name`` (``p0``, ``rld0`` or ``md0``) of :func:`tiny_config`
    (``instances``, ``policy``), started. Stop it with ``await inst.stop()``."""
    from pdd.roles.main_decode import MainDecodeInstance
    from pdd.roles.prefill import PrefillInstance
    from pdd.roles.relay_decode import RelayDecodeInstance

    cfg = tiny_config(tiny_model, instances, policy)
    role, dc = _ROLES[name]
    cls = {ROLE_PREFILL: PrefillInstance, ROLE_RELAY: RelayDecodeInstance, ROLE_MAIN: MainDecodeInstance}[role]
    # a port of the free block: its metrics server (port + 10, never stopped in-process) is the block's too
    inst = cls(cfg, InstanceSpec(name, role, dc, cfg.base_port + 1), layout(cfg))
    await inst.start()
    return cfg, inst


async def start_md(tiny_model, instances: dict | None = None):
    """:func:`start_instance` of ``md0``."""
    return await start_instance(tiny_model, "md0", instances)


def send_prompt_kv(p, inst, rid: str, page_bytes: int) -> None:
    """Send ``rid``'s 5 pages of PROMPT's KV (random bytes) to MD ``inst`` over P's connection
    ``p``, relayed (RLD holds its first token, 5), as P's ``KVSender`` does."""
    data = os.urandom(5 * page_bytes)
    KVSender(p, chunk_pages=1).submit(rid, 0, lambda i, n: data[i * page_bytes:(i + n) * page_bytes], 5, page_bytes,
                                      layers=(0, inst.engine.model_cfg.num_hidden_layers),
                                      done_fields={"first_token": 5, "fin": None, "relay": True})
