#!/usr/bin/env python
"""What the connector costs per engine step, against vLLM's real Scheduler (not a test).

    python benchmarks/bench_step_cost.py [--requests 1 64 256 1024] [--steps 20] [--secret] [--json out.json]

vLLM's own v1 ``Scheduler`` (the one ``vllm serve`` runs) drives the connector's scheduler half, in a P engine and
a D engine, with the workers' side of each step played by the test harness (tests/scheduler/harness.py: one sampled
token per scheduled request, the KV results given). Every public method of the connector object the Scheduler
holds is timed; a step's connector cost is the sum of those calls within one ``schedule()`` + ``update_from_output()``
round. ``idle_step_sleep`` is 0 (it only runs when nothing is scheduled, and the issue does not count it); with
``--secret`` P signs its params and D checks them (``VLLM_KVP2P_SECRET``); metrics are always on (vLLM's
``log_stats``).

For each N concurrent requests (32-token prompts), the phases:

    P prefill      the step in which N prompts finish on P (N holds made, N params issued and signed)
    P ship         the next step (N hold orders to the workers)
    P held         steady steps with N holds and nothing else (median)
    P released     the step in which the workers report all N released (N frees)
    D admit        the step in which N requests with P's params are admitted (N checks, N plans)
    D waiting      steady steps with N loads pending (median)
    D received     the step the workers report N loads done
    D decode       steady steps with N requests decoding after their loads (median)

Worker half, P (``--worker``): a real ``HoldService`` (side channel listening on 127.0.0.1) with N holds: the
per-step ``take_freed`` + ``take_metrics`` vLLM's worker calls make through the connector, median over steps.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

PROMPT = 32
BLOCK = 16


class Timed:
    """Wraps every public method of the connector object: time per method since the last :meth:`take`."""

    def __init__(self, connector: Any) -> None:
        self.spent: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        for name in dir(type(connector)):
            if name.startswith("_") or not callable(getattr(connector, name, None)):
                continue
            setattr(connector, name, self._wrap(name, getattr(connector, name)))

    def _wrap(self, name: str, fn: Any) -> Any:
        def timed(*args: Any, **kwargs: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.spent[name] += time.perf_counter() - t0
                self.calls[name] += 1
        return timed

    def take(self) -> tuple[float, dict[str, float]]:
        by_method = {k: v * 1e6 for k, v in self.spent.items()}
        self.spent.clear()
        self.calls.clear()
        return sum(by_method.values()), by_method


def timed_step(sched: Any, timer: Timed, **kv: Any) -> tuple[float, float, dict[str, float], Any]:
    from tests.scheduler.harness import step

    timer.take()
    t0 = time.perf_counter()
    st = step(sched, **kv)
    total = (time.perf_counter() - t0) * 1e6
    connector, by_method = timer.take()
    return connector, total, by_method, st


def scheduler_phases(n: int, steps: int) -> dict[str, dict[str, Any]]:
    from tests.scheduler.harness import make_request, make_scheduler, make_vllm_config, tokens
    from vllm_kvp2p.connector.metadata import KVP2PWorkerMetadata, PullReport

    extra = {"idle_step_sleep": 0}
    kw = {"max_num_seqs": max(16, n), "max_num_batched_tokens": max(1024, n * PROMPT), "block_size": BLOCK,
          "extra_config": extra}
    blocks = n * (PROMPT // BLOCK + 4) + 64
    p = make_scheduler(make_vllm_config("kv_producer", engine_id=f"p-{n}", **kw), num_blocks=blocks)
    d = make_scheduler(make_vllm_config("kv_consumer", engine_id=f"d-{n}", **kw), num_blocks=blocks)
    tp, td = Timed(p.connector), Timed(d.connector)
    out: dict[str, dict[str, Any]] = {}

    def record(name: str, samples: list[tuple[float, float, dict[str, float]]]) -> None:
        out[name] = {"connector_us": statistics.median(s[0] for s in samples),
                     "step_us": statistics.median(s[1] for s in samples),
                     "by_method_us": {k: round(v, 2) for k, v in samples[len(samples) // 2][2].items()}}

    for i in range(n):
        p.add_request(make_request(f"p{i}", tokens(PROMPT, seed=i), max_tokens=1,
                                   kv_transfer_params={"do_remote_decode": True}))
    c, t, m, st = timed_step(p, tp)
    params = {o.request_id: o.kv_transfer_params for o in st.outputs}
    assert len(params) == n and all(params.values()), "every prompt finished with params in one step"
    record("P prefill", [(c, t, m)])
    c, t, m, st = timed_step(p, tp)
    assert len(st.meta.holds) == n
    record("P ship", [(c, t, m)])
    record("P held", [timed_step(p, tp)[:3] for _ in range(steps)])
    c, t, m, _ = timed_step(p, tp, finished_sending=set(params))
    assert not p.requests, "every hold freed"
    record("P released", [(c, t, m)])

    for i in range(n):
        d.add_request(make_request(f"d{i}", tokens(PROMPT, seed=i), max_tokens=steps + 8,
                                   kv_transfer_params=params[f"p{i}"]))
    c, t, m, st = timed_step(d, td)
    assert len(st.meta.pulls) == n, len(st.meta.pulls)
    record("D admit", [(c, t, m)])
    record("D waiting", [timed_step(d, td)[:3] for _ in range(steps)])
    reports = KVP2PWorkerMetadata({f"d{i}": PullReport(True, PROMPT // BLOCK, 4096, 4, 0.002) for i in range(n)})
    c, t, m, _ = timed_step(d, td, finished_recving={f"d{i}" for i in range(n)}, worker_meta=reports)
    record("D received", [(c, t, m)])
    timed_step(d, td)  # promotion: the requests start running
    record("D decode", [timed_step(d, td)[:3] for _ in range(steps)])
    return out


def worker_phase(n: int, steps: int) -> dict[str, float]:
    from tests.unit.test_side_channel_fuzz import REG  # a plausible rank registration
    from vllm_kvp2p.prefill.hold_service import HoldService
    from vllm_kvp2p.testing.server import free_port

    service = HoldService(REG, "127.0.0.1", free_port(), hold_timeout=600, lease_timeout=60)
    try:
        t0 = time.perf_counter()
        for i in range(n):
            service.hold(f"p{i}", f"h{i}", 2)
        hold_us = (time.perf_counter() - t0) * 1e6
        samples = []
        for _ in range(steps):
            t0 = time.perf_counter()
            service.take_freed()
            service.take_metrics()
            samples.append((time.perf_counter() - t0) * 1e6)
        return {"holds_made_us": hold_us, "held_step_us": statistics.median(samples)}
    finally:
        service.close()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, nargs="+", default=[1, 64, 256, 1024])
    parser.add_argument("--steps", type=int, default=20, help="steady steps per phase (%(default)s)")
    parser.add_argument("--secret", action="store_true", help="sign and check params (VLLM_KVP2P_SECRET)")
    parser.add_argument("--worker", action="store_true", help="also time P's HoldService per step")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.secret:
        os.environ["VLLM_KVP2P_SECRET"] = "bench-step-cost-secret-0123456789"
    else:
        os.environ.pop("VLLM_KVP2P_SECRET", None)
    import logging

    logging.getLogger("vllm").setLevel(logging.ERROR)
    results: dict[str, Any] = {"machine": platform.processor() or platform.machine(), "cpus": os.cpu_count(),
                               "secret": args.secret, "steps": args.steps, "by_requests": {}}
    for n in args.requests:
        phases = scheduler_phases(n, args.steps)
        if args.worker:
            phases["P worker held"] = worker_phase(n, args.steps)
        results["by_requests"][n] = phases
    names = list(next(iter(results["by_requests"].values())))
    print(f"connector us per engine step (vLLM's whole step in brackets), secret={'on' if args.secret else 'off'}")
    print("| phase | " + " | ".join(f"N={n}" for n in args.requests) + " |")
    print("|---|" + "---|" * len(args.requests))
    for name in names:
        cells = []
        for n in args.requests:
            ph = results["by_requests"][n][name]
            if "connector_us" in ph:
                cells.append(f"{ph['connector_us']:.0f} ({ph['step_us']:.0f})")
            else:
                cells.append(f"{ph['held_step_us']:.0f} (holds made: {ph['holds_made_us']:.0f})")
        print(f"| {name} | " + " | ".join(cells) + " |")
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))


if __name__ == "__main__":
    main()
