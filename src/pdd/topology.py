"""Where each instance of a topology lives: name, role, datacenter, port, and how to reach it.

Pure data derived from a :class:`~pdd.config.ClusterConfig` (read through its fields only, so
this module imports nothing of pdd and the config can check its ports with it); the launcher starts what this
describes and every instance reads it to find its peers. Every byte between datacenter A and B
goes through the link emulator: an instance in B is reached from A at the link's listen port
for it, never directly.
"""

from __future__ import annotations

import errno
from dataclasses import dataclass
from typing import Any, Protocol


class TopologyFields(Protocol):
    """The fields of :class:`pdd.config.ClusterConfig` a layout is made of."""

    mode: str
    host: str
    base_port: int
    gateway_port: int
    instances: Any  # .prefill, .relay_decode, .main_decode: instance counts

ROLE_PREFILL = "prefill"
ROLE_RELAY = "relay_decode"
ROLE_MAIN = "main_decode"
ROLE_COLOCATED = "colocated"
ROLE_GATEWAY = "gateway"
ROLE_LINK = "link"


@dataclass(frozen=True)
class InstanceSpec:
    name: str
    role: str
    dc: str  # "A" or "B"
    port: int  # the port the instance itself listens on
    wan_port: int | None = None  # link listen port that forwards to it (instances in B)

    @property
    def metrics_port(self) -> int:
        """Prometheus /metrics of an engine instance (its RPC port + 10)."""
        return self.port + 10


@dataclass(frozen=True)
class Layout:
    mode: str
    host: str
    instances: tuple[InstanceSpec, ...]
    link_control_port: int | None  # None when the mode has nothing in datacenter B

    def get(self, name: str) -> InstanceSpec:
        for s in self.instances:
            if s.name == name:
                return s
        raise KeyError(f"no instance named {name!r} in the {self.mode} topology")

    def by_role(self, role: str) -> list[InstanceSpec]:
        return [s for s in self.instances if s.role == role]

    def address_from_a(self, name: str) -> tuple[str, int, bool]:
        """(host, port, crosses_wan) for reaching ``name`` from datacenter A."""
        s = self.get(name)
        if s.dc == "B":
            assert s.wan_port is not None
            return self.host, s.wan_port, True
        return self.host, s.port, False

    @property
    def engines(self) -> list[InstanceSpec]:
        return [s for s in self.instances if s.role not in (ROLE_GATEWAY, ROLE_LINK)]


def layout(cfg: TopologyFields) -> Layout:
    """The single-machine topology of ``cfg.mode`` with ``cfg.instances`` of each tier.

    Ports (b = base_port): link control b, link listen ports b+1.. (one per instance in B),
    P b+10+i, RLD b+40+i, MD / D b+70+i (metrics: each +10), gateway ``cfg.gateway_port``
    (its /metrics on the same port). Instance names: p0.., rld0.., md0.. (d0.. in same_dc_pd).
    """
    b, n = cfg.base_port, cfg.instances
    gw = InstanceSpec("gateway", ROLE_GATEWAY, "A", cfg.gateway_port)
    if cfg.mode == "colocated":
        inst = tuple(InstanceSpec(f"c{i}", ROLE_COLOCATED, "A", b + 10 + i) for i in range(n.prefill)) + (gw,)
        return Layout(cfg.mode, cfg.host, inst, None)
    ps = tuple(InstanceSpec(f"p{i}", ROLE_PREFILL, "A", b + 10 + i) for i in range(n.prefill))
    if cfg.mode == "same_dc_pd":
        ds = tuple(InstanceSpec(f"d{i}", ROLE_MAIN, "A", b + 70 + i) for i in range(n.main_decode))
        return Layout(cfg.mode, cfg.host, ps + ds + (gw,), None)
    mds = tuple(InstanceSpec(f"md{i}", ROLE_MAIN, "B", b + 70 + i, wan_port=b + 1 + i) for i in range(n.main_decode))
    link = InstanceSpec("link", ROLE_LINK, "A", b)
    rlds = ()
    if cfg.mode == "pdd":
        rlds = tuple(InstanceSpec(f"rld{i}", ROLE_RELAY, "A", b + 40 + i) for i in range(n.relay_decode))
    return Layout(cfg.mode, cfg.host, ps + rlds + mds + (link, gw), b)


