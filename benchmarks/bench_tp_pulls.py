#!/usr/bin/env python
"""Pull latency with P at tensor parallel 2 and D at TP 1 on this host, with and without the busy-poll bound
(not a test).

    python benchmarks/bench_tp_pulls.py [--busy-poll S] [--runs N]

Each run starts a fresh P (``--tensor-parallel-size 2``, ranks on cores 0 and 1), D (TP 1, core 1) and the proxy,
sends prompts of 10, 64, 167 and 300 tokens through the proxy one after the other, and prints each request's
time and D's pull report. ``--busy-poll 1`` gives vLLM's own 1 s spin window (the connector's ``worker_busy_poll``
setting); the default leaves the platform's (2 ms on CPU). Figures: docs/performance.md, section 4.
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_kvp2p.testing.cluster import ProxyProcess, kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, free_port, free_port_run
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

LENGTHS = (10, 64, 167, 300)


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=300) as r:
        return json.loads(r.read())


def one_run(model: Path, logs: Path, busy_poll: float | None) -> list[tuple[int, float, dict]]:
    poll = {} if busy_poll is None else {"VLLM_KVP2P_WORKER_BUSY_POLL": str(busy_poll)}
    common = {"MC_LOG_LEVEL": "ERROR", **poll}
    prefill = VllmServer(
        model, free_port(), cpus="0|1", log_path=logs / "prefill.log",
        extra_args=("--kv-transfer-config", kv_transfer_config("kv_producer"), "--tensor-parallel-size", "2",
                    "--distributed-executor-backend", "mp"),
        env={**common, "VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port_run(2)), "VLLM_KVP2P_HOLD_TIMEOUT": "60",
             "VLLM_KVP2P_TRANSFER_TIMEOUT": "5"},
        ready_timeout=400,
    )
    decode = VllmServer(
        model, free_port(), cpus="1", log_path=logs / "decode.log",
        extra_args=("--kv-transfer-config", kv_transfer_config("kv_consumer", "recompute")),
        env={**common, "VLLM_KVP2P_TRANSFER_TIMEOUT": "5", "VLLM_KVP2P_CLAIM_WAIT": "5"}, ready_timeout=400,
    )
    proxy = None
    rows = []
    try:
        prefill.start()
        decode.start()
        prefill.wait_ready()
        decode.wait_ready()
        proxy = ProxyProcess.start([prefill.url], [decode.url], logs / "proxy.log")
        for n in LENGTHS:
            prompt = [(7 * i + n) % 500 + 3 for i in range(n)]
            t0 = time.perf_counter()
            out = _post(proxy.url + "/v1/completions",
                        {"model": "tiny", "prompt": prompt, "max_tokens": 12, "temperature": 0})
            rows.append((n, time.perf_counter() - t0, out["kv_transfer_params"].get("kvp2p_pull", {})))
    finally:
        if proxy is not None:
            proxy.stop()
        decode.stop()
        prefill.stop()
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--busy-poll", type=float, default=None, help="worker_busy_poll in seconds (default: platform's)")
    ap.add_argument("--runs", type=int, default=1)
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="kvp2p-tp-pulls-"))
    model = make_tiny_llama(work / "tiny-llama")
    print("| run | prompt tokens | request s | pull ok | pull s | reason |")
    print("|---|---|---|---|---|---|")
    for run in range(args.runs):
        logs = work / f"run{run}"
        logs.mkdir()
        for n, seconds, report in one_run(model, logs, args.busy_poll):
            print(f"| {run} | {n} | {seconds:.2f} | {report.get('ok')} | {report.get('seconds', float('nan')):.3f} | "
                  f"{report.get('reason', '')} |", flush=True)
    print(f"logs: {work}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
