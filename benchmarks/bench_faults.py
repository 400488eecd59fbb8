#!/usr/bin/env python
"""How fast D answers a request whose P died or froze after prefilling it (not a test).

    python benchmarks/bench_faults.py [--connector kvp2p nixl] [--faults kill freeze] [--reps 2] [--json out.json]

For each connector: one decode ``vllm serve`` (failed loads recomputed) and, per fault and repetition, a fresh
prefill ``vllm serve`` of the tiny test model, on 127.0.0.1. A prompt is prefilled on P (its
``kv_transfer_params`` kept), P is killed (SIGKILL) or frozen (SIGSTOP), and the same prompt is sent to D with
those params: the time until D answers is the recovery time. D's answer is checked against D's own computation
of the prompt (no params). A second request for the same faulty P follows, to show what a later plan for it
costs. ``nixl`` runs vLLM's NixlConnector (``kv_buffer_device: cpu``) where the ``nixl`` package is installed;
it is skipped, with the reason, where it is not.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import signal
import statistics
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.tiny_model import make_tiny_llama


def post(url: str, body: dict, timeout: float = 120) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def transfer_config(connector: str, role: str) -> str:
    if connector == "nixl":
        config = {"kv_connector": "NixlConnector", "kv_role": "kv_both", "kv_buffer_device": "cpu",
                  "kv_load_failure_policy": "recompute"}
    else:
        config = {"kv_connector": "MooncakeP2PConnector", "kv_role": role, "kv_load_failure_policy": "recompute"}
    return json.dumps(config)


def engine_env(connector: str) -> dict[str, str]:
    port = str(free_port())
    return {"VLLM_NIXL_SIDE_CHANNEL_PORT": port} if connector == "nixl" else {"VLLM_KVP2P_SIDE_CHANNEL_PORT": port}


def start(model: Path, connector: str, role: str, cpus: str, log: Path) -> VllmServer:
    server = VllmServer(model, free_port(), cpus=cpus, log_path=log, env=engine_env(connector),
                        extra_args=("--kv-transfer-config", transfer_config(connector, role)))
    server.start().wait_ready()
    return server


def completion(prompt: list[int], params: dict | None = None, max_tokens: int = 8) -> dict:
    body: dict = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0}
    if params is not None:
        body["kv_transfer_params"] = params
    return body


def run(connector: str, faults: list[str], reps: int, model: Path, logs: Path) -> list[dict]:
    rows = []
    decode = start(model, connector, "kv_consumer", "1", logs / f"{connector}-decode.log")
    try:
        for fault in faults:
            for rep in range(reps):
                prefill = start(model, connector, "kv_producer", "0", logs / f"{connector}-{fault}-{rep}.log")
                prompts = [[(7 * i + 13 * rep + 29 * j) % 500 + 4 for i in range(160)] for j in range(2)]
                try:
                    params = [post(prefill.url + "/v1/completions", completion(p, {"do_remote_decode": True}, 1))
                              ["kv_transfer_params"] for p in prompts]
                    os.killpg(os.getpgid(prefill.pid), signal.SIGKILL if fault == "kill" else signal.SIGSTOP)
                    times = []
                    for prompt, p in zip(prompts, params):
                        t0 = time.monotonic()
                        out = post(decode.url + "/v1/completions", completion(prompt, p))
                        times.append(time.monotonic() - t0)
                        report = (out.get("kv_transfer_params") or {}).get("kvp2p_pull", {})
                        assert connector != "kvp2p" or report.get("failure") == "unreachable", report
                        expected = post(decode.url + "/v1/completions", completion(prompt))
                        assert out["choices"][0]["text"] == expected["choices"][0]["text"], "wrong answer"
                    rows.append({"connector": connector, "fault": fault, "rep": rep, "first_s": round(times[0], 2),
                                 "next_s": round(times[1], 2)})
                    print(f"{connector:6} {fault:7} rep {rep}: first request {times[0]:6.2f} s, next {times[1]:6.2f} s",
                          flush=True)
                finally:
                    if fault == "freeze" and prefill.is_running():
                        os.killpg(os.getpgid(prefill.pid), signal.SIGCONT)
                    prefill.stop()
    finally:
        decode.stop()
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--connector", nargs="+", default=["kvp2p", "nixl"], choices=["kvp2p", "nixl"])
    ap.add_argument("--faults", nargs="+", default=["kill", "freeze"], choices=["kill", "freeze"])
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--json", help="write the rows here")
    args = ap.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-faults-"))
    model = make_tiny_llama(work / "tiny-llama")
    rows: list[dict] = []
    for connector in args.connector:
        if connector == "nixl" and importlib.util.find_spec("nixl") is None:
            print("nixl: skipped (the nixl package is not installed: pip install nixl nixl-cu12)")
            continue
        rows += run(connector, args.faults, args.reps, model, work)
    print(f"\n{'connector':10} {'fault':8} {'first request s (median)':>26} {'next request s (median)':>25}")
    for connector in args.connector:
        for fault in args.faults:
            sel = [r for r in rows if r["connector"] == connector and r["fault"] == fault]
            if sel:
                print(f"{connector:10} {fault:8} {statistics.median(r['first_s'] for r in sel):>26.2f} "
                      f"{statistics.median(r['next_s'] for r in sel):>25.2f}")
    print(f"logs: {work}")
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=2))


if __name__ == "__main__":
    main()
