"""WAN booking (a collaborator of :class:`pdd.gateway.orchestrator.Orchestrator`): the WAN bytes
each request's KV transfer to an MD across the WAN is planned to send, booked when MD's
reservation (or a predicted send) fixes them and settled when P reports the transfer
(``xfer_done``: sent, cancelled, or written off when P dies first), so that planned = sent +
not sent; the live WAN rate estimates (MD's ``wan_sample``, overall and per MD; MD's reservation
round trips for each MD's RTT); the cut-off of a transfer no decoder needs any more (anomaly
filter), which reads MD's ``kv_progress`` of it when there is one. The only writer of a request's
:class:`~pdd.gateway.state.WanPlan` (and of its ``md_cached_tokens``, from MD's reply).
"""

from __future__ import annotations

import asyncio
import logging
import time

from pdd.gateway.state import ReqState
from pdd.policy.cutoff import sent_fraction, should_cut_off
from pdd.policy.handoff import early_handoff_delay_s
from pdd.policy.wan_estimate import inflight_remaining_s, probe_due, probe_goodput_gbps, queued_bytes
from pdd.topology import ROLE_MAIN, ROLE_PREFILL
from pdd.transfer.peer import Peer
from pdd.transfer.kv import prompt_kv_bytes
from pdd.transfer.layout import DTYPE_BYTES, KVLayout, wire_dtype
from pdd.transfer.messages import Cancel, Drop, KvProgress, WanProbe, WanSample, XferDone
from pdd.types import Pipeline

log = logging.getLogger("pdd.gateway.orchestrator")  # one logger for the gateway's request life