def port_users(lay: Layout) -> dict[int, list[str]]:
    """Every port ``lay``'s listeners bind -> who binds it: an instance's name for its RPC port
    (``"p0"``; ``"link"`` for the link's control port, ``"gateway"`` for the gateway's HTTP
    port), ``"p0 metrics"`` for an engine's metrics port, ``"md0 wan"`` for an MD's WAN port on
    the link; ports ascending. The ports :func:`ports_in_use` checks."""
    users: dict[int, list[str]] = {}
    for sp in lay.instances:
        users.setdefault(sp.port, []).append(sp.name)
        if sp.role not in (ROLE_GATEWAY, ROLE_LINK):
            users.setdefault(sp.metrics_port, []).append(f"{sp.name} metrics")
        if sp.wan_port is not None:
            users.setdefault(sp.wan_port, []).append(f"{sp.name} wan")
    return dict(sorted(users.items()))


def port_conflicts(lay: Layout) -> list[str]:
    """Ports two of ``lay``'s listeners would share, each as ``"18010: p0, md9 wan"`` (instance
    RPC ports, engines' metrics ports, MD's WAN ports on the link, the link's control port, the
    gateway's HTTP port); empty when all are distinct."""
    return [f"{port}: {', '.join(who)}" for port, who in port_users(lay).items() if len(who) > 1]


def ports_in_use(lay: Layout) -> list[int]:
    """The ports ``lay`` needs (each instance's RPC port, an engine's metrics port, MD's WAN
    port, the gateway's HTTP port) that cannot be bound on its host now, ascending: another
    topology (``pdd serve``, ``make demo``) or another program holds them. Best effort: a port
    may be taken between this check and the bind."""
    return [port for port in port_users(lay) if port_taken(lay.host, port)]


def ports_taken_message(busy: list[int], users: dict[int, str] | None = None) -> str:
    """``"port 18070"`` / ``"ports 18000, 18001, ... and 4 more"`` for :func:`ports_in_use`'s
    answer (the first five named; each followed by ``" (WHO)"`` when ``users`` names it), the head
    of ``pdd serve``'s, ``pdd demo``'s and ``pdd bench``'s refusal."""
    more = f" and {len(busy) - 5} more" if len(busy) > 5 else ""
    named = ", ".join(f"{p} ({users[p]})" if users and p in users else str(p) for p in busy[:5])
    return f"port{'s' if len(busy) > 1 else ''} {named}{more}"


def port_field(cfg: TopologyFields, port: int) -> str:
    """Where ``port`` of ``cfg``'s topology comes from in the config: ``gateway_port`` or
    ``base_port + N``."""
    return "gateway_port" if port == cfg.gateway_port else f"base_port + {port - cfg.base_port}"


