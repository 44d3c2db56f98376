"""The raw bytes of a token id: the GPT-2 ByteLevel pieces mapped back to bytes (shared by the
gateway's logprobs text, ``pdd.gateway.openai_text``, and structured outputs,
``pdd.structured``). Imports nothing of pdd."""

from __future__ import annotations

from functools import lru_cache


@lru_cache(maxsize=1)
def byte_decoder() -> dict[str, int]:
    """GPT-2 ByteLevel: the printable character standing for each byte, inverted (the mapping
    of OpenAI's GPT-2 ``bytes_to_unicode``, which ByteLevel pre-tokenizers use)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(bs, cs)}


def is_byte_level(tokenizer) -> bool:
    """True when ``tokenizer`` (a ``tokenizers.Tokenizer``) decodes with ByteLevel."""
    return type(getattr(tokenizer, "decoder", None)).__name__ == "ByteLevel"


def token_bytes(tokenizer, token_id: int, byte_level: bool | None = None) -> bytes:
    """The bytes token ``token_id`` stands for: its ByteLevel piece mapped back to bytes when the
    tokenizer is ByteLevel and the piece is made of byte characters (a special token's piece
    is its text), else the UTF-8 of its decoded text."""
    if byte_level is None:
        byte_level = is_byte_level(tokenizer)
    if byte_level:
        piece = tokenizer.id_to_token(token_id)
        bd = byte_decoder()
        if piece is not None and all(c in bd for c in piece):
            return bytes(bd[c] for c in piece)
    return tokenizer.decode([token_id], skip_special_tokens=False).encode("utf-8")
