"""``pdd launch --join GATEWAY_URL``: once the instance being launched listens, add it to the
running gateway (``POST /pdd/instances``, docs/SERVE.md "Elastic topology")."""

from __future__ import annotations

import os
import socket
import sys
import threading
import time

from pdd.text import shown

JOIN_TIMEOUT_S = 180.0


def gateway_url_problem(url: str) -> str | None:
    """Why ``url`` is not a gateway URL (``http[s]://host[:port]``, port 1-65535, default 80 / 443
    as in any HTTP client; no path, query or fragment; no whitespace or control character anywhere,
    as the URL is used as given: urlsplit drops a tab or newline and a leading space, the HTTP
    client does not), or None."""
    from urllib.parse import urlsplit

    u = url or ""
    if any(c.isspace() or ord(c) < 32 or ord(c) == 127 for c in u):
        return f"{url!r} has whitespace or a control character (expected http://host:port)"
    try:
        parts = urlsplit(u)
        if "[" in parts.netloc or "]" in parts.netloc:
            parts.hostname  # ValueError for an unbalanced IPv6 bracket
        port = parts.port  # ValueError for a port that is not a number in 0-65535
    except ValueError as e:
        if "IPv6" in str(e):
            return f"{url!r} has a malformed IPv6 host (expected e.g. http://[::1]:8000)"
        return f"{url!r} has a bad port (expected http://host:port, port 1-65535)"
    if parts.scheme not in ("http", "https"):
        return f"{url!r} is not an http:// or https:// URL (expected e.g. http://127.0.0.1:8000)"
    if not parts.hostname:
        return f"{url!r} names no host (expected http://host:port)"
    if port == 0:
        return f"{url!r} has port 0 (expected 1-65535)"
    if parts.path not in ("", "/") or parts.query or parts.fragment:
        return f"{url!r} has a path, query or fragment (expected the gateway's root, http://host:port)"
    return None


def join_body(spec, host: str) -> dict:
    return {"role": spec.role, "name": spec.name, "address": f"{host}:{spec.port}"}


def api_key(cfg) -> str | None:
    return os.environ.get("PDD_API_KEY") or (cfg.security.api_keys[0] if cfg.security.api_keys else None)


def join(cfg, spec, url: str, timeout_s: float = JOIN_TIMEOUT_S, poll_s: float = 0.2) -> dict:
    """Wait until ``spec``'s port accepts connections, then ask the gateway at ``url`` to add it.
    Returns the gateway's answer (a member, or ``{"error": ...}``). The check connects and closes
    without a byte, which the instance's server counts as a probe (``Server.probes``), not as a
    refused connection."""
    import httpx

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((cfg.host, spec.port), timeout=1):
                break
        except OSError:
            time.sleep(poll_s)
    else:
        return {"error": {"message": f"{spec.name} did not listen on {cfg.host}:{spec.port} in {timeout_s:.0f} s"}}
    key = api_key(cfg)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    body = join_body(spec, cfg.host)
    try:
        r = httpx.post(url.rstrip("/") + "/pdd/instances", json=body, headers=headers,
                       timeout=max(5.0, deadline - time.monotonic()), trust_env=False)
        if r.headers.get("content-type", "").startswith("application/json"):
            rep = r.json()
            if r.status_code == 409 and (rep.get("error") or {}).get("code") in ("duplicate", "duplicate_address"):
                return _already_member(url, spec, body["address"], headers) or rep
            return rep
        return {"error": {"message": f"HTTP {r.status_code}: {shown(r.text)}"}}
    except Exception as e:
        return {"error": {"message": f"{type(e).__name__}: {e}"}}


def _already_member(url: str, spec, address: str, headers: dict) -> dict | None:
    """The gateway's member for ``spec`` when it is already one at ``address`` (active or
    draining), marked ``already_member``; else None. A member that was killed and relaunched by
    hand with ``--join`` is reconnected by the gateway's watcher, so its add answers 409: that
    was printed as ``JOIN FAILED`` while the instance served."""
    import httpx

    try:
        r = httpx.get(url.rstrip("/") + "/pdd/instances", headers=headers, timeout=5.0, trust_env=False)
        members = r.json().get("data") or []
    except Exception:
        return None
    for m in members:
        if m.get("name") == spec.name and m.get("address") == address and m.get("state") in ("active", "draining"):
            return {**m, "already_member": True}
    return None


def join_when_ready(cfg, spec, url: str) -> threading.Thread:
    """:func:`join` on a daemon thread; prints ``JOINED <name> <state>`` (with ``(already a member:
    ...)`` for a member relaunched after a crash, which the gateway reconnects by itself) or ``JOIN
    FAILED <name>: why``."""

    def run():
        rep = join(cfg, spec, url)
        if "error" in rep:
            print(f"JOIN FAILED {spec.name}: {rep['error'].get('message')}", file=sys.stderr, flush=True)
        else:
            again = (" (already a member: the gateway " + ("reconnected to this process)" if rep.get("connected")
                                                           else "reconnects to this process)")
                     if rep.get("already_member") else "")
            print(f"JOINED {spec.name} {rep.get('state')}{again}", flush=True)

    t = threading.Thread(target=run, daemon=True, name=f"join-{spec.name}")
    t.start()
    return t
