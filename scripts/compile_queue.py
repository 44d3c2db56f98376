"""The gateway's constraint compile queue under clients sending large new grammars: what a small
constraint waits, in arrival order against the queue's highest-response-ratio order
(``pdd.compile_queue``), and what
compiles of clients that went away cost the next one, kept against dropped.

The gateway's own path minus HTTP: each request is a ``CompletionRequest`` whose constraint the
queue's one thread (a 256 MiB stack, as ``pdd.structured.compiler``) compiles with
``openai_schemas.structured_constraint``, its cost estimate ``compile_cost_s(constraint_chars(body))``
as the gateway's (arrival order: every cost the same). Every grammar is new (the compile cache never hits).

1. ``--large-clients`` clients each send a fresh GBNF grammar of about ``--large-chars``
   characters, wait for its compile, and send the next; a small client sends a regex
   ``[a-z]{1,3}`` (made unique) every ``--small-every-s`` seconds for ``--seconds``: its wait +
   compile time, P50 / max, per order.
2. ``--abandoned`` large grammars are queued and their clients go (their futures cancelled, as
   the gateway does on a disconnect), then one small regex: its time, kept against dropped
   (arrival order both, so only the dropping differs).

Both orders run in this one process, one after the other, twice each alternating (A B A B):

    PYTHONPATH=src python scripts/compile_queue.py --seconds 20
"""

from __future__ import annotations

import argparse
import random
import statistics
import threading
import time

from pdd.compile_queue import CompileQueue
from pdd.gateway.openai_schemas import CompletionRequest, constraint_chars, structured_constraint
from pdd.structured import COMPILER_STACK_BYTES, compile_cost_s

_SEQ = iter(range(10**9))


def large_grammar(chars: int, rng: random.Random) -> str:
    """A new GBNF grammar of about ``chars`` characters: a chain of rules, each a literal and a
    choice of the next rule or an end (llguidance's GBNF -> Lark conversion is Python: the slow
    kind)."""
    tag = next(_SEQ)
    rules, i = [f"root ::= r0 \"{tag}\"\n"], 0
    while sum(map(len, rules)) < chars:
        lit = "".join(rng.choice("abcdefgh") for _ in range(6))
        rules.append(f'r{i} ::= "{lit}" ( r{i + 1} | "x{i}" )\n')
        i += 1
    rules.append(f'r{i} ::= "end"\n')
    return "".join(rules)


def body(**constraint) -> CompletionRequest:
    return CompletionRequest.model_validate({"prompt": "x", **constraint})


def submit(q: CompileQueue, b: CompletionRequest, costed: bool):
    cost = compile_cost_s(constraint_chars(b)) if costed else 0.0
    return q.submit_costed(cost, structured_constraint, b)


def contention(costed: bool, args) -> list[float]:
    """Seconds each small regex took (submit to compiled) beside the large clients."""
    q = CompileQueue(threads=1, stack_bytes=COMPILER_STACK_BYTES, name="grammar-compile")
    stop = threading.Event()
    rng = random.Random(7)
    grammars = [[large_grammar(args.large_chars, rng) for _ in range(40)] for _ in range(args.large_clients)]

    def large_client(k: int) -> None:
        for g in grammars[k]:
            if stop.is_set():
                return
            submit(q, body(guided_grammar=g), costed).result()

    threads = [threading.Thread(target=large_client, args=(k,), daemon=True) for k in range(args.large_clients)]
    for t in threads:
        t.start()
    waits: list[float] = []
    end = time.monotonic() + args.seconds
    time.sleep(args.small_every_s)
    while time.monotonic() < end:
        t0 = time.monotonic()
        submit(q, body(guided_regex=f"[a-z]{{1,3}}{next(_SEQ)}"), costed).result()
        waits.append(time.monotonic() - t0)
        time.sleep(max(0.0, args.small_every_s - (time.monotonic() - t0)))
    stop.set()
    for t in threads:
        t.join()
    q.shutdown()
    return waits


def abandoned(drop: bool, args) -> float:
    """Seconds the small regex took behind ``args.abandoned`` large compiles whose clients went."""
    q = CompileQueue(threads=1, stack_bytes=COMPILER_STACK_BYTES, name="grammar-compile")
    rng = random.Random(11)
    gone = [submit(q, body(guided_grammar=large_grammar(args.large_chars, rng)), False) for _ in range(args.abandoned)]
    if drop:
        for f in gone:
            f.cancel()  # a job already running finishes; the queued ones never run
    t0 = time.monotonic()
    submit(q, body(guided_regex=f"[a-z]{{1,3}}{next(_SEQ)}"), False).result()
    took = time.monotonic() - t0
    q.shutdown(cancel_futures=True)
    return took


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seconds", type=float, default=20.0, help="length of each contention run")
    ap.add_argument("--large-clients", type=int, default=4)
    ap.add_argument("--large-chars", type=int, default=26_700)
    ap.add_argument("--small-every-s", type=float, default=0.5)
    ap.add_argument("--abandoned", type=int, default=8)
    args = ap.parse_args(argv)
    q = CompileQueue(threads=1, stack_bytes=COMPILER_STACK_BYTES)
    t0 = time.monotonic()
    submit(q, body(guided_regex=f"[a-z]{{1,3}}{next(_SEQ)}"), False).result()
    print(f"a small regex alone: {1000 * (time.monotonic() - t0):.1f} ms")
    t0 = time.monotonic()
    submit(q, body(guided_grammar=large_grammar(args.large_chars, random.Random(1))), False).result()
    print(f"a {args.large_chars:,}-character GBNF grammar alone: {1000 * (time.monotonic() - t0):.0f} ms")
    q.shutdown()
    print(f"\n1. a small regex every {args.small_every_s} s beside {args.large_clients} clients sending new "
          f"{args.large_chars:,}-character GBNF grammars, {args.seconds:.0f} s a run:")
    for rnd in range(2):
        for costed in (False, True):
            w = contention(costed, args)
            name = "response-ratio order" if costed else "arrival order       "
            print(f"   run {rnd + 1} {name}: {len(w)} small regexes, wait + compile P50 "
                  f"{1000 * statistics.median(w):.0f} ms, max {1000 * max(w):.0f} ms")
    print(f"\n2. a small regex behind {args.abandoned} large compiles whose clients went:")
    for rnd in range(2):
        for drop in (False, True):
            s = abandoned(drop, args)
            print(f"   run {rnd + 1} {'dropped' if drop else 'kept   '}: {1000 * s:.0f} ms")


if __name__ == "__main__":
    main()
