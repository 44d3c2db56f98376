"""Security of a topology's links: a CA and per-instance certificates, TLS contexts, the
fast-path MAC key, and the gateway's optional API keys.

What is protected how (``ClusterConfig.security``, :class:`pdd.config.SecurityConfig`):

- **Mutual TLS** (``tls: true``, the default) on every connection that leaves a datacenter
  (P -> MD and gateway -> MD cross the WAN emulator, which only forwards bytes: TLS runs end to
  end through it) and on all control traffic (gateway <-> P, RLD, MD). Servers require a client
  certificate signed by the topology's CA and whose common name is the instance named in its
  hello; clients verify that the server's certificate carries the instance name they dialled.
- **Keyed MAC** (``fast_path: mac``, the default) on the in-datacenter fast path P -> RLD (and
  P -> D in ``same_dc_pd``), which stands in for RDMA where TLS is not used: every frame carries
  a 128-bit tag (AES-GMAC; HMAC-SHA256 for the hellos) under per-connection keys derived from the
  topology's ``fastpath.key`` (``pdd.transfer.handshake``). A frame that fails it is dropped undecoded, counted, and the
  connection closed, so it never reaches a handler (never a radix cache).
- ``tls: false`` is the off switch for benchmarking: control and cross-datacenter connections
  go plain (and servers accept unauthenticated peers).
- ``api_keys``: when set, the gateway answers 401 to HTTP requests without
  ``Authorization: Bearer <key>`` (or ``x-api-key``), except ``/health``
  (:class:`ApiKeyMiddleware`).

Files (``pdd certs --config FILE --out DIR``, or made by the launcher in ``<log_dir>/certs``
when ``security.cert_dir`` is not set): ``ca.pem``, ``ca.key``, ``<instance>.pem`` and
``<instance>.key`` for each instance that terminates connections (engines and the gateway),
``fastpath.key`` (32 random bytes). Keys are written mode 0600. Certificates use ECDSA P-256 and
carry SANs ``DNS:<instance>``, ``DNS:localhost``, ``IP:127.0.0.1`` and the topology's host.
"""

from __future__ import annotations

import datetime as _dt
import functools
import hmac
import ipaddress
import json
import os
import ssl
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable, Optional

__all__ = [
    "CA_CERT",
    "CA_KEY",
    "FAST_PATH_KEY",
    "SecurityError",
    "make_certs",
    "cert_names",
    "ensure_topology_certs",
    "server_context",
    "client_context",
    "read_mac_key",
    "LinkSecurity",
    "link_security",
    "ApiKeyMiddleware",
]

CA_CERT = "ca.pem"
CA_KEY = "ca.key"
FAST_PATH_KEY = "fastpath.key"
MAC_KEY_BYTES = 32
DEFAULT_DAYS = 825


class SecurityError(RuntimeError):
    """Missing or unusable security material (the message says what to run)."""


# ------------------------------------------------------------------------ certificates
def _write_private(path: Path, data: bytes) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as f:
        f.write(data)
    os.chmod(path, 0o600)


def _san(name: str, hosts: Iterable[str]):
    from cryptography import x509

    dns, ips = [name, "localhost"], []
    for h in hosts:
        try:
            ips.append(ipaddress.ip_address(h))
        except ValueError:
            dns.append(h)
    seen_dns = list(dict.fromkeys(dns))
    seen_ips = list(dict.fromkeys(ips))
    return x509.SubjectAlternativeName([x509.DNSName(d) for d in seen_dns] + [x509.IPAddress(i) for i in seen_ips])


def _load_ca(out: Path):
    from cryptography import x509
    from cryptography.hazmat.primitives import serialization

    cert = x509.load_pem_x509_certificate((out / CA_CERT).read_bytes())
    key_path = out / CA_KEY
    key = serialization.load_pem_private_key(key_path.read_bytes(), None) if key_path.exists() else None
    return cert, key


def _make_ca(out: Path, ca_name: str, days: int):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, ca_name), x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdd")])
    now = _dt.datetime.now(_dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(name)
        .issuer_name(name)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=False, key_cert_sign=True, crl_sign=True,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .sign(key, hashes.SHA256())
    )
    _write_private(out / CA_KEY, key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                   serialization.NoEncryption()))
    (out / CA_CERT).write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    return cert, key