def ports_taken_refusal(cfgs: list[TopologyFields], prog: str, port_flag: str = "--port") -> str | None:
    """None when every port the topologies of ``cfgs`` need can be bound now
    (:func:`ports_in_use` of each :func:`layout`); else the one line with which ``pdd serve``,
    ``pdd demo`` and ``pdd bench`` (``prog``) refuse to start (exit status 2): each busy port
    (:func:`ports_taken_message`) with who in those topologies would listen on it and where in
    the config's block (``8000 (gateway: gateway_port)``, ``18070 (d0, md0: base_port + 70)``,
    from :func:`port_users`), the ports the topologies use, and the flags that move them
    (``port_flag``: ``prog``'s flag for the gateway port, then ``--base-port``). ``cfgs``: one
    config in one or more modes (``pdd bench``'s), so they share its gateway port and base port
    (the first's are named). A port the bind refuses for want of permission (``pdd serve --port
    80`` as a user) is named as such, not as in use."""
    host_problem = unbindable_host(cfgs[0].host)
    if host_problem:  # every port "in use" was the message for an address not of this machine
        return host_problem
    busy: dict[int, list[str]] = {}
    for cfg in cfgs:
        lay = layout(cfg)
        users = port_users(lay)
        for port in ports_in_use(lay):
            busy.setdefault(port, [])
            busy[port] += [u for u in users[port] if u not in busy[port]]
    if not busy:
        return None
    gateway, base = cfgs[0].gateway_port, cfgs[0].base_port
    who = {p: f"{', '.join(sorted(u))}: {port_field(cfgs[0], p)}" for p, u in busy.items()}
    host = layout(cfgs[0]).host
    denied = sorted(p for p in busy if _bind_errno(host, p, reuse_addr=True) in (errno.EACCES, errno.EPERM))
    taken = sorted(p for p in busy if p not in denied)
    why = []
    if taken:
        why.append(f"{ports_taken_message(taken, who)} already in use (another pdd serve, make demo or pdd bench?)")
    if denied:  # a port below 1024 (pdd serve --port 80) as a user that may not bind it
        why.append(f"{ports_taken_message(denied, who)}: permission denied (a port below 1024 needs root or "
                   "CAP_NET_BIND_SERVICE)")
    return (f"{'; '.join(why)}: {prog} needs the gateway port {gateway} and base_port {base}..{base + 99}; choose "
            f"others with {port_flag} and --base-port (or gateway_port / base_port in the config)")


def instance_ports(lay: Layout, name: str) -> list[int]:
    """The ports the process of instance ``name`` binds, ascending (:func:`port_users`): an engine
    its RPC and metrics ports, the gateway its HTTP port, the link its control port and every MD's
    WAN port."""
    return [port for port, who in port_users(lay).items()
            if name in who or f"{name} metrics" in who or (name == ROLE_LINK and any(w.endswith(" wan") for w in who))]


def instance_ports_refusal(cfg: TopologyFields, name: str, prog: str = "pdd launch") -> str | None:
    """None when every port instance ``name`` of ``cfg``'s topology binds (:func:`instance_ports`)
    can be bound now; else the one line with which ``pdd launch`` refuses to start it (exit
    status 2), e.g. ``port 18010 (p0: base_port + 10) already in use (...): p0 listens on 18010
    and 18020; ...``. The bind failed later with a traceback (asyncio's ``OSError: [Errno 98]``)."""
    host_problem = unbindable_host(cfg.host)
    if host_problem:
        return host_problem
    lay = layout(cfg)
    ports = instance_ports(lay, name)
    busy = [p for p in ports if port_taken(lay.host, p)]
    if not busy:
        return None
    users = port_users(lay)
    who = {p: f"{', '.join(users[p])}: {port_field(cfg, p)}" for p in busy}
    listens = " and ".join([", ".join(str(p) for p in ports[:-1]), str(ports[-1])] if len(ports) > 1
                           else [str(ports[0])])
    return (f"{ports_taken_message(busy, who)} already in use (is {name} already running, or another pdd "
            f"serve, make demo or pdd bench?): {name} listens on {listens}; move base_port / gateway_port in "
            f"the config to run another topology beside it")


