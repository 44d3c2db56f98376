"""``PddConnector``: vLLM loads a request's prompt KV that pdd's P sent to the MD endpoint.

vLLM (0.32, V1 engine) builds this class twice from ``--kv-transfer-config '{"kv_connector":
"PddConnector", "kv_connector_module_path": "pdd.vllm_tier.connector", "kv_role":
"kv_consumer"}'``: once in the scheduler process (``KVConnectorRole.SCHEDULER``), once per worker
(``WORKER``). A request is a pdd request when its completion body carries ``kv_transfer_params``
with a ``pdd_stage`` entry (:mod:`pdd.vllm_tier.staging`): the prompt KV of its first
``num_tokens`` tokens, staged by the MD endpoint (:mod:`pdd.vllm_tier.md`) before the request
was posted. Other requests run as on stock vLLM.

Scheduler side:

- ``get_num_new_matched_tokens(request, num_computed_tokens)``: the staged tokens beyond vLLM's
  own prefix hit, loaded synchronously (``load_async`` False: the file is complete before the
  request exists, so the load is a host copy inside the step that computes the rest). The
  staged tokens never reach the request's last token (the prompt vLLM gets is prompt + at least
  one handed-over id), so vLLM always has a token to compute and sample from.
- ``update_state_after_alloc``: remembers the load of ``[num_computed, num_tokens)``.
- ``build_connector_meta``: per load, the stage and the request's block ids (a new request, or
  one resumed after preemption, whose blocks were freed: it loads again).
- ``request_finished``: nothing to save; blocks are freed at once. The MD endpoint deletes the
  file when the request's stream ends.

Worker side: ``start_load_kv`` writes each layer's staged K and V of the loaded tokens into the
layer's paged KV through the attention backend's own ``do_kv_cache_update`` (the op vLLM's
forward writes new KV with), so the block interior layout (the CPU backend's per-ISA packing,
the CUDA backends' layouts) is the backend's business; the connector only computes the slot of
each token from the block ids: ``block_ids[t // block_size] * block_size + t % block_size``. The
copy runs before the forward pass (not layer by layer under ``wait_for_layer_load``).

Imports vLLM, torch and :mod:`pdd.vllm_tier.staging` only (it runs in vLLM's processes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.logger import init_logger
from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1, KVConnectorMetadata,
                                                                 KVConnectorRole)

from pdd.vllm_tier.staging import Stage, layer_index, slot_mapping, token_rows

if TYPE_CHECKING:
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.sched.output import SchedulerOutput

log = init_logger("vllm.pdd_connector")  # under "vllm": vLLM's log handlers print it

@dataclass
class PddLoad:
    """One request's load in one step: staged tokens ``[start, end)`` into ``block_ids``."""

    req_id: str
    stage: Stage
    block_ids: list[int]
    start: int
    end: int


@dataclass
class PddConnectorMetadata(KVConnectorMetadata):
    loads: list[PddLoad] = field(default_factory=list)


class PddConnector(KVConnectorBase_V1):
    def __init__(self, vllm_config, role: KVConnectorRole, kv_cache_config=None):
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self.block_size = int(vllm_config.cache_config.block_size)
        # scheduler side: req_id -> (stage, first token to load, end), planned and not yet sent
        self._planned: dict[str, tuple[Stage, int, int]] = {}
        # scheduler side: every pdd request still alive (a resumed one loads again)
        self._stages: dict[str, Stage] = {}
        self.loaded_tokens = 0  # worker side: tokens written into vLLM's KV (all layers count once)
        self.loads = 0

    # ------------------------------------------------------------------ scheduler side
    def get_num_new_matched_tokens(self, request, num_computed_tokens: int) -> tuple[int | None, bool]:
        try:
            stage = Stage.from_params(getattr(request, "kv_transfer_params", None))
        except ValueError as e:
            log.warning("request %s: %s; computing its prompt instead", request.request_id, e)
            return 0, False
        if stage is None:
            return 0, False
        # the last prompt token is always computed here (it yields the logits vLLM samples from)
        end = min(stage.num_tokens, len(request.prompt_token_ids or []) - 1)
        self._stages[request.request_id] = stage
        return max(0, end - num_computed_tokens), False

    def update_state_after_alloc(self, request, blocks, num_external_tokens: int):
        if num_external_tokens <= 0:
            self._planned.pop(request.request_id, None)
            return
        stage = self._stages[request.request_id]
        end = min(stage.num_tokens, len(request.prompt_token_ids or []) - 1)
        self._planned[request.request_id] = (stage, end - num_external_tokens, end)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = PddConnectorMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            plan = self._planned.pop(new.req_id, None)
            if plan is not None:
                meta.loads.append(PddLoad(new.req_id, plan[0], list(new.block_ids[0]), plan[1], plan[2]))
        cached = scheduler_output.scheduled_cached_reqs
        resumed = getattr(cached, "resumed_req_ids", set()) or set()
        for i, req_id in enumerate(cached.req_ids):
            plan = self._planned.pop(req_id, None)
            if plan is None:
                continue
            new_blocks = cached.new_block_ids[i]
            if req_id not in resumed or new_blocks is None:  # cannot happen for a sync load: say so
                log.warning("request %s: a planned load without its blocks; vLLM computes those tokens", req_id)
                continue
            meta.loads.append(PddLoad(req_id, plan[0], list(new_blocks[0]), plan[1], plan[2]))
        for req_id in list(self._planned):  # planned for a request this step did not schedule
            log.debug("request %s: load not scheduled this step", req_id)
        return meta

    def request_finished(self, request, block_ids) -> tuple[bool, dict[str, Any] | None]:
        self._stages.pop(request.request_id, None)
        self._planned.pop(request.request_id, None)
        return False, None

    # ------------------------------------------------------------------ worker side
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, PddConnectorMetadata) or not meta.loads:
            return
        layers = {name: layer for name, layer in forward_context.no_compile_layers.items()
                  if getattr(layer, "kv_cache", None) is not None and hasattr(getattr(layer, "impl", None),
                                                                              "do_kv_cache_update")}
        for ld in meta.loads:
            self.load_into(ld, layers)

    def load_into(self, ld: PddLoad, layers: dict) -> None:
        """Write ``ld``'s staged tokens into each attention layer's paged KV (``layers``: name ->
        vLLM attention layer with ``kv_cache`` and ``impl``)."""
        if ld.end <= ld.start:
            return
        pages = ld.stage.load()
        slots = slot_mapping(ld.block_ids, self.block_size, ld.start, ld.end)
        for name, layer in layers.items():
            kv_cache = layer.kv_cache
            if isinstance(kv_cache, (list, tuple)):  # older vLLMs: one per virtual engine
                kv_cache = kv_cache[0]
            k, v = token_rows(pages, layer_index(name), ld.start, ld.end)
            dtype = kv_cache.dtype if kv_cache.dtype in (torch.float32, torch.bfloat16, torch.float16) else k.dtype
            k = k.to(device=kv_cache.device, dtype=dtype).contiguous()
            v = v.to(device=kv_cache.device, dtype=dtype).contiguous()
            layer.impl.do_kv_cache_update(layer, k, v, kv_cache, slots.to(kv_cache.device))
        self.loaded_tokens += ld.end - ld.start
        self.loads += 1
        log.debug("pdd: loaded %d staged tokens [%d, %d) of %s into %d layers", ld.end - ld.start, ld.start,
                 ld.end, ld.req_id, len(layers))

    def wait_for_layer_load(self, layer_name: str) -> None:
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata, **kwargs: Any) -> None:
        return  # a consumer: nothing is saved

    def wait_for_save(self):
        return
