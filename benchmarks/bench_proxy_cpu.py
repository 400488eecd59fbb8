#!/usr/bin/env python
"""What a front costs per request, apart from the engines (not a test): docs/performance.md "Routing".

    python benchmarks/bench_proxy_cpu.py [--requests 200] [--prompt-len 1400] [--json out.json]

A stub P and a stub D (FastAPI, each answering after ``--upstream-ms``: P with ``kv_transfer_params``, D with a
short SSE stream) stand in for the engines, so that nothing but the front is measured. Each front in turn
(``vllm-kvp2p-proxy --routing least-outstanding``; ``vllm-router --vllm-pd-disaggregation --policy round_robin``
when installed) takes ``--requests`` streamed completions of ``--prompt-len`` token ids, one at a time. Reported:
TTFT p50 (the two upstream waits are the floor) and the front's CPU time per request (user + system, from
``/proc/PID/stat``): on cores the engines keep busy, that CPU is what a request waits for.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

from vllm_kvp2p.testing.cluster import ProxyProcess
from vllm_kvp2p.testing.server import free_port
from vllm_kvp2p.testing.sse import sse_lines

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import Router, _bin  # noqa: E402  (shared with bench_serving)

STUB = r'''
import asyncio, json, sys
import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

port, wait_s = int(sys.argv[1]), float(sys.argv[2]) / 1000
app = FastAPI()
KV = {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": "stub",
      "remote_block_ids": [[1, 2, 3]], "remote_host": "127.0.0.1", "remote_port": 17777}

@app.post("/v1/completions")
async def completions(request: Request):
    body = await request.json()
    await asyncio.sleep(wait_s)
    if body.get("stream"):
        async def events():
            for i in range(4):
                yield ("data: " + json.dumps({"choices": [{"index": 0, "text": f"t{i}"}]}) + "\n\n").encode()
                await asyncio.sleep(0.005)
            yield b"data: [DONE]\n\n"
        return StreamingResponse(events(), media_type="text/event-stream")
    return JSONResponse({"id": "stub", "object": "text_completion", "model": "tiny",
                         "choices": [{"index": 0, "text": "a", "finish_reason": "length"}],
                         "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
                         "kv_transfer_params": KV})

@app.get("/health")
async def health():
    return Response(status_code=200)

@app.get("/v1/models")
async def models():
    return JSONResponse({"object": "list", "data": [{"id": "tiny", "object": "model"}]})

uvicorn.run(app, host="127.0.0.1", port=port, log_level="error")
'''


def cpu_seconds(pid: int) -> float:
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def drive(url: str, pid: int, args: argparse.Namespace) -> dict[str, float]:
    rng = random.Random(0)
    ttfts: list[float] = []
    with httpx.Client(timeout=30) as client:
        for _ in range(5):  # warm-up: connections, imports
            client.post(url + "/v1/completions", json={"model": "tiny", "prompt": [1, 2], "max_tokens": 2})
        before = cpu_seconds(pid)
        for _ in range(args.requests):
            body = {"model": "tiny", "prompt": [rng.randrange(4, 500) for _ in range(args.prompt_len)],
                    "max_tokens": 16, "stream": True}
            t0 = time.monotonic()
            first: float | None = None
            with client.stream("POST", url + "/v1/completions", json=body) as resp:
                for line in sse_lines(resp):
                    if first is None and line.startswith("data: "):
                        first = (time.monotonic() - t0) * 1000
            ttfts.append(first or 0.0)
        used = cpu_seconds(pid) - before
    return {"ttft_p50_ms": round(statistics.median(ttfts), 1),
            "cpu_ms_per_request": round(used / args.requests * 1000, 2)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--prompt-len", type=int, default=1400)
    parser.add_argument("--upstream-ms", type=float, default=20.0, help="each stub's wait before answering")
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    logs = Path(tempfile.mkdtemp(prefix="kvp2p-proxy-cpu-"))
    ports = {"P": free_port(), "D": free_port()}
    stubs = [subprocess.Popen([sys.executable, "-c", STUB, str(port), str(args.upstream_ms)],
                              stdout=subprocess.DEVNULL, stderr=(logs / f"stub-{role}.log").open("w"))
             for role, port in ports.items()]
    p_url, d_url = (f"http://127.0.0.1:{ports[r]}" for r in ("P", "D"))
    results: dict[str, dict[str, float]] = {}
    try:
        deadline = time.monotonic() + 60
        while True:  # both stubs up
            try:
                if all(httpx.get(u + "/health", timeout=1).status_code == 200 for u in (p_url, d_url)):
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit(f"stubs did not start: see {logs}")
            time.sleep(0.2)
        proxy = ProxyProcess.start([p_url], [d_url], logs / "proxy.log", extra_args=("--routing", "least-outstanding"))
        try:
            results["vllm-kvp2p-proxy"] = drive(proxy.url, proxy.proc.pid, args)
        finally:
            proxy.stop()
        if _bin("vllm-router"):
            router = Router([p_url], d_url, logs / "router.log", ("--policy", "round_robin"))
            try:
                results["vllm-router"] = drive(router.url, router.proc.pid, args)
            finally:
                router.stop()
    finally:
        for stub in stubs:
            stub.kill()
            stub.wait()
    print("| front | TTFT p50 ms | CPU ms / request |\n|---|---|---|")
    for name, r in results.items():
        print(f"| {name} | {r['ttft_p50_ms']} | {r['cpu_ms_per_request']} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "results": results}, indent=1))


if __name__ == "__main__":
    main()
