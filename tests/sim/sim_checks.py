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