def _issue(out: Path, name: str, hosts: Iterable[str], ca_cert, ca_key, days: int) -> None:
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    now = _dt.datetime.now(_dt.timezone.utc)
    cert = (
        x509.CertificateBuilder()
        .subject_name(x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, name),
                                 x509.NameAttribute(NameOID.ORGANIZATION_NAME, "pdd")]))
        .issuer_name(ca_cert.subject)
        .public_key(key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - _dt.timedelta(minutes=5))
        .not_valid_after(now + _dt.timedelta(days=days))
        .add_extension(_san(name, hosts), critical=False)
        .add_extension(x509.BasicConstraints(ca=False, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(digital_signature=True, content_commitment=False, key_encipherment=False,
                          data_encipherment=False, key_agreement=True, key_cert_sign=False, crl_sign=False,
                          encipher_only=False, decipher_only=False),
            critical=True,
        )
        .add_extension(x509.ExtendedKeyUsage([ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]),
                       critical=False)
        .add_extension(x509.SubjectKeyIdentifier.from_public_key(key.public_key()), critical=False)
        .add_extension(x509.AuthorityKeyIdentifier.from_issuer_public_key(ca_cert.public_key()), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    _write_private(out / f"{name}.key", key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                                          serialization.NoEncryption()))
    (out / f"{name}.pem").write_bytes(cert.public_bytes(serialization.Encoding.PEM))


def make_certs(
    out_dir: str | Path,
    names: Iterable[str],
    hosts: Iterable[str] = ("127.0.0.1", "localhost"),
    *,
    days: int = DEFAULT_DAYS,
    ca_name: str = "pdd topology CA",
    force: bool = False,
) -> dict:
    """Make (or complete) a cert dir: the CA, a certificate + key per name, ``fastpath.key``.

    Idempotent: what exists is kept (``force``: make everything anew, a new CA included).
    Returns ``{"dir", "ca": "made" | "kept", "issued": [...], "kept": [...], "fast_path_key": "made" | "kept"}``.
    Raises :class:`SecurityError` when a certificate is missing and the CA's key is not there.
    """
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    os.chmod(out, 0o700)
    hosts = list(hosts)
    report: dict = {"dir": str(out.resolve()), "issued": [], "kept": []}
    if force or not (out / CA_CERT).exists():
        ca_cert, ca_key = _make_ca(out, ca_name, days)
        report["ca"] = "made"
        force = True  # certificates of an older CA would not verify
    else:
        ca_cert, ca_key = _load_ca(out)
        report["ca"] = "kept"
    for name in dict.fromkeys(names):
        if not force and (out / f"{name}.pem").exists() and (out / f"{name}.key").exists():
            report["kept"].append(name)
            continue
        if ca_key is None:
            raise SecurityError(f"{out}: no certificate for {name!r} and no {CA_KEY} to issue one; "
                                f"run `pdd certs --out {out}` where the CA key is")
        _issue(out, name, hosts, ca_cert, ca_key, days)
        report["issued"].append(name)
    if force or not (out / FAST_PATH_KEY).exists():
        _write_private(out / FAST_PATH_KEY, os.urandom(MAC_KEY_BYTES).hex().encode() + b"\n")
        report["fast_path_key"] = "made"
    else:
        report["fast_path_key"] = "kept"
    return report


def cert_names(cfg) -> list[str]:
    """Instances of ``cfg``'s topology that terminate connections (engines and the gateway;
    not the WAN emulator, which only forwards bytes)."""
    from pdd.topology import ROLE_LINK, layout

    return [s.name for s in layout(cfg).instances if s.role != ROLE_LINK]


def ensure_topology_certs(cfg, out_dir: str | Path, force: bool = False) -> dict:
    """:func:`make_certs` for every instance of ``cfg``'s topology (SANs: its host too)."""
    hosts = list(dict.fromkeys([cfg.host, "127.0.0.1", "localhost"]))
    return make_certs(out_dir, cert_names(cfg), hosts, force=force)


CERT_DIR_UNSET = ("security.cert_dir is not set: make certificates with `pdd certs --config FILE --out DIR` and "
                  "set security.cert_dir (pdd serve and the demo make them in their log dir), or set "
                  "security.tls: false and security.fast_path: plain")


def needs_material(sec) -> bool:
    """Whether a :class:`~pdd.config.SecurityConfig` needs a cert dir (TLS or the fast-path MAC)."""
    return bool(sec.tls) or sec.fast_path in ("mac", "tls")


# ------------------------------------------------------------------------ contexts and keys
def _need(cert_dir: Path, *files: str) -> None:
    for f in files:
        if not (cert_dir / f).exists():
            raise SecurityError(f"{cert_dir / f} is missing; make the topology's certificates with "
                                f"`pdd certs --config FILE --out {cert_dir}`")


@functools.lru_cache(maxsize=64)
def server_context(cert_dir: str | Path, name: str) -> ssl.SSLContext:
    """TLS 1.3 server context of instance ``name``: its certificate, client certificates required
    (signed by the topology's CA)."""
    d = Path(cert_dir)
    _need(d, CA_CERT, f"{name}.pem", f"{name}.key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(d / f"{name}.pem", d / f"{name}.key")
    ctx.load_verify_locations(cafile=str(d / CA_CERT))
    ctx.verify_mode = ssl.CERT_REQUIRED
    return ctx


@functools.lru_cache(maxsize=64)
def client_context(cert_dir: str | Path, name: str) -> ssl.SSLContext:
    """TLS 1.3 client context of instance ``name``: presents its certificate, verifies the
    server's against the topology's CA and the name it dials (``server_hostname``)."""
    d = Path(cert_dir)
    _need(d, CA_CERT, f"{name}.pem", f"{name}.key")
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)  # check_hostname + CERT_REQUIRED
    ctx.minimum_version = ssl.TLSVersion.TLSv1_3
    ctx.load_cert_chain(d / f"{name}.pem", d / f"{name}.key")
    ctx.load_verify_locations(cafile=str(d / CA_CERT))
    return ctx


@functools.lru_cache(maxsize=16)
def read_mac_key(cert_dir: str | Path) -> bytes:
    """The topology's fast-path MAC key (``fastpath.key``: hex, 32 bytes)."""
    d = Path(cert_dir)
    _need(d, FAST_PATH_KEY)
    try:
        key = bytes.fromhex((d / FAST_PATH_KEY).read_text().strip())
    except ValueError:
        raise SecurityError(f"{d / FAST_PATH_KEY}: not a hex key") from None
    if len(key) < 16:
        raise SecurityError(f"{d / FAST_PATH_KEY}: key too short ({len(key)} bytes, need >= 16)")
    return key


@dataclass(frozen=True)
class LinkSecurity:
    """What one instance passes to ``transfer.server.Server`` / ``transfer.client.connect`` (see the module doc).

    ``server()`` -> kwargs of its ``Server``; ``client(target, fast)`` -> kwargs of a
    ``connect`` to instance ``target`` (``fast``: the in-datacenter fast path).
    """

    name: str
    dc: str
    tls: bool
    fast_path: str  # "mac" | "tls" | "plain"
    cert_dir: Optional[str]

    def _dir(self) -> str:
        if self.cert_dir is None:
            raise SecurityError(CERT_DIR_UNSET)
        return str(Path(self.cert_dir).resolve())

    def server(self) -> dict:
        kw: dict = {}
        fast_here = self.dc == "A"  # only datacenter A has a fast path (P -> RLD / D)
        if self.tls or (fast_here and self.fast_path == "tls"):
            kw["ssl"] = server_context(self._dir(), self.name)
        if fast_here and self.fast_path == "mac":
            kw["mac_key"] = read_mac_key(self._dir())
        kw["allow_plain"] = (not self.tls) or (fast_here and self.fast_path == "plain")
        return kw

    def client(self, target: str, fast: bool = False) -> dict:
        if fast:
            if self.fast_path == "mac":
                return {"mac_key": read_mac_key(self._dir())}
            if self.fast_path == "plain":
                return {}
        elif not self.tls:
            return {}
        return {"ssl": client_context(self._dir(), self.name), "server_hostname": target}


def link_security(cfg, name: str) -> LinkSecurity:
    """The :class:`LinkSecurity` of instance ``name`` of ``cfg``'s topology."""
    from pdd.topology import layout

    sec = cfg.security
    try:
        dc = layout(cfg).get(name).dc
    except KeyError:
        dc = "A"
    return LinkSecurity(name, dc, bool(sec.tls), sec.fast_path, sec.cert_dir)


# ------------------------------------------------------------------------ gateway API keys
class ApiKeyMiddleware:
    """ASGI middleware: HTTP requests need ``Authorization: Bearer <key>`` (or ``x-api-key:
    <key>``) with one of ``keys``, else 401 with an OpenAI-style error body (also for either
    header sent twice: ambiguous credentials). ``exempt`` paths
    (health checks) pass. No keys: everything passes. Use ``app.add_middleware(ApiKeyMiddleware,
    keys=cfg.security.api_keys)``."""

    def __init__(self, app, keys: Iterable[str] = (), exempt: Iterable[str] = ("/health",)):
        self.app = app
        self.keys = [k.encode() for k in keys if k]
        self.exempt = set(exempt)

    def allowed(self, headers: dict) -> bool:
        tok = headers.get(b"x-api-key")
        auth = headers.get(b"authorization", b"")
        if auth[:7].lower() == b"bearer ":
            tok = auth[7:].strip()
        if not tok:
            return False
        ok = False
        for k in self.keys:  # compare with every key: time does not tell which one nearly matched
            ok |= hmac.compare_digest(tok, k)
        return ok

    @staticmethod
    def ambiguous(raw: list) -> str | None:
        """Why the credentials of a request's ``raw`` headers (ASGI's name-value pairs) are
        ambiguous: ``Authorization`` or ``x-api-key`` sent twice (which one counts would be this
        server's silent choice); else None. ``Authorization: Bearer`` beside ``x-api-key`` is
        not: the Bearer key decides (docs/SECURITY.md)."""
        names = {b"authorization": "Authorization", b"x-api-key": "x-api-key"}
        seen: dict[bytes, list[bytes]] = {}
        for k, v in raw:
            if k.lower() in names:
                seen.setdefault(k.lower(), []).append(v)
        for k, name in names.items():
            if len(seen.get(k, ())) > 1:
                return f"ambiguous credentials: the request has {len(seen[k])} {name} headers; send one"
        return None

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not self.keys or scope.get("path") in self.exempt:
            return await self.app(scope, receive, send)
        raw = list(scope.get("headers", ()))
        why = self.ambiguous(raw)
        if why is None and self.allowed({k.lower(): v for k, v in raw}):
            return await self.app(scope, receive, send)
        body = json.dumps({"error": {"message": why or "missing or invalid API key (Authorization: Bearer <key>)",
                                     "type": "invalid_request_error", "param": None,
                                     "code": "invalid_api_key"}}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
