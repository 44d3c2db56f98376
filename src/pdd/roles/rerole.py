"""Re-role: an engine instance takes another role at run time, in the same process.

A relay decoder listed in the config's ``rerole`` (datacenter A) can take main-decode duty there
and back (docs/SERVE.md "Re-role"; the gateway drains it first and decides with
``pdd.policy.membership.decide_rerole``). The process keeps its engine (weights, KV pool, engine
thread), its RPC server (same address, same certificates, connections kept) and its metrics
endpoint; what changes is the role object's class and state, its message handlers, and the role
it reports (``stats``). The same process rather than a restart: the slot's address, its
connections from the gateway and P (TLS / fast-path MAC already set up) and its loaded weights
stay, so the switch costs one engine-thread flush instead of a model load, and nothing must
restart a process the gateway did not start (``pdd launch --join``).

Message ``set_role {role}`` (call, gateway): refused (``RuntimeError``) while any request is
held here or when the config does not list the instance; else the prefix cache is flushed (an
RLD keeps none; an MD's DRC would be read by nobody in the relay role) and the reply says
``{name, role, from, pages_dropped, tokens_dropped, pages_total, pages_free}``: ``pages_free <
pages_total`` after the flush is a leak. The engine block (pages, running limit) stays the
slot's tier's (``ClusterConfig.engine_for``).
"""

from __future__ import annotations

import dataclasses

from pdd.topology import ROLE_MAIN, ROLE_RELAY

SET_ROLE = "set_role"


def set_role_msg(role: str) -> dict:
    """The gateway's ``set_role`` header."""
    return {"t": SET_ROLE, "role": role}


def role_class(role: str):
    """The role object class of ``role`` (relay_decode or main_decode). Raises ValueError."""
    if role == ROLE_RELAY:
        from pdd.roles.relay_decode import RelayDecodeInstance

        return RelayDecodeInstance
    if role == ROLE_MAIN:
        from pdd.roles.main_decode import MainDecodeInstance

        return MainDecodeInstance
    raise ValueError(f"role {role!r} cannot be taken at run time; expected {ROLE_RELAY} or {ROLE_MAIN}")


async def on_set_role(inst, peer, h, payload):
    """Handle ``set_role`` on ``inst`` (module docstring). Raises RuntimeError / ValueError, which
    the caller gets as a remote error."""
    to = str(h.get("role"))
    cls = role_class(to)
    name, frm = inst.spec.name, inst.spec.role
    if name not in inst.cfg.rerole or frm not in (ROLE_RELAY, ROLE_MAIN):
        raise RuntimeError(f"{name} may not change role (the config's rerole does not list it)")
    if inst.reqs:
        raise RuntimeError(f"{name} still holds {len(inst.reqs)} request(s): drain it first")

    def _flush(e):
        held = e.pool.num_pages - e.pool.num_free
        e.flush_cache()
        return held, e.pool.num_pages, e.pool.num_free

    held, total, free = await inst.worker.call(_flush)
    dropped = held - (total - free)
    if to != frm:
        inst.__class__ = cls
        inst.spec = dataclasses.replace(inst.spec, role=to)
        inst.role_state()
        hs = inst.handlers()
        if "kv_done" in hs:
            hs["kv_done"] = inst._first_token_logprobs(hs["kv_done"])
        server = inst.server
        server.handlers.clear()  # every connection reads this dict: the new role's handlers from the next message
        server.handlers.update(hs)
        inst.worker.on_events, inst.worker.on_seq_failed = inst.on_events, inst.on_seq_failed
        inst.counters["reroles"] = inst.counters.get("reroles", 0) + 1
    return {"t": "set_role_ok", "name": name, "role": to, "from": frm, "pages_dropped": dropped,
            "tokens_dropped": dropped * inst.engine.pool.page_size,
            "pages_total": total, "pages_free": free}, b""
