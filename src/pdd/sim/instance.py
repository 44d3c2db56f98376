"""One simulated engine instance: roofline step times, a KV pool, an optional prefix cache, and
batches formed by ``pdd.engine.scheduler.schedule`` as the live engine forms them."""

from __future__ import annotations

from collections import deque
from typing import Callable

import pdd.engine.scheduler as eng_sched
import pdd.policy.routing as pol_routing
from pdd.sim.hardware import StepCostModel
from pdd.sim.prefix_cache import PrefixCache
from pdd.sim.request import Seq


_LOAD_FIELDS = ("name", "running", "queued", "pages_used", "pages_total", "prefix_hit_tokens")


def load_maker():
    """A function ``(name, running, queued, pages_used, pages_total, prefix_hit_tokens)`` ->
    ``pdd.policy.routing.InstanceLoad`` (looked up now, so a replaced class is used). For the
    policy's frozen dataclass it fills the instance's ``__dict__`` directly: the same object as
    the constructor's (equal, same repr), about 4x cheaper than the frozen ``__init__``, which
    routing calls once per candidate instance per request."""
    cls = pol_routing.InstanceLoad
    made = _MAKERS.get(cls)
    if made is None:
        made = _MAKERS[cls] = _load_maker(cls)
    return made


_MAKERS: dict = {}


def _load_maker(cls):
    import dataclasses

    try:
        plain = (tuple(f.name for f in dataclasses.fields(cls)) == _LOAD_FIELDS
                 and "__slots__" not in cls.__dict__ and not hasattr(cls, "__post_init__"))
    except TypeError:  # not a dataclass
        plain = False
    if not plain:
        return cls
    new = object.__new__

    def make(name, running, queued, pages_used, pages_total, prefix_hit_tokens):
        o = new(cls)
        d = o.__dict__
        d["name"] = name
        d["running"] = running
        d["queued"] = queued
        d["pages_used"] = pages_used
        d["pages_total"] = pages_total
        d["prefix_hit_tokens"] = prefix_hit_tokens
        return o

    return make


