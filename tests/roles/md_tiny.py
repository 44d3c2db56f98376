"""A real MD instance on the tiny model, in this process, and P's KV for it: what the roles tests
that drive MD over its own protocol share (no gateway, no other instance)."""

import os

from pdd.config import ClusterConfig
from pdd.topology import ROLE_MAIN, InstanceSpec, free_port_block, layout
from pdd.transfer.kv import KVSender

PROMPT = list(range(10, 28))  # 18 tokens = 4 whole pages of 4 + 2


async def start_md(tiny_model, instances: dict | None = None):
    """``(cfg, inst)``: MD ``md0`` started on a free port block (64 pages of 4 tokens, plain
    transport), in a pdd topology of ``instances`` (the embedded counts when None). Stop it with
    ``await inst.stop()``."""
    from pdd.roles.main_decode import MainDecodeInstance

    base = free_port_block()
    cfg = ClusterConfig.model_validate({"mode": "pdd", "model_path": tiny_model, "model_preset": "tiny",
                                        "base_port": base, "gateway_port": base + 95, "request_timeout_s": 30,
                                        "security": {"tls": False, "fast_path": "plain"},
                                        **({"instances": instances} if instances else {}),
                                        "engine": {"num_pages": 64, "page_size": 4, "max_model_len": 256}})
    # a port of the free block: its metrics server (port + 10, never stopped in-process) is the block's too
    inst = MainDecodeInstance(cfg, InstanceSpec("md0", ROLE_MAIN, "B", base + 1), layout(cfg))
    await inst.start()
    return cfg, inst


def send_prompt_kv(p, inst, rid: str, page_bytes: int) -> None:
    """Send ``rid``'s 5 pages of PROMPT's KV (random bytes) to MD ``inst`` over P's connection
    ``p``, relayed (RLD holds its first token, 5), as P's ``KVSender`` does."""
    data = os.urandom(5 * page_bytes)
    KVSender(p, chunk_pages=1).submit(rid, 0, lambda i, n: data[i * page_bytes:(i + n) * page_bytes], 5, page_bytes,
                                      layers=(0, inst.engine.model_cfg.num_hidden_layers),
                                      done_fields={"first_token": 5, "fin": None, "relay": True})
