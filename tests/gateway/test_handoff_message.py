"""Handoff messages carry token ids only: their size grows by 3 bytes per token id (msgpack
uint16), nowhere near a token's KV."""

from pdd.gateway.orchestrator import extend_message
from pdd.transfer.wire import frame_bytes


def _size(n: int) -> int:
    return len(frame_bytes(extend_message("r1-abcdef12", [1000 + i for i in range(n)])))


def test_handoff_size_per_token_is_three_bytes():
    assert _size(200) - _size(100) == 300
    assert _size(100) < 400  # PDD report: 100 ids ~ 1.5 KB; KV of 100 tokens of our small model: 200 KiB


def test_handoff_message_has_no_payload_and_only_ids():
    m = extend_message("r", [5, 6, 7])
    assert set(m) == {"t", "rid", "token_ids", "final"} and m["token_ids"] == [5, 6, 7]
