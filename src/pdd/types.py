"""Small state records shared by the engine, the runtime roles, the policy layer and the simulator.

Nothing here imports torch, sockets or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum


class Pipeline(str, Enum):
    """Which instances serve a request (PDD report, "Pipelines").

    ``P_RLD`` (finish on the relay without ever reaching MD) is never *planned*: it exists
    only as the ``--allow-p-rld`` ablation and the degraded mode when no MD is reachable.
    """

    COLOCATED = "colocated"  # one engine prefills and decodes
    P_D = "p_d"  # same-DC PD: decode in datacenter A over the fast path
    P_MD = "p_md"  # prefill in A, decode in B over the WAN (delta transfer against MD's cache)
    P_RLD_MD = "p_rld_md"  # relay decode in A hides the WAN transfer, hands over to MD
    P_RLD = "p_rld"  # ablation / degraded only


class FinishReason(str, Enum):
    STOP = "stop"  # EOS or a stop token / string
    LENGTH = "length"  # max_tokens reached
    ABORT = "abort"


@dataclass
class SamplingParams:
    """Per-request decoding parameters (OpenAI / vLLM names).

    ``max_tokens`` counts output tokens including the first one sampled by P.
    ``temperature == 0`` means greedy.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = -1
    seed: int | None = None
    ignore_eos: bool = False
    stop_token_ids: list[int] = field(default_factory=list)
    # vLLM / OpenAI extras; neutral defaults leave sampling exactly as above
    min_p: float = 0.0
    presence_penalty: float = 0.0  # output tokens only
    frequency_penalty: float = 0.0  # output tokens only
    repetition_penalty: float = 1.0  # prompt + output tokens (vLLM semantics)
    min_tokens: int = 0  # EOS and stop_token_ids are masked while fewer outputs exist
    logprobs: int | None = None  # None: none; k >= 0: the sampled token's logprob + top k
    logit_bias: dict[int, float] = field(default_factory=dict)
    # vLLM's allowed_token_ids: only these ids can be sampled (None: every id)
    allowed_token_ids: list[int] | None = None
    # vLLM's bad_words as the gateway tokenised them (each word with and without a leading space):
    # a sequence's last id is masked when the outputs so far end with the ids before it
    bad_words_token_ids: list[list[int]] = field(default_factory=list)
    # the words themselves, for a tier that hands them to vLLM (pdd.vllm_tier.md), which tokenises them
    bad_words: list[str] = field(default_factory=list)
    # structured outputs (pdd.structured): llguidance grammar text compiled by the gateway; every
    # tier masks each position to the ids it allows after the outputs so far (None: no constraint)
    grammar: str | None = None
    # the constraint as the request gave it ({kind: value}, pdd.structured.KINDS), for a tier
    # that hands it to vLLM (pdd.vllm_tier.md)
    structured: dict | None = None
    # recovery (gateway.orchestrator): the prompt's last ``output_offset`` tokens are outputs an
    # earlier attempt streamed. Draws, min_tokens and presence/frequency penalties then count
    # them as outputs (output position = output_offset + this attempt's index), so a recovered
    # request samples exactly what an unfaulted one would; max_tokens counts this attempt only.
    output_offset: int = 0

    def to_dict(self) -> dict:
        d = {
            "max_tokens": self.max_tokens,
            "temperature": self.temperature,
            "top_p": self.top_p,
            "top_k": self.top_k,
            "seed": self.seed,
            "ignore_eos": self.ignore_eos,
            "stop_token_ids": list(self.stop_token_ids),
            "min_p": self.min_p,
            "presence_penalty": self.presence_penalty,
            "frequency_penalty": self.frequency_penalty,
            "repetition_penalty": self.repetition_penalty,
            "min_tokens": self.min_tokens,
            "logprobs": self.logprobs,
            "output_offset": self.output_offset,
        }
        if self.logit_bias:  # msgpack maps need str-or-int keys; a list of pairs is unambiguous
            d["logit_bias"] = [[int(k), float(v)] for k, v in self.logit_bias.items()]
        # sent only when set: a request that does not use them carries no extra header bytes
        if self.allowed_token_ids is not None:
            d["allowed_token_ids"] = [int(t) for t in self.allowed_token_ids]
        if self.bad_words_token_ids:
            d["bad_words_token_ids"] = [[int(t) for t in w] for w in self.bad_words_token_ids]
        if self.bad_words:
            d["bad_words"] = list(self.bad_words)
        if self.grammar is not None:
            d["grammar"] = self.grammar
            d["structured"] = self.structured
        return d

    @classmethod
    def from_dict(cls, d: dict) -> "SamplingParams":
        kw = {k: v for k, v in d.items() if k in cls.__dataclass_fields__}
        lb = kw.get("logit_bias")
        if lb is not None:
            kw["logit_bias"] = {int(k): float(v) for k, v in (lb.items() if isinstance(lb, dict) else lb)}
        if kw.get("allowed_token_ids") is not None:
            kw["allowed_token_ids"] = [int(t) for t in kw["allowed_token_ids"]]
        if kw.get("bad_words_token_ids"):
            kw["bad_words_token_ids"] = [[int(t) for t in w] for w in kw["bad_words_token_ids"]]
        return cls(**kw)