class WanBooking:
    """Mixin of the orchestrator: plan, book and settle WAN bytes; the live WAN estimate."""

    async def on_xfer_done(self, peer, h, payload):
        m = XferDone.decode(h)
        st = self.reqs.get(m.rid)
        wan = sum(v for k, v in m.bytes.items() if self._in_b(k))
        # bytes of pages whose sending was cancelled (cut-off): expected = planned - cancelled
        planned = self.planned_wan.pop(m.rid, None)
        self.planned_src.pop(m.rid, None)
        if planned is None:  # an attempt that recovery replaced
            planned = self.superseded_wan.pop(m.rid, (0, ""))[0]
        unsent = sum(planned if v < 0 else v for k, v in m.unsent.items() if self._in_b(k))
        if unsent:
            self.totals["wan_bytes_cancelled"] += unsent
            self.totals["wan_bytes_expected"] -= unsent
        self.totals["wan_bytes_sent"] += wan
        if m.rid in self.awaiting_kv and m.errors.get(self.awaiting_kv[m.rid][1]):
            self._kv_source_lost(m.rid)  # MD's KV stream failed after the request ended
        if st is None:  # an attempt that recovery replaced: its bytes are still the request's
            old = self._request_of_attempt(m.rid)
            if old is not None:
                old.wan.reported = (old.wan.reported or 0) + wan
            return None
        if st is not None:
            # the request's figure is the sum over its attempts of what their P reported (a P
            # that died before reporting reported nothing: its plan is wan_bytes_unreported)
            st.wan.reported = (st.wan.reported or 0) + wan
            if st.trid == m.rid:  # when P had written this attempt's KV (its sockets took the last byte)
                st.events.setdefault("xfer_done", time.perf_counter())
            md_name = st.names.get(ROLE_MAIN)
            if (st.trid == m.rid and md_name is not None and md_name in m.bytes
                    and not m.errors.get(md_name) and not m.unsent.get(md_name)):
                st.wan.kv_sent = True
                if (self.cfg.policy.early_handoff and st.pipeline == Pipeline.P_RLD_MD and self._in_b(md_name)
                        and not (st.handoff.kv_ready or st.finished or st.recovery.md_lost or st.wan.cut_off
                                 or st.handoff.started)):
                    self._spawn(self._handoff_at_landing(st))
            for name, err in m.errors.items():
                # a KV stream failed (target dead or silent, stalled, refused at the handshake, a
                # frame that failed its MAC closed the fast path): that leg is lost, recover now
                # instead of waiting for the request timeout
                self._instance_lost(st, name, f"KV transfer to {name} failed: {err}")
        return None

    def _request_of_attempt(self, trid: str) -> ReqState | None:
        """The live request whose earlier attempt had tier rid ``trid`` (``rid``, then ``rid.1``,
        ``rid.2``, ...: :meth:`pdd.gateway.recovery.Recovery._new_attempt`), else None."""
        for st in list(self.reqs.values()):
            if st.trid == trid:
                continue
            if trid == st.rid:
                return st
            head, dot, n = trid.rpartition(".")
            if dot and head == st.rid and n.isdigit() and int(n) < st.attempt:
                return st
        return None

    def _in_b(self, name: str) -> bool:
        """Whether instance ``name`` is in datacenter B (False for a slot never given an instance)."""
        try:
            return self.layout.get(name).dc == "B"
        except KeyError:
            return False

    async def on_wan_sample(self, peer, h, payload):
        """MD's receive rate of one request's KV (first frame to last), Gbit/s: the live WAN
        estimate the pipeline policy reads (policy.wan_estimate). Sender-side timings would measure socket
        buffers, not the line."""
        gbps = float(WanSample.decode(h).gbps)
        self.wan_gbps_live = self.wan_estimate.add(gbps)
        md = self._peer_name(peer)
        if md is not None:  # per WAN peer: what the pipeline choice and MD routing read
            self.wan_peers.add_goodput(md, gbps)
            self.wan_last_sample[md] = time.monotonic()
        return None

    async def on_kv_progress(self, peer, h, payload):
        """MD's progress receiving a request's KV (``kv_progress``: bytes so far, its rate lately),
        kept as the request's ``wan.progress`` for the cut-off (:meth:`_cutoff_remaining_wan_s`).
        Of a request that ended with its transfer let through (awaited: ``cutoff_watch``), the
        cut-off is checked again with it, and the transfer cut off if it now has at least
        ``policy.cutoff_min_remaining_s`` left and MD has under ``policy.cutoff_max_sent_fraction``
        of its bytes. A report of an earlier attempt, or from another
        instance than the attempt's MD, is ignored."""
        m = KvProgress.decode(h)
        st = self.reqs.get(m.rid)
        ended = st is None and m.rid in self.awaiting_kv
        if ended:  # let through by the cut-off when it ended (no report yet, or moving then)
            st = self.cutoff_watch.get(m.rid)
        if st is None or st.trid != m.rid:
            return None
        md = st.names.get(ROLE_MAIN)
        if md is None or self.peers.get(md) is not peer:
            return None
        st.wan.progress = (time.perf_counter(), int(m.bytes), float(m.gbps))
        if ended and self._cut_off_due(st):
            # it crawls now: cut off as at its end (MD drops it, so no kv_ready is awaited)
            self.cutoff_watch.pop(m.rid, None)
            self.awaiting_kv.pop(m.rid, None)
            self.awaiting_kv_deadline.pop(m.rid, None)
            await self._cut_off(st)
        return None

    # ------------------------------------------------------------------ probes
    async def _probe_loop(self) -> None:
        """Every ``policy.wan_probe_interval_s`` / 2 (at most 1 s), probe each MD across the WAN
        whose goodput estimate is stale (``policy.wan_estimate.probe_due``)."""
        interval = self.cfg.policy.wan_probe_interval_s
        while True:
            await asyncio.sleep(min(1.0, interval / 2))
            for name in self._probes_due(time.monotonic()):
                self._spawn(self._probe(name))

    def _probes_due(self, now: float) -> list[str]:
        """The MDs across the WAN due a probe at ``now`` (monotonic s); each is marked probed."""
        due = []
        for s in self.layout.by_role(ROLE_MAIN):
            peer = self.peers.get(s.name)
            if peer is None or peer.closed or not self._in_b(s.name):
                continue
            if probe_due(now, self.wan_last_sample.get(s.name), self.wan_last_probe.get(s.name),
                         self.cfg.policy.wan_probe_interval_s):
                self.wan_last_probe[s.name] = now
                due.append(s.name)
        return due

    async def _probe(self, name: str) -> None:
        """One probe of ``name``'s path: an empty ``wan_probe`` call (its round trip: an RTT
        sample), then one carrying ``policy.wan_probe_bytes`` (the difference: a goodput sample,
        ``policy.wan_estimate.probe_goodput_gbps``). A failed probe is counted, nothing else."""
        peer = self.peers.get(name)
        nbytes = self.cfg.policy.wan_probe_bytes
        try:
            t0 = time.perf_counter()
            await peer.call(WanProbe().wire(), timeout=10.0)
            t1 = time.perf_counter()
            if nbytes > 0:
                await peer.call(WanProbe().wire(), bytes(nbytes), timeout=10.0)
            t2 = time.perf_counter()
        except Exception as e:  # the connection's own liveness handles a dead peer
            self.wan_probes["failures"] += 1
            log.debug("WAN probe of %s failed: %s", name, e)
            return
        self._probe_result(name, t1 - t0, t2 - t1 if nbytes > 0 else None, nbytes)

    def _probe_result(self, name: str, empty_s: float, payload_s: float | None, nbytes: int) -> None:
        """Fold a probe's timings (s) into ``name``'s estimates, its goodput also into the overall
        one (``wan_gbps_live``), and count it (``wan_probes``)."""
        self.wan_probes["probes"] += 1
        self.wan_probes["bytes"] += nbytes if payload_s is not None else 0
        self.wan_peers.add_rtt(name, empty_s * 1000.0)
        g = probe_goodput_gbps(nbytes, payload_s, empty_s) if payload_s is not None else None
        if g is not None:
            self.wan_peers.add_goodput(name, g)
            # the overall estimate too, as a KV receive rate (on_wan_sample): the cut-off's
            # remaining time, the admission's WAN backlog and /metrics read it, and without this
            # it kept a slowdown's rate after probes had brought the MD's own estimate back
            self.wan_gbps_live = self.wan_estimate.add(g)
            self.wan_probes["goodput_samples"] += 1

    def _peer_name(self, peer) -> str | None:
        """The instance at the other end of the gateway's connection ``peer`` (None: unknown)."""
        for name, p in self.peers.items():
            if p is peer:
                return name
        name = getattr(peer, "remote_instance", None)
        return name if name in self.peers else None

    def _wan_rtt_sample(self, md_name: str, seconds: float) -> None:
        """One request/reply round trip to ``md_name`` through the WAN (MD's reservation), for its
        RTT estimate (``policy.wan_estimate.RttEstimate``: the windowed minimum)."""
        if self._in_b(md_name):
            self.wan_peers.add_rtt(md_name, seconds * 1000.0)

    def _wan_backlog_bytes(self, md_name: str | None, st: ReqState | None = None) -> float:
        """KV bytes still queued to MD ``md_name`` ahead of a new transfer: the planned bytes of
        the other requests whose transfer to it P has not reported done, less what the line can
        have carried since the oldest of them started streaming (``policy.wan_estimate.queued_bytes``
        at that MD's goodput estimate). 0 for an MD in A or none."""
        if md_name is None or not self._in_b(md_name):
            return 0.0
        now, planned, oldest = time.perf_counter(), [], 0.0
        for o in list(self.reqs.values()):
            w = o.wan
            if o is st or o.names.get(ROLE_MAIN) != md_name or w.expected <= 0 or w.kv_sent or w.cut_off:
                continue
            planned.append(w.expected)
            started = o.events.get("prefilled")
            if started is not None:
                oldest = max(oldest, now - started)
        return queued_bytes(planned, oldest, self.wan_peers.gbps(md_name))

    def _remaining_wan_s(self, st: ReqState) -> float:
        """Expected seconds to finish ``st``'s WAN transfer: its planned bytes at the live (else
        configured) rate, less the time since P started streaming it."""
        started = st.events.get("prefilled")
        elapsed = time.perf_counter() - started if started is not None else 0.0
        return early_handoff_delay_s(st.wan.expected, self.wan_gbps_live or self.cfg.link.wan_gbps, elapsed)

    def _cutoff_remaining_wan_s(self, st: ReqState) -> float:
        """Expected seconds to finish ``st``'s WAN transfer, as the cut-off reads them: from MD's
        last progress report when there is one (the bytes left at the transfer's own recent
        rate, less the report's age up to one report interval:
        ``policy.wan_estimate.inflight_remaining_s``), so a line
        that slowed while this transfer was under way counts at once; else
        :meth:`_remaining_wan_s` (the goodput estimate of finished transfers)."""
        p = st.wan.progress
        if p is None:
            return self._remaining_wan_s(st)
        at, done, gbps = p
        return inflight_remaining_s(st.wan.expected, done, gbps, time.perf_counter() - at)

    def _cut_off_due(self, st: ReqState) -> bool:
        """Whether RLD having finished ``st`` cuts its WAN transfer off (``policy.cutoff.should_cut_off``
        with MD's ``kv_ready``, :meth:`_cutoff_remaining_wan_s` and the share of the bytes MD last
        reported received): at the request's end and, for a transfer let through then, on each
        later ``kv_progress``."""
        pol, p = self.cfg.policy, st.wan.progress
        return should_cut_off(rld_finished=True, md_kv_complete=st.handoff.kv_ready,
                              remaining_wan_s=self._cutoff_remaining_wan_s(st),
                              min_remaining_s=pol.cutoff_min_remaining_s,
                              sent_fraction=sent_fraction(p[1], st.wan.expected) if p is not None else 0.0,
                              max_sent_fraction=pol.cutoff_max_sent_fraction)

    async def _cut_off(self, st: ReqState) -> None:
        """Anomaly filter (PDD report): RLD finished before MD's KV arrived, so stop the WAN
        transfer; MD frees what it received on ``kv_cancel``."""
        md_name, md = self._peer(st, ROLE_MAIN)
        _, p = self._peer(st, ROLE_PREFILL)
        self._count_cut_off(st)
        for peer, msg in ((p, Cancel(st.trid, md_name).wire()), (md, Drop(st.trid).wire())):
            try:
                await peer.send(msg)
            except Exception as e:  # that tier is gone: its state died with it
                log.warning("cut-off of %s failed: %s", st.rid, e)

    def _count_cut_off(self, st: ReqState) -> None:
        """``st``'s WAN transfer is cut off (RLD finished first, or its first token ended it). A
        request its settling counted RLD-finished-first (let through, cut off later on MD's
        ``kv_progress``) leaves that count: MD keeps none of its KV, and a request is in one of
        the two counts, never both."""
        st.wan.cut_off = True
        self.totals["cut_offs"] += 1
        self._rld_finished_first_undone(st)
        self._index_given_up(st)  # MD frees what arrived, caches nothing

    @staticmethod
    def _wan_new_attempt(st: ReqState) -> None:
        """A new attempt (recovery) plans its own transfer: forget the old one's plan; what P
        reported and whether a transfer was cut off stay the request's."""
        w = st.wan
        w.expected, w.kv_sent, w.progress = 0, False, None
        w.predicted_pages, w.predicted_bytes, w.fill_slot = None, 0, False

    @staticmethod
    def _open_fill_slot(st: ReqState) -> None:
        """The launcher starts P with an ``md_fill`` slot (a predicted MD send), which MD's
        reservation reply resolves (:meth:`pdd.gateway.launch.Launchers._md_leg`)."""
        st.wan.fill_slot = True

    def _unbook_md(self, st: ReqState) -> None:
        """The plan gives MD no KV (P->RLD): its booked WAN bytes leave the planned and expected
        totals."""
        self.totals["wan_bytes_expected"] -= st.wan.expected
        self.totals["wan_bytes_planned"] -= st.wan.expected
        self.planned_wan.pop(st.trid, None)
        self.planned_src.pop(st.trid, None)
        st.wan.expected = 0

    def _book_predicted(self, st: ReqState, pred_pages: int, p: Peer) -> None:
        """A predicted MD send: P sends pages ``[pred_pages, n)`` before MD's reservation replies,
        so their WAN bytes are planned now (the reply adds a fill's, :meth:`_reserved`)."""
        md_name = st.names[ROLE_MAIN]
        nbytes = prompt_kv_bytes(st.prompt_len, pred_pages, self.cfg.engine_for(md_name).page_size,
                                 self._wan_page_bytes(st, md_name), self.cfg.policy.kv_whole_pages)
        st.wan.predicted_pages, st.wan.predicted_bytes = pred_pages, nbytes
        st.wan.expected = nbytes  # until the reply (the cut-off's and early handoff's estimate)
        self.totals["md_predicted_sends"] += 1
        self._book_wan(st, nbytes, p)

    def _book_wan(self, st: ReqState, nbytes: int, p: Peer | None) -> None:
        """Book ``nbytes`` more planned (and expected) WAN bytes for ``st``'s transfer from its P
        (``p``: the connection the attempt started on, default the current one of its P); when
        that P is already gone they go to ``wan_bytes_unreported`` instead (:meth:`_reserved`)."""
        self.totals["wan_bytes_expected"] += nbytes
        self.totals["wan_bytes_planned"] += nbytes
        src = st.names.get(ROLE_PREFILL, "")
        p = p if p is not None else self.peers.get(src)
        if p is not None and (p.closed or self.peers.get(src) is not p):
            self._write_off(nbytes)
            return
        if nbytes or st.trid in self.planned_wan:  # no bytes: no transfer to await (its report may be in)
            self.planned_wan[st.trid] = self.planned_wan.get(st.trid, 0) + nbytes
            self.planned_src[st.trid] = src

    def _reserved(self, st: ReqState, md_name: str, rep: dict, p: Peer | None = None, booked: int = 0,
                  book: bool = True) -> None:
        """Book MD's reservation reply: cached tokens, the WAN bytes planned. ``book`` False: the
        attempt was aborted before P got its targets (P will neither send nor report the bytes),
        so none are planned and its ``wan.expected`` is 0. ``p``: the P
        connection the attempt started on (default: the current one of ``st``'s P). When that P
        is already gone (closed, or replaced by a restarted P's connection: its loss was booked
        before this reservation returned, e.g. a sibling choice's ``reserve {after}`` waiting on
        MD while P was killed), it will never report the transfer: the bytes go straight to
        ``wan_bytes_unreported`` instead of staying expected forever."""
        st.events["md_reserved"] = time.perf_counter()
        md_wan = self.layout.get(md_name).dc == "B"
        self.page_bytes = int(rep["page_bytes"])
        md_dtype = str(rep.get("kv_dtype") or self.cfg.engine_for(md_name).dtype)
        self.kv_elems_per_token = self.page_bytes // int(rep["page_size"]) // DTYPE_BYTES[md_dtype]  # MD's pool
        wire_pb = self._wan_page_bytes(st, md_name, KVLayout(int(rep["page_size"]), md_dtype))
        self.kv_bytes_per_token = wire_pb // int(rep["page_size"])  # as it crosses the WAN
        st.md_cached_tokens = int(rep["md_cached_tokens"])
        md_first = int(rep["md_cached_pages"])
        if md_wan and not book:
            st.wan.expected = 0
        elif md_wan:  # the prompt's tokens MD lacks (P sends the last page's filled slots only)
            st.wan.expected = prompt_kv_bytes(int(rep["prompt_tokens"]), md_first, int(rep["page_size"]),
                                              wire_pb, self.cfg.policy.kv_whole_pages)
            # ``booked``: a predicted send's bytes, planned when it started; the rest is its fill
            self._book_wan(st, st.wan.expected - booked, p)
        st.md_settled.set()  # after the booking: a waiting sibling choice reads its planned bytes

    def _wan_page_bytes(self, st: ReqState, md_name: str, md: KVLayout | None = None) -> int:
        """Bytes of one of MD's pages as P sends it (``pdd.transfer.layout``: MD's page size,
        the narrower of P's and MD's KV dtypes). ``md``: MD's layout as its reply says (default:
        its config)."""
        if md is None:
            e = self.cfg.engine_for(md_name)
            md = KVLayout(e.page_size, e.dtype)
        p_dtype = self.cfg.engine_for(st.names.get(ROLE_PREFILL, "prefill")).dtype
        return (self.kv_elems_per_token or 0) * md.page_size * DTYPE_BYTES[wire_dtype(p_dtype, md.dtype)]

    def _unplan_wan(self, trid: str) -> None:
        """Attempt ``trid`` ended before P started its streams: the WAN bytes planned for it leave
        the planned and expected totals (P will never send nor report them)."""
        nbytes = self.planned_wan.pop(trid, 0)
        self.planned_src.pop(trid, None)
        self.totals["wan_bytes_planned"] -= nbytes
        self.totals["wan_bytes_expected"] -= nbytes

    def _write_off(self, nbytes: int) -> None:
        """Planned WAN bytes whose P died before reporting them: out of the expected balance,
        into ``totals.wan_bytes_unreported``."""
        self.totals["wan_bytes_unreported"] += nbytes
        self.totals["wan_bytes_expected"] -= nbytes
