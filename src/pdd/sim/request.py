"""A simulated request (:class:`Req`) and its sequence on one instance (:class:`Seq`), and the
error for a request no instance of a tier can ever hold (:class:`RequestTooLarge`)."""

from __future__ import annotations

from pdd.sim.sim_config import BLOCK


class RequestTooLarge(ValueError):
    """A request whose KV (``prompt`` + ``out_len`` tokens; a P instance holds the prompt only)
    can never fit the KV pool of one ``role`` instance (``pool`` tokens). ``max_prompt``: the
    largest prompt cap (tokens) with which every request of the workload would fit one instance
    of every tier (<= 0 when the longest output alone does not)."""

    def __init__(self, rid: int, role: str, prompt: int, out_len: int, pool: int, max_prompt: int):
        self.rid, self.role, self.prompt, self.out_len, self.pool = rid, role, prompt, out_len, pool
        self.max_prompt = max_prompt
        super().__init__(f"request {rid}: {prompt} prompt + {out_len} output tokens do not fit "
                         f"the KV pool of one {role} instance ({pool} tokens)")


class Req:
    __slots__ = (
        "rid", "arrival", "prompt", "out_len", "blocks", "n_full", "pipeline",
        "p", "rld", "md", "d", "p_hit", "md_hit", "md_seq", "rld_seq",
        "t_first", "t_last", "n_emitted", "max_gap", "t_done", "generated",
        "prefill_done", "md_reserved", "md_kv_complete", "rld_finished", "finished", "cut_off",
        "wan_flow", "fast_flow", "wan_bytes", "md_missing", "p_pending_flows", "p_locked",
        "handoff_round", "handed", "rld_tokens", "md_tokens", "stall", "t_prefill_done",
        "t_md_kv", "handoff_mode", "handoff_deferred", "md_predicted", "wan_landed", "md_waiting",
        "handoff_started", "t_handoff_start", "t_handoff", "t_md_replied", "early_pending",
        "md_held", "fill_flow", "fill_pending", "main_landed", "t_kv_written", "at_seal", "md_queued",
        "md_landed", "md_after", "kv_waiters", "progress_seen", "cutoff_watched", "md_counted",
    )

    def __init__(self, rid: int, rec: dict, block: int = BLOCK):
        self.rid = rid
        self.arrival = rec["timestamp"] / 1000.0
        self.prompt = int(rec["input_length"])
        self.out_len = max(1, int(rec["output_length"]))
        self.n_full = self.prompt // block
        self.blocks = rec["hash_ids"]
        self.pipeline = None
        self.p = self.rld = self.md = self.d = None
        self.p_hit = self.md_hit = 0
        self.md_held = None  # prompt tokens the gateway's index of MD held when routed (md_prefix_index)
        self.md_landed = None  # ... of them, the prefix whose KV had landed there (the rest claimed)
        self.md_after = None  # the request whose claim on MD held the end of that prefix (md_wait_claims)
        self.kv_waiters: list = []  # reservations waiting for this request's KV at MD (md_wait_claims)
        self.fill_flow = None  # the fill: pages the index said MD held and it lacked, sent after its reply
        self.fill_pending = False  # ... not landed yet (MD's KV is complete with both sends)
        self.main_landed = False  # the predicted send landed while the fill was still pending
        self.md_seq = self.rld_seq = None
        self.t_first = self.t_last = self.t_done = None
        self.n_emitted = 0
        self.max_gap = 0.0
        self.generated = 0
        self.prefill_done = self.md_reserved = self.md_kv_complete = False
        self.rld_finished = self.finished = self.cut_off = False
        self.wan_flow = self.fast_flow = None
        self.wan_bytes = 0.0
        self.md_missing = 0
        self.p_pending_flows = 0
        self.p_locked = None
        self.handoff_round = 0
        self.handed = 0
        self.rld_tokens = self.md_tokens = 0
        self.stall = 0.0
        self.t_prefill_done = self.t_md_kv = None
        self.handoff_mode = ""
        self.handoff_deferred = False
        self.md_predicted = False  # MD's send started from the gateway's prediction (md_predicted_send)
        self.wan_landed = False  # MD's KV crossed the WAN (imported once MD has admitted the request)
        self.md_waiting: list = []  # handoff rounds whose ids reached MD before its KV (early handoff)
        self.handoff_started = False  # the gateway asked RLD for the first handoff round
        self.t_handoff_start = None  # ... at this time
        self.t_md_replied = None  # when MD's reservation reply reaches the gateway (its admission + one owd)
        self.t_kv_written = None  # when P wrote MD's KV to its sockets (the runtime's xfer_done; early handoff)
        self.early_pending = False  # an early handoff waits for that reply
        self.t_handoff = None  # when RLD ran it (after its step in flight)
        self.at_seal = None  # what waits for P's prefill to end (ClusterSim._at_seal), or None
        self.md_queued = False  # the plan queued its admission at MD (its md_missing is MD's)
        self.progress_seen = None  # gateway time of MD's last kv_progress a let-through cut-off re-checked
        self.cutoff_watched = False  # let through by the cut-off before its WAN send started
        self.md_counted = None  # the MD whose routing load counts this request, from routing to its end


class Seq:
    """What the engine's scheduler sees (SeqState-compatible) plus simulator bookkeeping."""

    __slots__ = ("seq_id", "num_tokens", "num_computed", "arrival", "can_sample", "req", "kind",
                 "reserved", "locked", "emit_delay", "in_prefill")

    def __init__(self, req: Req, num_tokens: int, num_computed: int, arrival: int, kind: str,
                 reserved: int, locked=None, emit_delay: float = 0.0):
        self.seq_id = req.rid
        self.num_tokens = num_tokens
        self.num_computed = num_computed
        self.arrival = arrival
        self.can_sample = True
        self.req = req
        self.kind = kind  # "prefill" (P), "coloc", "decode" (D / RLD / MD)
        self.reserved = reserved  # private KV tokens held
        self.locked = locked  # cache blocks locked by this sequence
        self.emit_delay = emit_delay  # token latency from this instance to the gateway
        self.in_prefill = False  # counted in its instance's prefilling (Instance.add) until its prompt is computed
