#!/usr/bin/env python
"""What bounding vLLM's busy-polling (``worker_busy_poll``) costs a plain decode (not a test).

    python benchmarks/bench_busy_poll.py [--tokens 256] [--reps 3]

Starts one ``vllm serve`` of the tiny test model with the connector as ``kv_both`` (so the setting applies) twice:
with ``worker_busy_poll`` at vLLM's own 1 s and at the CPU default 2 ms, and times the same greedy completions
(``ignore_eos``, fixed length) on each. Prints decode tokens/s per setting and the CPU seconds the server's
process tree used per request.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_kvp2p.testing.cluster import kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.tiny_model import make_tiny_llama


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def _tree_cpu_seconds(pid: int) -> float:
    """user+sys CPU seconds of ``pid`` and all its descendants (from /proc)."""
    import os

    tick = os.sysconf("SC_CLK_TCK")
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
                children.setdefault(int(fields[1]), []).append(int(entry))
            except OSError:
                continue
    total, stack = 0.0, [pid]
    while stack:
        p = stack.pop()
        try:
            with open(f"/proc/{p}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += (int(fields[11]) + int(fields[12])) / tick
        except OSError:
            pass
        stack.extend(children.get(p, []))
    return total


def run(model: Path, busy_poll: float, tokens: int, reps: int, log_dir: Path) -> dict:
    # single_process=False: the busy poll is the Worker process's shared-memory reader, absent in one process.
    server = VllmServer(model, free_port(), cpus="0", single_process=False,
                        log_path=log_dir / f"busy_poll_{busy_poll}.log",
                        extra_args=("--kv-transfer-config", kv_transfer_config("kv_both")),
                        env={"VLLM_KVP2P_WORKER_BUSY_POLL": str(busy_poll), "MC_LOG_LEVEL": "ERROR"})
    server.start()
    try:
        server.wait_ready()
        body = {"model": "tiny", "prompt": "the quick brown fox", "max_tokens": tokens, "temperature": 0,
                "ignore_eos": True}
        _post(server.url + "/v1/completions", {**body, "max_tokens": 8})  # warm-up
        rates, cpu = [], []
        for _ in range(reps):
            c0, t0 = _tree_cpu_seconds(server.pid), time.perf_counter()
            out = _post(server.url + "/v1/completions", body)
            dt = time.perf_counter() - t0
            cpu.append(_tree_cpu_seconds(server.pid) - c0)
            rates.append(out["usage"]["completion_tokens"] / dt)
        time.sleep(3)
        c0 = _tree_cpu_seconds(server.pid)
        time.sleep(5)
        idle = (_tree_cpu_seconds(server.pid) - c0) / 5
        return {"busy_poll_s": busy_poll, "tokens_per_s": statistics.median(rates),
                "all_tokens_per_s": [round(r, 1) for r in rates], "cpu_s_per_request": statistics.median(cpu),
                "idle_cpu_cores": idle}
    finally:
        server.stop()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tokens", type=int, default=256)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvp2p-busy-poll-"))
    model = make_tiny_llama(work / "tiny-llama")
    rows = [run(model, poll, args.tokens, args.reps, work) for poll in (1.0, 0.002)]
    print(f"| worker_busy_poll | decode tokens/s (median of {args.reps}) | runs | CPU s per request | "
          "idle CPU (cores) |")
    print("|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['busy_poll_s']} s | {r['tokens_per_s']:.1f} | {r['all_tokens_per_s']} | "
              f"{r['cpu_s_per_request']:.2f} | {r['idle_cpu_cores']:.2f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
