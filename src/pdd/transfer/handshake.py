"""The connection handshake of pdd instances: hellos, identity and fingerprint checks, and the
per-connection fast-path MAC keys.

The connecting side sends ``hello {proto, role, instance, fingerprint}``; the accepting side
checks it with ``handshake_check(local_fp, remote_fp)`` (default :func:`default_handshake_check`)
and answers ``hello`` (its own identity) or ``error {error: reason}`` then closes; the
connecting side checks the answer the same way. A failed check raises :class:`HandshakeError`
(a ``ConnectionError``). :func:`client_handshake` and :func:`server_handshake` run over a
:class:`~pdd.transfer.peer.Peer` that is not started yet; :func:`pdd.transfer.client.connect`
and :class:`pdd.transfer.server.Server` call them.

Authentication (``pdd.security`` builds the contexts and keys for a topology): over mutual TLS
the server reads the client certificate's common name (:func:`cert_common_name`) and, with
``check_identity``, refuses a hello that names another instance. Over the in-datacenter fast
path (no TLS) every frame, the hellos included, carries a keyed MAC (``wire.FrameMac``): the
hellos under HMAC keys derived from the shared key, then each connection derives its own pair
of keys (one per direction) from the shared key and a random nonce from each side's hello
(:func:`session_macs`) and counts frames in each direction, so a frame replayed from another
connection, or reordered or dropped within one, fails its MAC. A plain connection without a MAC
is refused unless the server allows plain connections.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import os
from typing import Optional

from . import messages, wire
from .peer import Peer
from .wire import FrameMac, MacError, WireError

__all__ = [
    "PROTO",
    "HANDSHAKE_TIMEOUT_S",
    "HandshakeError",
    "default_handshake_check",
    "hello_header",
    "session_macs",
    "cert_common_name",
    "client_handshake",
    "server_handshake",
]

PROTO = 1  # rpc protocol revision carried in "hello"
HANDSHAKE_TIMEOUT_S = 10.0


class HandshakeError(ConnectionError):
    """The two sides refused each other at connect time (e.g. KV fingerprint mismatch)."""


def default_handshake_check(local_fp: Optional[dict], remote_fp: Optional[dict]) -> None:
    """Refuse peers whose KV fingerprints disagree.

    A side without a fingerprint (``None``, e.g. the gateway or the link control client) is
    accepted by anyone. Otherwise every key present in both dicts must have equal values
    (so adding a key on one side stays compatible). Raises :class:`HandshakeError`.
    """
    if local_fp is None or remote_fp is None:
        return
    if not isinstance(local_fp, dict) or not isinstance(remote_fp, dict):
        raise HandshakeError(f"fingerprints must be dicts, got {type(local_fp).__name__}/{type(remote_fp).__name__}")
    diffs = {k: (local_fp[k], remote_fp[k]) for k in local_fp.keys() & remote_fp.keys() if local_fp[k] != remote_fp[k]}
    if diffs:
        detail = ", ".join(f"{k}: local={a!r} remote={b!r}" for k, (a, b) in sorted(diffs.items()))
        raise HandshakeError(f"KV fingerprint mismatch ({detail})")


NONCE_BYTES = 16  # random bytes of each side's fast-path hello nonce


def hello_header(role: str, instance: str, fingerprint: Optional[dict], heartbeat_s: Optional[float] = None) -> dict:
    """This side's ``hello`` header; ``heartbeat_s`` adds ``hb``: this side sends heartbeats and expects them."""
    return messages.Hello(PROTO, role, instance, fingerprint,
                          hb=float(heartbeat_s) if heartbeat_s else messages.OMIT).wire()


def _mac(master: bytes, label: bytes, alg: str = "hmac") -> FrameMac:
    """A direction's MAC state under a key derived from the shared fast-path key."""
    return FrameMac(hmac.new(master, b"pdd-fastpath-v1 " + label, hashlib.sha256).digest(), alg)


def session_macs(master: bytes, cn: bytes, sn: bytes) -> tuple[FrameMac, FrameMac]:
    """(client->server, server->client) MAC states of one connection (after the hellos): AES-GMAC
    under keys that exist for this connection only (both sides' random nonces), so its counter
    nonces never repeat under a key; the hellos themselves use HMAC."""
    return _mac(master, b"c2s " + cn + sn, "gmac"), _mac(master, b"s2c " + cn + sn, "gmac")


def cert_common_name(peercert: Optional[dict]) -> Optional[str]:
    """The commonName of a certificate as ``ssl.SSLSocket.getpeercert()`` returns it."""
    for rdn in (peercert or {}).get("subject", ()):
        for k, v in rdn:
            if k == "commonName":
                return v
    return None


async def _write_raw(peer: Peer, header: dict, mac: Optional[FrameMac] = None) -> None:
    for b in wire.encode_frame(header, mac=mac):
        peer.writer.write(b)
    await peer.writer.drain()


