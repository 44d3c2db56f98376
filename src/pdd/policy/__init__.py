"""Pure policy layer of pdd (no torch, sockets, asyncio, clocks or randomness).

Every decision the live runtime and the cluster simulator take goes through these functions
over small frozen dataclasses, so the simulator runs the runtime's own code. Each rule cites
the section of the PDD technical report (summarised in ../shared/PDD.md) it implements.

Modules:
    pipeline   which pipeline (P->MD, P->RLD->MD, ...) a request takes
    handoff    one-shot vs catch-up Extend-Decode handoff from RLD to MD
    cutoff     anomalous-traffic filter: cancel the WAN transfer when RLD already finished
    wan_order  which WAN transfer the shared line serves next (FIFO / shortest remaining first),
               and on which of P's two connections (lanes) it goes
    routing    which instance (P, RLD, MD) serves a request (cache-aware / load / round robin)
    siblings   whether the other choices of a prompt wait for the first one's KV on MD (and a request
               whose prefix another request's KV is still bringing there waits for it)
    membership the elastic topology's state machine (add / drain / remove an instance)
    autoscale  the per-role instance mix the autoscaling loop moves to (utilisation, hysteresis)
"""

from pdd.policy.cutoff import predict_rld_finishes_first, sent_fraction, should_cut_off
from pdd.policy.handoff import HandoffDecision, HandoffInputs, decide_handoff, effective_handoff_mode, rld_load
from pdd.policy.pipeline import PipelineInputs, choose_pipeline, expected_wan_seconds, missing_tokens, relays_every_request
from pdd.policy.routing import InstanceLoad, choose_instance
from pdd.policy.siblings import claim_waits_for_kv, sibling_waits_for_kv
from pdd.policy.wan_order import TransferView, pick_next

__all__ = [
    "sibling_waits_for_kv",
    "claim_waits_for_kv",
    "PipelineInputs",
    "choose_pipeline",
    "expected_wan_seconds",
    "missing_tokens",
    "relays_every_request",
    "HandoffInputs",
    "HandoffDecision",
    "decide_handoff",
    "effective_handoff_mode",
    "rld_load",
    "sent_fraction",
    "should_cut_off",
    "predict_rld_finishes_first",
    "TransferView",
    "pick_next",
    "InstanceLoad",
    "choose_instance",
]
