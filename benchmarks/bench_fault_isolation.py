#!/usr/bin/env python
"""Does a frozen or dead P slow D's pulls from another P? (not a test)

    python benchmarks/bench_fault_isolation.py [--requests 40] [--faults freeze kill] [--json out.json]

Two prefill ``vllm serve`` instances (P1, P2) and one decode instance (D, ``recompute``), tiny test model, on
127.0.0.1 (the soak's deployment, ``vllm_kvp2p.testing.soak.SoakCluster``). Each phase sends ``--requests``
requests one after another to D with params P2 prefilled, and times D's answer (pull included, P2's prefill
not), while a second client sends D a request with params P1 prefilled every 0.25 s. Phases: ``healthy``
(those pull from P1) and, per fault, P1 frozen (SIGSTOP) or killed (SIGKILL) after prefilling: those pulls wait
on P1 (a side-channel timeout, then probes) or fail at once, on their own pull thread, and D recomputes them.
The target (the faults issue): P2's requests slowed by no more than 10%.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import tempfile
import threading
import time
from pathlib import Path

import httpx

from vllm_kvp2p.testing.soak import SoakCluster
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

PROMPT_TOKENS = 200
MAX_TOKENS = 4
OTHER_INTERVAL_S = 0.25  # the other client's pace (requests for P1)


def _prompt(seed: int) -> list[int]:
    import random

    rng = random.Random(seed)
    return [rng.randrange(4, 512) for _ in range(PROMPT_TOKENS)]


def prefill(client: httpx.Client, url: str, prompt: list[int]) -> dict:
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 1,
                                                   "kv_transfer_params": {"do_remote_decode": True}})
    r.raise_for_status()
    return r.json()["kv_transfer_params"]


def decode(client: httpx.Client, url: str, prompt: list[int], params: dict) -> tuple[float, bool]:
    t0 = time.perf_counter()
    r = client.post(url + "/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": MAX_TOKENS,
                                                   "temperature": 0, "kv_transfer_params": params})
    took = time.perf_counter() - t0
    r.raise_for_status()
    return took, bool(r.json()["kv_transfer_params"].get("kvp2p_pull", {}).get("ok"))


def phase(cluster: SoakCluster, requests: int, seed: int) -> dict:
    p2, d = cluster.producers[1], cluster.decode
    times, pulled = [], 0
    with httpx.Client(timeout=120, trust_env=False) as client:
        for i in range(requests):
            prompt = _prompt(seed * 100_000 + i)
            took, ok = decode(client, d.url, prompt, prefill(client, p2.url, prompt))
            times.append(took)
            pulled += ok
    times.sort()
    return {"requests": requests, "pulled": pulled, "median_ms": 1000 * statistics.median(times),
            "p90_ms": 1000 * times[int(0.9 * (len(times) - 1))], "mean_ms": 1000 * statistics.fmean(times)}


def other_client(cluster: SoakCluster, params: list[tuple[list[int], dict]], stop: threading.Event,
                 stats: dict) -> None:
    """D requests with P1's params, one every OTHER_INTERVAL_S: the same load on D in every phase."""
    with httpx.Client(timeout=120, trust_env=False) as client:
        for prompt, p in params:
            if stop.is_set():
                return
            t0 = time.monotonic()
            took, ok = decode(client, cluster.decode.url, prompt, p)
            stats["requests"] += 1
            stats["seconds"] += took
            stats["pulled"] += ok
            stop.wait(max(0.0, OTHER_INTERVAL_S - (time.monotonic() - t0)))


def run_phase(cluster: SoakCluster, fault: str | None, requests: int, seed: int) -> dict:
    """P2's requests timed while another client sends D requests for P1 (healthy, frozen or killed)."""
    p1 = cluster.producers[0]
    with httpx.Client(timeout=120, trust_env=False) as client:
        params = [(pr, prefill(client, p1.url, pr)) for pr in (_prompt(seed * 100_000 + 50_000 + i)
                                                               for i in range(requests))]
    pgid = os.getpgid(p1.pid)
    if fault:
        os.killpg(pgid, signal.SIGSTOP if fault == "freeze" else signal.SIGKILL)
    stop, stats = threading.Event(), {"requests": 0, "seconds": 0.0, "pulled": 0}
    other = threading.Thread(target=other_client, args=(cluster, params, stop, stats))
    other.start()
    try:
        time.sleep(0.2)  # the first request for P1 is under way
        result = phase(cluster, requests, seed)
    finally:
        stop.set()
        if fault == "freeze":
            os.killpg(pgid, signal.SIGCONT)
        other.join(timeout=120)
        if fault == "kill":
            p1.kill()
            p1.start().wait_ready()
    result["p1_requests"] = stats["requests"]
    result["p1_pulled"] = stats["pulled"]
    result["p1_mean_s"] = stats["seconds"] / max(1, stats["requests"])
    return result


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requests", type=int, default=40, help="requests per phase")
    ap.add_argument("--faults", nargs="+", default=["freeze", "kill"], choices=["freeze", "kill"])
    ap.add_argument("--json", type=Path, default=None)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvp2p-isolation-"))
    results: dict[str, dict] = {}
    with SoakCluster(make_tiny_llama(work / "tiny-llama"), work / "logs") as cluster:
        phase(cluster, 5, seed=99)  # warm-up: first pulls open segments
        for n, name in enumerate(["healthy", *args.faults, "healthy again"]):
            results[name] = run_phase(cluster, name if name in ("freeze", "kill") else None, args.requests, n)
    base = results["healthy"]["median_ms"]
    print(f"{'phase':<14} {'P2 median':>10} {'P2 p90':>8} {'vs healthy':>10} {'P2 pulled':>9}  P1 requests meanwhile")
    for name, r in results.items():
        r["median_vs_healthy"] = r["median_ms"] / base
        extra = (f"{r['p1_requests']} ({r['p1_pulled']} pulled, {r['p1_mean_s']:.2f} s each)"
                 if "p1_requests" in r else "-")
        print(f"{name:<14} {r['median_ms']:>8.1f}ms {r['p90_ms']:>6.1f}ms {r['median_vs_healthy']:>9.2f}x "
              f"{r['pulled']:>5}/{r['requests']:<3}  {extra}")
    if args.json:
        args.json.write_text(json.dumps({"prompt_tokens": PROMPT_TOKENS, "max_tokens": MAX_TOKENS,
                                         "results": results}, indent=2))
    print(f"logs: {work / 'logs'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