async def client_handshake(peer: Peer, hello: dict, check, timeout: float, mac_key: Optional[bytes] = None) -> None:
    """The connecting side: send ``hello`` (with a nonce, MAC'd, under ``mac_key``), read and check
    the answer within ``timeout`` seconds; sets ``peer``'s hellos, ``auth`` and MAC states.
    Raises :class:`HandshakeError` (refused, or ``check(local_fp, remote_fp)`` raised)."""
    cn = os.urandom(NONCE_BYTES) if mac_key is not None else None
    if cn is not None:
        hello = {**hello, "nonce": cn}
    await _write_raw(peer, hello, _mac(mac_key, b"hello c2s") if mac_key is not None else None)

    async def read_reply():
        prefix = await peer.reader.readexactly(wire.PREFIX_BYTES)
        flags = wire.decode_prefix(prefix, wire.MAX_HEADER_BYTES)[0]
        mac = _mac(mac_key, b"hello s2c " + cn) if (mac_key is not None and flags & wire.FLAG_MAC) else None
        return await wire.read_frame_rest(peer.reader, prefix, wire.MAX_HEADER_BYTES, mac), mac

    try:
        (h, _), mac = await asyncio.wait_for(read_reply(), timeout)
    except MacError as e:
        raise HandshakeError(f"server failed fast-path authentication: {e}") from None
    if h.get("t") == "error":
        raise HandshakeError(f"peer refused connection: {h.get('error')}")
    if h.get("t") != "hello":
        raise HandshakeError(f"expected 'hello', got {h.get('t')!r}")
    if h.get("proto") != PROTO:
        raise HandshakeError(f"rpc proto mismatch: local {PROTO}, remote {h.get('proto')!r}")
    if mac_key is not None:
        sn = h.get("nonce")
        if mac is None or not isinstance(sn, bytes) or len(sn) != NONCE_BYTES:
            raise HandshakeError("server did not authenticate its hello with the fast-path key")
        peer.mac_tx, peer.mac_rx = session_macs(mac_key, cn, sn)
        peer.auth = "mac"
    check(hello.get("fingerprint"), h.get("fingerprint"))
    peer.local_hello, peer.remote_hello = hello, h


async def server_handshake(
    peer: Peer,
    hello: dict,
    check,
    timeout: float,
    *,
    tls: bool = False,
    mac_key: Optional[bytes] = None,
    allow_plain: bool = True,
    check_identity: bool = False,
) -> None:
    """The accepting side: read and check the client's ``hello`` (its MAC, ``tls`` certificate name
    with ``check_identity``, ``allow_plain``, ``check``) and answer with ``hello`` or ``error``;
    sets ``peer``'s hellos, ``auth`` and MAC states. Raises :class:`HandshakeError` (answered
    with ``error`` first), or the stream's error when the peer is gone or not a pdd stream."""
    prefix = await asyncio.wait_for(peer.reader.readexactly(wire.PREFIX_BYTES), timeout)
    mac_rx = None
    try:
        flags = wire.decode_prefix(prefix, wire.MAX_HEADER_BYTES)[0]
        if flags & wire.FLAG_MAC:
            if mac_key is None:
                raise HandshakeError("this server holds no fast-path MAC key (use TLS)")
            mac_rx = _mac(mac_key, b"hello c2s")
        elif not tls and not allow_plain:
            raise HandshakeError("unauthenticated connection refused: mutual TLS or a fast-path MAC is required")
        h, _ = await asyncio.wait_for(wire.read_frame_rest(peer.reader, prefix, wire.MAX_HEADER_BYTES, mac_rx), timeout)
        if h.get("t") != "hello":
            raise HandshakeError(f"expected 'hello', got {h.get('t')!r}")
        if h.get("proto") != PROTO:
            raise HandshakeError(f"rpc proto mismatch: local {PROTO}, remote {h.get('proto')!r}")
        cn = h.get("nonce")
        if mac_rx is not None and (not isinstance(cn, bytes) or len(cn) != NONCE_BYTES):
            raise HandshakeError("fast-path hello without a valid nonce")
        if tls:
            name = cert_common_name(peer.writer.get_extra_info("peercert"))
            peer.cert_name = name
            if check_identity and name != h.get("instance"):
                raise HandshakeError(f"hello names instance {h.get('instance')!r} but the TLS certificate is {name!r}")
        check(hello.get("fingerprint"), h.get("fingerprint"))
    except Exception as e:
        if isinstance(e, WireError) and not isinstance(e, MacError):
            raise  # not a pdd stream (or out of sync): close without an answer
        if not isinstance(e, HandshakeError) and isinstance(
            e, (asyncio.IncompleteReadError, asyncio.TimeoutError, TimeoutError, ConnectionError)
        ):
            raise  # the peer went away: nobody to answer
        if isinstance(e, MacError):
            e = HandshakeError(f"fast-path authentication failed: {e}")
        try:
            await _write_raw(peer, messages.Error(str(e)).wire())
        except Exception:
            pass
        raise HandshakeError(str(e)) from None
    if mac_rx is not None:
        sn = os.urandom(NONCE_BYTES)
        hello = {**hello, "nonce": sn}
        await _write_raw(peer, hello, _mac(mac_key, b"hello s2c " + cn))
        peer.mac_rx, peer.mac_tx = session_macs(mac_key, cn, sn)
    else:
        await _write_raw(peer, hello)
    peer.auth = "tls" if tls else ("mac" if mac_rx is not None else None)
    peer.local_hello, peer.remote_hello = hello, h
