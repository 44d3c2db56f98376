"""Checks shared by the simulator's tests."""


def check_settled(sim) -> None:
    """After a run: every page, lock and decode slot returned exactly once on every instance,
    every request finished with all its tokens and left its MD's routing load."""
    for insts in sim.tiers.values():
        for inst in insts:
            assert inst.private == 0 and inst.slots == 0 and not inst.seqs and not inst.waiting, inst.name
            assert inst.assigned == 0, inst.name
            assert inst.cache is None or not inst.cache.locks, inst.name
    assert all(r.finished and r.n_emitted == r.out_len for r in sim.reqs)


# SimConfig's defaults before they became the runtime's (2026-12-07): the WAN line processor-
# shared, one connection per target, no bytes committed to the sockets, a 250 ms pipeline budget
# and the gateway's plan without the WAN backlog. Tests whose expected times were derived by hand
# on that line, or that reproduce an older simulator's figures, set them explicitly (the
# mechanism they test is the same on the runtime's line; their arithmetic is not).
PRE_RUNTIME_DEFAULTS = dict(wan_order="ps", wan_express_lane_bdp=0.0, wan_send_buffer_bytes=0.0, ttft_budget_ms=250.0,
                            wan_backlog_in_plan=False)
# the same without the budget, for tests that set their own
PRE_RUNTIME_LINE = {k: v for k, v in PRE_RUNTIME_DEFAULTS.items() if k != "ttft_budget_ms"}
