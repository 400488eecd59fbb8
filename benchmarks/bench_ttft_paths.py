#!/usr/bin/env python
"""TTFT at low load on each path the proxy's placement can take (not a test).

    python benchmarks/bench_ttft_paths.py [--requests 20] [--prompt-tokens 960] [--model tiny|small] [--json out.json]

Two engines started as ``kv_both``, one per core (bench_goodput.py's ``auto-both`` engines), and two proxies in
front of both: ``--disaggregate auto`` with objectives loose enough that an idle fleet computes every prompt where
it decodes, and ``--disaggregate always``. One request at a time (``--gap`` apart), fresh random token ids each
(no prefix-cache hits), streamed, in turn:

- **single**: straight to engine 0, no proxy: one ordinary instance;
- **auto-local**: through the ``auto`` proxy, which computes it on the instance it decodes on (checked: the
  answer's ``X-KVP2P-Path`` says ``local``; its threshold set past any prompt, so that the requests before its
  cost model is calibrated are local too);
- **pd**: through the ``always`` proxy: prefilled on one, pulled and decoded by the other.

TTFT is the client's: request sent to the first streamed chunk that carries a token (bench_ttft_timeline.py's
method). Reported per path: median and p90 over the requests after ``--warmup``, and ``auto-local`` minus
``single`` (the price of the proxy on the path that skips P: its tokenizing, its placement, one more HTTP hop).
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_goodput import MODELS, engines  # noqa: E402

from vllm_kvp2p.testing.cluster import ProxyProcess  # noqa: E402
from vllm_kvp2p.testing.sse import sse_lines  # noqa: E402
from vllm_kvp2p.testing.tiny_model import make_tiny_llama  # noqa: E402

PATHS = ("single", "auto-local", "pd")


def ttft_ms(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> tuple[float, str]:
    """The client's TTFT, and the proxy's X-KVP2P-Path ("" straight to an engine)."""
    body = {"model": "tiny", "prompt": prompt, "max_tokens": max_tokens, "temperature": 0, "stream": True,
            "ignore_eos": True}
    sent = time.perf_counter()
    first = None
    with client.stream("POST", url + "/v1/completions", json=body) as resp:
        resp.raise_for_status()
        path = resp.headers.get("x-kvp2p-path", "")
        for line in sse_lines(resp):
            if first is None and line.startswith("data: {") and json.loads(line[6:]).get("choices"):
                first = time.perf_counter()
    assert first is not None, "no token streamed"
    return 1000 * (first - sent), path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--prompt-tokens", type=int, default=960)
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--gap", type=float, default=0.3)
    parser.add_argument("--model", choices=list(MODELS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    model = make_tiny_llama(Path(tempfile.gettempdir()) / f"kvp2p-bench-{args.model}-llama", **MODELS[args.model])
    logs = Path(tempfile.mkdtemp(prefix="kvp2p-ttft-paths-"))
    print(f"[ttft-paths] logs in {logs}", file=sys.stderr)
    servers = engines("kv_both", model, logs)
    proxies: dict[str, ProxyProcess] = {}
    rng = random.Random(args.seed)
    vocab = json.loads((model / "config.json").read_text())["vocab_size"]
    try:
        for s in servers:
            s.start()
        for s in servers:
            s.wait_ready()
        urls = [s.url for s in servers]
        common = ("--kv-both", *urls, "--tokenizer", str(model))
        # Loose objectives, and a threshold no prompt reaches for the requests before the cost model is calibrated.
        proxies["auto-local"] = ProxyProcess.start([], [], logs / "auto.log", extra_args=(
            *common, "--disaggregate", "auto", "--slo", "ttft=60s,tpot=10s", "--disaggregate-threshold", "1000000"))
        proxies["pd"] = ProxyProcess.start([], [], logs / "always.log", extra_args=(
            *common, "--disaggregate", "always"))
        fronts = {"single": servers[0].url, **{k: p.url for k, p in proxies.items()}}
        times: dict[str, list[float]] = {p: [] for p in PATHS}
        seen: dict[str, set[str]] = {p: set() for p in PATHS}
        with httpx.Client(timeout=120) as client:
            for i in range(args.warmup + args.requests):
                for path in PATHS:
                    prompt = [rng.randrange(4, vocab) for _ in range(args.prompt_tokens)]
                    ms, said = ttft_ms(client, fronts[path], prompt, args.max_tokens)
                    seen[path].add(said.split(";")[0])
                    if i >= args.warmup:
                        times[path].append(ms)
                    time.sleep(args.gap)
        if seen["auto-local"] != {"local"} or seen["pd"] != {"pd"}:
            raise SystemExit(f"a path was not taken as meant: {seen}")
        out: dict[str, Any] = {"settings": vars(args), "paths": {}}
        for path in PATHS:
            xs = sorted(times[path])
            out["paths"][path] = {"median_ms": round(statistics.median(xs), 2),
                                  "p90_ms": round(xs[int(0.9 * (len(xs) - 1))], 2), "all_ms": [round(x, 2) for x in xs]}
        single, local = out["paths"]["single"]["median_ms"], out["paths"]["auto-local"]["median_ms"]
        out["auto_local_minus_single_ms"] = round(local - single, 2)
        out["pd_minus_single_ms"] = round(out["paths"]["pd"]["median_ms"] - single, 2)
        for path, figures in out["paths"].items():
            print(f"{path:>10}: TTFT median {figures['median_ms']:.1f} ms, p90 {figures['p90_ms']:.1f}")
        print(f"auto-local - single: {out['auto_local_minus_single_ms']:+.1f} ms; pd - single: "
              f"{out['pd_minus_single_ms']:+.1f} ms")
        if args.json:
            Path(args.json).write_text(json.dumps(out, indent=1))
    finally:
        for p in proxies.values():
            p.stop()
        for s in reversed(servers):
            s.stop()


if __name__ == "__main__":
    main()
