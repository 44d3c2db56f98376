"""vLLM as a pdd tier: vLLM's OpenAI server takes MD's role (docs/VLLM_TIER.md).

- :mod:`pdd.vllm_tier.staging`: the staged-KV file both sides share (torch only).
- :mod:`pdd.vllm_tier.connector`: ``PddConnector``, the ``KVConnectorBase_V1`` subclass vLLM
  loads with ``--kv-transfer-config`` (runs inside vLLM's processes: imports vllm, torch and
  :mod:`pdd.vllm_tier.staging` only).
- :mod:`pdd.vllm_tier.md`: the MD endpoint (pdd's wire, DRC, staging) that starts the vLLM server
  and turns the handoff into a streaming completion.

This package's ``__init__`` imports nothing: vLLM's processes import the connector without pdd's
other dependencies.
"""