def unbindable_host(host: str) -> str | None:
    """None when a listener can bind ``host`` (the config's ``host``: an address of this machine,
    or a name that resolves to one); else the one line with which ``pdd serve``, ``pdd launch``,
    ``pdd demo`` and ``pdd bench`` refuse it, naming the field and why (``8.8.8.8``: "Cannot
    assign requested address"; an unknown name: "Name or service not known"). Every port of such
    a host was reported "already in use"."""
    import socket

    try:
        family = socket.getaddrinfo(host, 0, type=socket.SOCK_STREAM)[0][0]
        with socket.socket(family) as s:
            s.bind((host, 0))
    except OSError as e:
        if e.errno in (errno.EACCES, errno.EPERM, errno.EADDRINUSE):  # about a port, not the address
            return None
        return (f"host {host}: cannot listen there ({e.strerror or e}): every process of the topology listens "
                f"on it; set host in the config to an address of this machine (127.0.0.1, 0.0.0.0, ::1) or a "
                f"name that resolves to one")
    return None


def http_url(host: str, port: int) -> str:
    """``http://host:port``, an IPv6 address in brackets (``http://[::1]:8000``)."""
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


def port_taken(host: str, port: int) -> bool:
    """Whether something listens on (or otherwise holds) ``host:port`` now: a server could not
    bind it. SO_REUSEADDR, as the servers themselves bind (asyncio, uvicorn), so a port a closed
    connection left in TIME_WAIT reads free."""
    return not _can_bind(host, port, reuse_addr=True)


def _can_bind(host: str, port: int, reuse_addr: bool = False) -> bool:
    """Whether a TCP socket can bind ``host:port`` now (it is closed again at once)."""
    return _bind_errno(host, port, reuse_addr) is None


def _bind_errno(host: str, port: int, reuse_addr: bool = False) -> int | None:
    """None when a TCP socket can bind ``host:port`` now (it is closed again at once); else the
    errno the bind failed with (``errno.EADDRINUSE``, ``errno.EACCES`` for a port below 1024 as
    a user that may not bind it; -1 when the error carries none)."""
    import socket

    try:  # the address's own family: an IPv6 host (::1) cannot be bound by an IPv4 socket
        family = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)[0][0]
    except OSError as e:
        return e.errno if e.errno is not None else -1
    with socket.socket(family) as s:
        if reuse_addr:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.errno if e.errno is not None else -1
    return None


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range of ephemeral (client-side) ports, ``(low, high)`` inclusive.

    Read from ``/proc/sys/net/ipv4/ip_local_port_range`` (Linux); elsewhere IANA's dynamic
    range 49152..65535 (RFC 6335 section 6)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            lo, hi = (int(x) for x in f.read().split()[:2])
        return lo, hi
    except (OSError, ValueError):
        return 49152, 65535


def free_port_block(n: int = 100) -> int:
    """A base port with ``n`` consecutive ports above it free on 127.0.0.1 now, for a layout's
    ``base_port``.

    The block lies outside the kernel's ephemeral range (:func:`ephemeral_port_range`): every
    outgoing connection on the machine (a client, an instance dialling a peer) takes a local
    port from that range, so a block inside it can be taken between this check and the
    servers' bind, which is what made a CI run fail with EADDRINUSE on a link port. Below the
    range only servers that bind explicitly compete, and a bind still races another program
    picking the same block (best effort).

    Raises RuntimeError when 200 random tries find no such block. Draws from the OS's entropy,
    not the ``random`` module's global state: a test runner that reseeds it (pytest-randomly,
    before every test) would otherwise hand every test, and every run started beside it, the
    same block."""
    import random

    lo_eph, hi_eph = ephemeral_port_range()
    top = 65400 + n - 1  # a config's base_port is at most 65400
    spans = [(a, b) for a, b in ((10000, lo_eph - 1), (hi_eph + 1, min(top, 65535))) if b - a + 1 >= n]
    if not spans:
        raise RuntimeError(f"no port range outside the ephemeral range {lo_eph}-{hi_eph} holds {n} ports")
    rng = random.SystemRandom()
    for _ in range(200):
        a, b = rng.choice(spans)
        base = rng.randint(a, b - n + 1)
        if all(_can_bind("127.0.0.1", p) for p in range(base, base + n)):
            return base
    raise RuntimeError("no free port block")
