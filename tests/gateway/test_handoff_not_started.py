"""The gateway's handoff rounds on RLD's ``not_started`` reply (RLD holds the attempt but has not
started decoding it: ``pdd.roles.relay_decode.on_handoff``): nothing is finished and no round
was applied, so MD is told nothing (before, the reply read as a round with no ids: an empty
``extend`` went to MD, and a ``finished`` one would have told MD to finish); the gateway asks
again once RLD streamed the attempt's first token. Fake connections, no processes."""

from __future__ import annotations

import asyncio

from pdd.gateway.state import extend_message
from tests.faults.test_recovery_rules import orch, relayed, stream_to  # noqa: F401 (orch: a fixture)
from tests.gateway.fake_peer import FakePeer

BOUND_S = 10.0
NOT_STARTED = {"t": "handoff_ok", "rid": "r1", "finished": False, "token_ids": [], "mode": None, "final": False,
               "not_started": True}
FINAL = {"t": "handoff_ok", "rid": "r1", "finished": False, "token_ids": [100, 101, 102], "mode": "one_shot",
         "final": True}


class ScriptedRld(FakePeer):
    """An RLD answering its handoff calls with ``replies`` in turn."""

    def __init__(self, replies):
        super().__init__()
        self.replies = list(replies)

    async def call(self, h, payload=b"", timeout=None):
        self._record(h)
        return dict(self.replies.pop(0)), b""


async def test_not_started_is_not_finished_and_the_round_is_asked_again_after_the_first_token(orch):
    rld = orch.peers["rld0"] = ScriptedRld([NOT_STARTED, FINAL])
    md = orch.peers["md0"]
    st = relayed(orch, kv_ready=True)  # MD has the KV; RLD has streamed nothing yet
    task = asyncio.ensure_future(orch._handoff(st))
    await asyncio.wait_for(rld.seen("handoff").wait(), BOUND_S)
    for _ in range(5):
        await asyncio.sleep(0)
    assert md.sent == [] and not st.finished and not st.handoff.rld_finished_first
    assert len(rld.of("handoff")) == 1  # not asked again before RLD's first token
    stream_to(st, 3)  # RLD streams: it is decoding now
    await asyncio.wait_for(task, BOUND_S)
    assert [h["round"] for h in rld.of("handoff")] == [0, 0]  # the not-started reply applied no round
    assert md.sent == [extend_message("r1", [100, 101, 102], final=True)]
    assert st.handoff.md_start == 3 and orch.totals["handoffs"] == 1 and not st.handoff.rld_finished_first
