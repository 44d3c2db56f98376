"""KV transfer and networking: framing (wire), one persistent connection (peer), its handshake
(handshake), the accepting and connecting sides (server, client), KV page streaming (kv), sender
pacing (pacing) and the WAN line emulator (link, its own process).

No torch imports here: payloads are plain bytes-like objects.
"""

from .wire import CrcError, WireError, encode_frame, read_frame, write_frame
from .peer import Peer, RemoteError
from .handshake import HandshakeError, default_handshake_check
from .server import Server
from .client import PeerPool, connect, connect_cached
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