class Instance:
    """One engine. Its batch limits, step floor, KV page, pool and the KV size of transfers to
    it are its own (``SimConfig.engine_of(name)``: the top-level settings with its tier's and its
    own ``tier_engines`` entries over them, as the runtime's ``ClusterConfig.engine_for``)."""

    def __init__(self, sim: "ClusterSim", name: str, role: str, cm: StepCostModel, cache: bool,
                 cache_frac: float = 1.0):
        self.sim = sim
        self.env = sim.env
        self.name = name
        self.role = role  # P, RLD, MD, D, C
        self.block = sim.block
        self.cm = cm
        eng = sim.cfg.engine_of(name)
        self.engine = eng
        self.sched_cfg = eng_sched.SchedulerConfig(
            max_batch_tokens=eng.max_batch_tokens, max_running_seqs=eng.max_running_seqs,
            prefill_chunk_tokens=eng.prefill_chunk_tokens, prefill_order=eng.prefill_order)
        self.max_running = eng.max_running_seqs  # sequences of one step
        self.chunk_tokens = min(eng.prefill_chunk_tokens, eng.max_batch_tokens)  # most tokens of a prefill step
        self.min_step_s = float(eng.min_step_s)
        self.page = eng.page_tokens  # KV page, tokens (dividing block)
        # bytes a token of KV sent to this instance carries (its wire format)
        self.kvb = eng.kv_bytes_per_token or sim.model.kv_bytes_per_token
        self.pool = eng.kv_pool_tokens or cm.kv_capacity_tokens()
        if self.pool <= 0:
            raise ValueError(f"{name}: no KV room on {cm.chip.name}: what the model's weights leave holds no token of "
                             f"{cm.model.kv_bytes_per_token:,} KV bytes")
        self.cache = PrefixCache(int(self.pool * cache_frac) // sim.block) if cache else None
        self.private = 0
        self.seqs: dict[int, Seq] = {}
        self.waiting: deque = deque()  # (need_tokens, admit_fn)
        self.inbox: list[Callable[[], None]] = []
        self.wake = None
        self.step_wake = None  # a P step in flight that prefill interference may re-time
        self.busy_s = 0.0
        self.steps = 0
        self.tokens_out = 0
        # RLD's current handoff mode (relay_decode: one_shot if configured so, else catch_up)
        self.handoff_state = "one_shot" if sim.cfg.handoff_mode == "one_shot" else "catch_up"
        self.routed = 0  # routed here by the gateway, not yet enqueued (in flight)
        # MD: requests the gateway routed here and that have not ended (its in-flight count, what
        # routing reads as MD's load: counted at routing, before the reservation reaches MD)
        self.assigned = 0
        self.prefilling = 0
        self.step_reply_tokens = 0  # P: the reply lag's tokens of the step just ended (cluster.on_tokens)
        c = sim.cfg
        self.step_ovh = float((c.step_overhead_s or {}).get(role, 0.0))
        self.step_scale = float((c.step_scale or {}).get(role, 1.0))
        self.slot_cap = {"D": c.max_running_d, "RLD": c.max_running_rld, "MD": c.max_running_md}.get(role, 0)
        self.slots = 0  # decode slots held (admitted decode sequences)
        self.peak_slots = 0
        self.proc = self.env.process(self.run())

    # --- memory ------------------------------------------------------------------------------
    @property
    def used(self) -> int:
        return self.private + (len(self.cache) * self.block if self.cache is not None else 0)

    def try_alloc(self, n: int) -> bool:
        free = self.pool - self.used
        if free < n and self.cache is not None:
            need_blocks = -(-(n - free) // self.block)
            self.cache.evict(need_blocks)
            free = self.pool - self.used
        if free >= n:
            self.private += n
            return True
        return False

    def free(self, n: int) -> None:
        self.private -= n
        assert self.private >= 0, (self.name, self.private)

    def cache_insert(self, blocks) -> None:
        """Adopt whole blocks into the prefix cache, evicting others if the pool is short."""
        c = self.cache
        if c is None or not blocks:
            return
        c.insert(blocks)
        over = self.used - self.pool
        if over > 0:
            c.evict(-(-over // self.block))
        if len(c) > c.capacity_blocks:
            c.evict(len(c) - c.capacity_blocks)
        # blocks still over the pool (all locked) are tolerated: they are shared, not new
        # memory in a real pool (the owners' private pages became the cached ones)

    def load(self, prefix_hit_tokens: int = 0) -> pol_routing.InstanceLoad:
        """What routing reads of this instance (``ClusterSim._route`` inlines it): an MD's requests
        are the gateway's in-flight count there (:attr:`assigned`, as the runtime's), another
        role's its sequences, queued admissions and requests routed on their way."""
        if self.role == "MD":
            running, queued = self.assigned, 0
        else:
            running, queued = len(self.seqs), len(self.waiting) + self.routed
        return pol_routing.InstanceLoad(self.name, running, queued, self.used, self.pool, prefix_hit_tokens)

    # --- queueing ------------------------------------------------------------------------------
    def enqueue(self, need, admit: Callable[[int], None], prefill: bool = False, slot: bool = False) -> None:
        """Queue an admission: ``need`` tokens (or a function giving them at admission time);
        ``admit(n)`` runs once they are allocated (and, with ``slot``, a decode slot under
        ``slot_cap``; give it back with :meth:`release_slot`). FIFO: the head blocks the rest."""
        self.waiting.append((need, admit, prefill, slot))
        self.poke()

    def release_slot(self) -> None:
        self.slots -= 1
        assert self.slots >= 0, (self.name, self.slots)
        self.poke()

    def post(self, fn: Callable[[], None]) -> None:
        self.inbox.append(fn)
        self.poke()

    def retime(self) -> None:
        """The pace of the prefill step in flight changed (prefill interference): wake it."""
        w = self.step_wake
        if w is not None and not w.triggered:
            w.succeed()

    def poke(self) -> None:
        w = self.wake
        if w is not None and not w.triggered:
            w.succeed()

    def _admit(self) -> None:
        cap = self.sim.cfg.max_prefill_inflight
        while self.waiting:
            need, admit, prefill, slot = self.waiting[0]
            if prefill and cap and self.prefilling >= cap:
                return
            if slot and self.slot_cap and self.slots >= self.slot_cap:
                return
            n = need() if callable(need) else need
            if not self.try_alloc(n):
                return
            self.waiting.popleft()
            if slot:
                self.slots += 1
                self.peak_slots = max(self.peak_slots, self.slots)
            admit(n)

    def add(self, seq: Seq) -> None:
        self.seqs[seq.seq_id] = seq
        if seq.kind in ("prefill", "coloc") and seq.num_tokens - seq.num_computed > 1:
            self.prefilling += 1
            seq.in_prefill = True

    def remove(self, rid: int) -> Seq | None:
        s = self.seqs.pop(rid, None)
        if s is not None and s.in_prefill:
            self.prefilling -= 1
            s.in_prefill = False
        return s

    # --- the engine loop -----------------------------------------------------------------------
    def run(self):
        env = self.env
        cfg = self.sched_cfg
        cm = self.cm
        floor = self.min_step_s
        while True:
            if self.inbox:
                box, self.inbox = self.inbox, []
                for fn in box:
                    fn()
            self._admit()
            if self.inbox:  # posted by an admission (MD importing KV that came before it)
                continue
            plan = eng_sched.schedule(self.seqs.values(), cfg)
            if not plan:
                self.wake = env.event()
                yield self.wake
                self.wake = None
                continue
            items = plan.items
            seqs = self.seqs
            if all(it.num_tokens == 1 and it.sample and seqs[it.seq_id].kind != "prefill"
                   and seqs[it.seq_id].req.generated >= 1 for it in items):
                # pure decode: advance to the next membership change in one event
                k = min(seqs[it.seq_id].req.out_len - seqs[it.seq_id].req.generated for it in items)
                k = max(1, min(k, 4096))
                b = len(items)
                sum_ctx = 0
                for it in items:
                    sum_ctx += it.start
                dt = (cm.decode_time(b, sum_ctx + b * (k - 1) / 2.0) * self.step_scale + self.step_ovh) \
                    * self.sim.host_share() * self.sim.decode_slowdown(self.role)
                if dt < floor:  # the emulated accelerator's floor (engine.min_step_ms): the step is held
                    dt = floor
                self.sim.host_busy += 1
                track = self.sim.p_interference != 1.0 and self.role != "P"
                if track:
                    self.sim.decode_step(+1)
                t0 = env.now
                self.wake = w = env.event()
                yield env.timeout(k * dt) | w
                self.wake = None
                done = k
                if w.triggered and env.now < t0 + k * dt - 1e-12:
                    done = min(k, int((env.now - t0) / dt) + 1)
                    rest = t0 + done * dt - env.now
                    if rest > 0:
                        yield env.timeout(rest)
                if track:
                    self.sim.decode_step(-1)
                self.sim.host_busy -= 1
                self.busy_s += done * dt
                self.steps += done
                for it in items:
                    s = seqs.get(it.seq_id)
                    if s is None:
                        continue
                    s.num_computed += done
                    s.num_tokens += done
                    self.tokens_out += done
                    self.sim.on_tokens(self, s, t0 + dt + s.emit_delay, done, dt)
            else:
                # a decode step is slowed while P prefills (decode_interference); P's steps are its
                # prefills. Nothing is looked at when no role has a factor (the usual simulation)
                interfere = bool(self.sim.interference) and self.role == "P"
                slow = self.sim.decode_slowdown(self.role) if self.sim.interference and self.role != "P" \
                    and all(it.num_tokens == 1 for it in items) else 1.0
                dt = (cm.step_time((it.start, it.num_tokens) for it in items) * self.step_scale + self.step_ovh) \
                    * self.sim.host_share() * slow
                work = dt  # the step's compute (a P step's at the quiet pace, re-timed below)
                if dt < floor:  # the emulated accelerator's floor (engine.min_step_ms): the step is held
                    dt = floor
                if self.sim.layerwise and self.role == "P":  # each layer group's KV as the step writes it
                    for it in items:
                        s = seqs[it.seq_id]
                        if s.kind == "prefill":
                            self.sim.on_prefill_chunk(s.req, it.start + it.num_tokens, dt)
                self.sim.host_busy += 1
                if interfere:
                    self.sim.prefill_step(self, +1)
                if self.sim.p_interference == 1.0:
                    yield env.timeout(dt)
                elif self.role == "P":  # work is the step's at the quiet pace: re-timed as the pace changes
                    t_start = env.now
                    # until the rest is below the clock's resolution (at a late ``now`` a tiny
                    # timeout would not move it, and the loop would never end)
                    while work > 1e-12 and env.now + work * self.sim.prefill_slowdown() > env.now:
                        f = self.sim.prefill_slowdown()
                        self.step_wake = w = env.event()
                        t0 = env.now
                        yield env.timeout(work * f) | w
                        self.step_wake = None
                        work -= (env.now - t0) / f
                    if env.now - t_start < floor:  # held to the floor: the hold is not slowed
                        yield env.timeout(t_start + floor - env.now)
                    dt = env.now - t_start
                else:
                    self.sim.decode_step(+1)
                    yield env.timeout(dt)
                    self.sim.decode_step(-1)
                if interfere:
                    self.sim.prefill_step(self, -1)
                self.sim.host_busy -= 1
                self.busy_s += dt
                self.steps += 1
                # P replies for every prefill this step finishes together, in batch order, after the
                # lag of the largest of them (the runtime's on_events: one pass over the step's events)
                self.step_reply_tokens = max((min(seqs[it.seq_id].req.prompt - seqs[it.seq_id].req.p_hit,
                                                  self.chunk_tokens)
                                              for it in items if it.sample and it.seq_id in seqs
                                              and seqs[it.seq_id].kind == "prefill"), default=0)
                for it in items:
                    s = seqs.get(it.seq_id)
                    if s is None:
                        continue
                    s.num_computed += it.num_tokens
                    if s.in_prefill and s.num_computed >= s.num_tokens:  # its last chunk (one token too)
                        self.prefilling -= 1
                        s.in_prefill = False
                    if it.sample:
                        s.num_tokens += 1
                        self.tokens_out += 1
                        self.sim.on_tokens(self, s, env.now + s.emit_delay, 1, dt)
                    elif s.num_computed >= s.num_tokens:
                        self.sim.on_caught_up(self, s)
