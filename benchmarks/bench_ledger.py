#!/usr/bin/env python
"""What hostile side-channel traffic costs P's hold ledger (not a test).

    python benchmarks/bench_ledger.py [--counts 1000 10000 100000 1000000] [--ledger PATH] [--json out.json]

Drives a :class:`~vllm_kvp2p.lifecycle.producer.ProducerLedger` in this process (pure: no side channel, no
threads) with N messages of one kind that a peer without the shared secret can send at will:

    release      a peer repeating the release of its own reader on a live hold (2 readers expected)
    renew        a peer renewing its own lease, again and again (1 µs of clock apart)
    resent claim a peer resending its claim with the same claim id
    unknown      claims and releases naming holds P never had (one of each per message pair)

and prints, for each N: the ledger's heap entries (``table_sizes()["deadlines"]``), the ledger's memory (what
tracemalloc counts allocated since just before it was made, events taken after each message as the hold service
does) and the time of one ``expire()`` at the moment every deadline those messages set has come (the hold
service calls it under its lock, on P's model-runner thread, at every engine step); also µs per message (under
tracemalloc, so slower than in service).

``--ledger PATH`` loads ``ProducerLedger`` from another copy of producer.py, e.g. the one before the ledger was
bounded by holds: ``git show cab1d6f:vllm_kvp2p/lifecycle/producer.py > /tmp/old_producer.py``.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import sys
import time
import tracemalloc
from collections.abc import Callable
from typing import Any

HOLD_TIMEOUT = 120.0
LEASE_TIMEOUT = 60.0
ALL_DUE = HOLD_TIMEOUT + LEASE_TIMEOUT  # the hold's hard deadline: every deadline any message set has come


def load_ledger_class(path: str | None) -> type:
    if path is None:
        from vllm_kvp2p.lifecycle.producer import ProducerLedger

        return ProducerLedger
    spec = importlib.util.spec_from_file_location("bench_ledger_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up
    spec.loader.exec_module(module)
    return module.ProducerLedger


def hostile(kind: str, ledger: Any) -> Callable[[int], object]:
    """Set up the ledger for one kind of message; return the sender of message ``i``."""
    ledger.hold("victim", "h", 0.0, num_blocks=64)
    if kind == "release":
        return lambda i: ledger.release("victim", "h", "peer:0", 2, 1.0 + i * 1e-6)
    if kind == "renew":
        token = ledger.claim("victim", "h", "peer:0", 1, 1.0).lease_token
        return lambda i: ledger.renew("victim", "h", "peer:0", 1.0 + i * 1e-6, token)
    if kind == "resent claim":
        ledger.claim("victim", "h", "peer:0", 1, 1.0, "claim-1")
        return lambda i: ledger.claim("victim", "h", "peer:0", 1, 1.0 + i * 1e-6, "claim-1")
    if kind == "unknown":
        def unknown(i: int) -> object:
            ledger.claim(f"forged-{i}", "h", "peer:0", 1, 1.0 + i * 1e-6)
            return ledger.release(f"forged-{i}", "h", "peer:0", 1, 1.0 + i * 1e-6)
        return unknown
    raise ValueError(kind)


def run(ledger_class: type, kind: str, count: int) -> dict[str, Any]:
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    ledger = ledger_class(HOLD_TIMEOUT, LEASE_TIMEOUT)
    send = hostile(kind, ledger)
    t0 = time.perf_counter()
    for i in range(count):
        send(i)
        ledger.take_events()
    send_s = time.perf_counter() - t0
    memory = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    heap = ledger.table_sizes()["deadlines"]
    t0 = time.perf_counter()
    ledger.expire(ALL_DUE)
    expire_s = time.perf_counter() - t0
    return {"kind": kind, "messages": count, "heap_entries": heap, "ledger_bytes": memory,
            "expire_ms": round(expire_s * 1e3, 3), "us_per_message": round(send_s / count * 1e6, 2)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--counts", type=int, nargs="+", default=[10**3, 10**4, 10**5, 10**6])
    ap.add_argument("--kinds", nargs="+", default=["release", "renew", "resent claim", "unknown"])
    ap.add_argument("--ledger", help="path of another producer.py to measure (default: this tree's)")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    ledger_class = load_ledger_class(args.ledger)
    rows = []
    print(f"{'messages':14} {'count':>9} {'heap':>9} {'ledger KiB':>11} {'expire() ms':>12} {'us/msg':>7}")
    for kind in args.kinds:
        for count in args.counts:
            row = run(ledger_class, kind, count)
            rows.append(row)
            print(f"{kind:14} {count:>9} {row['heap_entries']:>9} {row['ledger_bytes'] / 1024:>11.1f} "
                  f"{row['expire_ms']:>12.3f} {row['us_per_message']:>7.2f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f, indent=2)


if __name__ == "__main__":
    main()
