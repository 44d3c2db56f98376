"""KV transfer and networking: framing (wire), persistent connections (rpc), KV page
streaming (kv), sender pacing (pacing) and the WAN line emulator (link, its own process).

No torch imports here: payloads are plain bytes-like objects.
"""

from .wire import CrcError, WireError, encode_frame, read_frame, write_frame
from .rpc import (
    HandshakeError,
    Peer,
    PeerPool,
    RemoteError,
    Server,
    connect,
    connect_cached,
    default_handshake_check,
)
from .kv import (
    KVReceiver,
    KVSender,
    Transfer,
    TransferResult,
    pick_fifo,
    pick_round_robin,
    pick_shortest_remaining,
)
from .pacing import Pacer

__all__ = [
    "CrcError",
    "WireError",
    "encode_frame",
    "read_frame",
    "write_frame",
    "HandshakeError",
    "Peer",
    "PeerPool",
    "RemoteError",
    "Server",
    "connect",
    "connect_cached",
    "default_handshake_check",
    "KVReceiver",
    "KVSender",
    "Transfer",
    "TransferResult",
    "pick_fifo",
    "pick_round_robin",
    "pick_shortest_remaining",
    "Pacer",
]
