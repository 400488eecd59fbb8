#!/usr/bin/env python
"""Routing policies side by side on shared-prefix traffic (not a test): docs/performance.md "Routing".

    python benchmarks/bench_routing.py [--fronts ...] [--workloads prefix multiturn random] [--json out.json]

Two P engines (one core each) and one D, all publishing vLLM's KV events, serve a locally made Llama big enough
that prefill dominates TTFT on these cores (``--layers``, ``--hidden``). In front of the same engines, in turn:

- ``proxy-lo``: ``vllm-kvp2p-proxy --routing least-outstanding``;
- ``proxy-prefix``: ``vllm-kvp2p-proxy`` with its default ``prefix-aware`` routing, the engines' KV events and
  ``--tokenizer`` (text prompts tokenized in the proxy); ``proxy-prefix-remote``: the same without ``--tokenizer``
  (each text prompt tokenized by a P's ``/tokenize``; not run unless named in ``--fronts``);
- ``router-rr``, ``router-cache``, ``router-kv``: ``vllm-router --vllm-pd-disaggregation`` 0.1.17 with its
  ``round_robin``, ``cache_aware`` and ``kv_aware`` policies (``--pd-kv-events``); skipped when vllm-router is not
  installed (pip install vllm-router).

Workloads:

- ``prefix``: vLLM's serving benchmark, ``--dataset-name prefix_repetition`` (``--num-prefixes`` prefixes of
  ``--prefix-len`` tokens, each prompt one of them plus a ``--suffix-len`` suffix), Poisson at ``--rate``;
- ``multiturn``: ``--conversations`` chats of ``--turns`` turns run side by side; each turn sends the whole history
  (a shared system prompt, earlier turns and answers) plus a new user message, as chat clients do; TTFT measured
  by streaming;
- ``random``: vLLM's random dataset, nothing shared (routing can only cost here).

Before each run every engine's prefix cache is emptied (``/reset_prefix_cache``, ``VLLM_SERVER_DEV_MODE=1``).
Reported per front and workload: TTFT p50 / p99, the P prefix-cache hit rate (``vllm:prefix_cache_hits`` over
``queries``, both P), its best value (every repeat of a prefix on an instance that holds it), and the KV bytes D
pulled per request (``vllm:kvp2p_pull_bytes``), and how many requests each P served.
"""

from __future__ import annotations

import argparse
import json
import random
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import httpx

from vllm_kvp2p.testing.cluster import ProxyProcess, kv_events_config, kv_transfer_config
from vllm_kvp2p.testing.server import VllmServer, free_port
from vllm_kvp2p.testing.sse import sse_lines
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

sys.path.insert(0, str(Path(__file__).parent))
from bench_serving import SERVE_BENCH, Router, _bin  # noqa: E402  (shared with bench_serving)

FRONTS = ("proxy-lo", "proxy-prefix", "proxy-prefix-remote", "router-rr", "router-cache", "router-kv")
DEFAULT_FRONTS = ("proxy-lo", "proxy-prefix", "router-rr", "router-cache", "router-kv")
WORKLOADS = ("prefix", "multiturn", "random")
HASH_SEED = "0"
BLOCK = 32


class Engines:
    """P0 on core 0, P1 on core 1, D on core 1 (it decodes 16 tokens a request: little next to two prefills)."""

    def __init__(self, model: Path, logs: Path, p_kv_mib: int) -> None:
        self.events: dict[str, tuple[int, int]] = {}
        env = {"MC_LOG_LEVEL": "ERROR", "PYTHONHASHSEED": HASH_SEED, "VLLM_SERVER_DEV_MODE": "1"}

        def engine(name: str, role: str, cpus: str, extra: tuple[str, ...], more_env: dict[str, str]) -> VllmServer:
            pub, replay = free_port(), free_port()
            server = VllmServer(model, free_port(), cpus=cpus, log_path=logs / f"{name}.log", ready_timeout=600,
                                extra_args=("--kv-transfer-config", kv_transfer_config(role),
                                            "--kv-events-config", kv_events_config(pub, replay), *extra),
                                env={**env, **more_env})
            self.events[server.url] = (pub, replay)
            return server

        p_kv = ("--kv-cache-memory-bytes", str(p_kv_mib * 2**20))
        self.producers = [engine(f"p{i}", "kv_producer", str(i), p_kv,
                                 {"VLLM_KVP2P_SIDE_CHANNEL_PORT": str(free_port())}) for i in range(2)]
        self.decode = engine("d", "kv_consumer", "1", ("--kv-cache-memory-bytes", str(256 * 2**20)), {})
        self.all = [*self.producers, self.decode]

    def __enter__(self) -> Engines:
        try:
            for s in self.all:
                s.start()
            for s in self.all:
                s.wait_ready()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for s in reversed(self.all):
            s.stop()

    def endpoint(self, server: VllmServer, replay: bool = True) -> str:
        pub, rep = self.events[server.url]
        return f"tcp://127.0.0.1:{pub}" + (f",tcp://127.0.0.1:{rep}" if replay else "")

    def reset_caches(self) -> None:
        for s in self.all:
            status, body = s.request("POST", "/reset_prefix_cache")
            if status != 200:
                raise RuntimeError(f"{s.url}/reset_prefix_cache -> {status}: {body[:200]!r}")

    def counters(self) -> dict[str, float]:
        return {
            "hits": sum(p.metric("vllm:prefix_cache_hits_total") for p in self.producers),
            "queries": sum(p.metric("vllm:prefix_cache_queries_total") for p in self.producers),
            "pull_bytes": self.decode.metric("vllm:kvp2p_pull_bytes_sum"),
            "d_requests": self.decode.metric("vllm:request_success_total"),
            **{f"p{i}_requests": p.metric("vllm:request_success_total") for i, p in enumerate(self.producers)},
        }


@contextmanager
def front(name: str, engines: Engines, logs: Path, model: Path) -> Iterator[str]:
    urls = [p.url for p in engines.producers]
    stop: Any
    if name.startswith("proxy-"):
        extra: tuple[str, ...] = ("--routing", "least-outstanding")
        if name.startswith("proxy-prefix"):
            extra = ("--prefill-kv-events", *(engines.endpoint(p) for p in engines.producers),
                     "--decode-kv-events", engines.endpoint(engines.decode), "--hash-seed", HASH_SEED)
            if name == "proxy-prefix":
                extra += ("--tokenizer", str(model))
        # --cache-headers: the runs read X-KVP2P-Prefill-Cached-Tokens (off by default: an oracle over prompts).
        proxy = ProxyProcess.start(urls, [engines.decode.url], logs / f"{name}.log",
                                   extra_args=(*extra, "--cache-headers"))
        url, stop = proxy.url, proxy.stop
    else:
        policy = {"router-rr": "round_robin", "router-cache": "cache_aware", "router-kv": "kv_aware"}[name]
        extra = ("--policy", policy)
        if policy == "kv_aware":
            for p in engines.producers:
                extra += ("--pd-kv-events", f"{p.url}={engines.endpoint(p, replay=False)}")
        router = Router(urls, engines.decode.url, logs / f"{name}.log", extra)
        url, stop = router.url, router.stop
    try:
        yield url
    finally:
        stop()


def serve_bench(url: str, model: Path, args: argparse.Namespace, dataset: list[str], out: Path) -> list[float]:
    cmd = [sys.executable, "-c", SERVE_BENCH, "--backend", "vllm", "--base-url", url, "--endpoint",
           "/v1/completions", "--model", "tiny", "--tokenizer", str(model), *dataset,
           "--num-prompts", str(args.num_prompts), "--request-rate", str(args.rate), "--ignore-eos",
           "--seed", str(args.seed), "--save-result", "--save-detailed", "--result-dir", str(out.parent),
           "--result-filename", out.name]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.run_timeout)
    if proc.returncode != 0 or not out.exists():
        raise RuntimeError(f"vllm bench serve failed ({proc.returncode}): {proc.stdout[-1500:]}{proc.stderr[-1500:]}")
    raw = json.loads(out.read_text())
    if raw.get("failed"):
        raise RuntimeError(f"{raw['failed']} requests failed")
    return [t * 1000 for t in raw["ttfts"]]


def multiturn(url: str, args: argparse.Namespace, hit_ttfts: list[float]) -> list[float]:
    """Chats whose every turn resends the history: token-id prompts, TTFT by streaming. ``hit_ttfts`` gets the
    TTFTs of the turns whose P held all but the new message (behind this proxy, which says so in a header): the
    floor no placement can go under."""
    rng = random.Random(args.seed)
    system = [rng.randrange(4, 500) for _ in range(args.system_len)]
    ttfts: list[float] = []
    lock = threading.Lock()

    def chat(c: int) -> None:
        crng = random.Random(args.seed * 1000 + c)
        history = list(system)
        with httpx.Client(timeout=300) as client:
            for _ in range(args.turns):
                history += [crng.randrange(4, 500) for _ in range(args.user_len)]
                t0 = time.monotonic()
                first: float | None = None
                answer: list[str] = []
                body = {"model": "tiny", "prompt": history, "max_tokens": args.output_len, "temperature": 0,
                        "ignore_eos": True, "stream": True}
                with client.stream("POST", url + "/v1/completions", json=body) as resp:
                    resp.raise_for_status()
                    cached = int(resp.headers.get("x-kvp2p-prefill-cached-tokens", "-1"))
                    for line in sse_lines(resp):
                        if line.startswith("data: ") and line != "data: [DONE]":
                            if first is None:
                                first = time.monotonic() - t0
                            answer.append(json.loads(line[6:])["choices"][0]["text"])
                with lock:
                    ttfts.append((first or 0.0) * 1000)
                    # P held every full block of the previous turn's prompt (the answer is new to it).
                    if cached >= (len(history) - args.user_len - args.output_len) // BLOCK * BLOCK > 0:
                        hit_ttfts.append((first or 0.0) * 1000)
                # The answer joins the history (as token ids, a stand-in for its re-tokenized text).
                history += [crng.randrange(4, 500) for _ in range(args.output_len)]
                time.sleep(crng.expovariate(1 / args.think_s))

    threads = [threading.Thread(target=chat, args=(c,)) for c in range(args.conversations)]
    for t in threads:
        t.start()
        time.sleep(args.think_s / args.conversations)
    for t in threads:
        t.join()
    return ttfts


def best_hit_rate(args: argparse.Namespace, workload: str) -> float | None:
    """Hits a router could reach: every repeat of a prefix (in whole blocks) on an instance that holds it."""
    if workload == "prefix":
        per_prompt = args.prefix_len + args.suffix_len
        repeats = args.num_prompts - args.num_prefixes
        return repeats * (args.prefix_len // BLOCK * BLOCK) / (args.num_prompts * per_prompt)
    if workload == "multiturn":
        hits = queries = 0
        for c in range(args.conversations):
            length = args.system_len
            for turn in range(args.turns):
                length += args.user_len
                cached = (length - args.user_len) if turn else (args.system_len if c else 0)
                hits += cached // BLOCK * BLOCK
                queries += length
                length += args.output_len
        return hits / queries
    return 0.0


def run(name: str, workload: str, engines: Engines, model: Path, args: argparse.Namespace, logs: Path) -> dict:
    # vLLM publishes the reset's AllBlocksCleared with its next step that has requests: the proxy's index empties
    # at this run's first request, so that request alone may be routed by the previous run's blocks.
    engines.reset_caches()
    before = engines.counters()
    hit_ttfts: list[float] = []
    with front(name, engines, logs, model) as url:
        time.sleep(1.0)  # subscriptions settle
        if workload == "multiturn":
            ttfts = multiturn(url, args, hit_ttfts)
        elif workload == "prefix":
            ttfts = serve_bench(url, model, args, [
                "--dataset-name", "prefix_repetition", "--prefix-repetition-prefix-len", str(args.prefix_len),
                "--prefix-repetition-suffix-len", str(args.suffix_len),
                "--prefix-repetition-num-prefixes", str(args.num_prefixes),
                "--prefix-repetition-output-len", str(args.output_len)], logs / f"{name}-{workload}.json")
        else:
            ttfts = serve_bench(url, model, args, [
                "--dataset-name", "random", "--random-input-len", str(args.prefix_len + args.suffix_len),
                "--random-output-len", str(args.output_len)], logs / f"{name}-{workload}.json")
    after = engines.counters()
    delta = {k: after[k] - before[k] for k in before}
    q = statistics.quantiles(ttfts, n=100)
    return {"requests": len(ttfts), "ttft_p50_ms": round(statistics.median(ttfts), 1), "ttft_p99_ms": round(q[98], 1),
            "p_hit_rate": round(delta["hits"] / delta["queries"], 3) if delta["queries"] else None,
            "best_hit_rate": round(best_hit_rate(args, workload) or 0.0, 3),
            "pulled_kib_per_request": round(delta["pull_bytes"] / max(1.0, delta["d_requests"]) / 1024, 1),
            "hit_ttft_p50_ms": round(statistics.median(hit_ttfts), 1) if hit_ttfts else None,
            "hit_requests": len(hit_ttfts) if hit_ttfts else None,
            "p_split": "/".join(str(round(delta[f"p{i}_requests"])) for i in range(len(engines.producers)))}


def _median(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Medians over the repeats of one front and workload (each run's p50 and p99, hit rate, bytes)."""
    out: dict[str, Any] = {k: round(statistics.median(r[k] for r in rows if r[k] is not None), 3)
                           for k in rows[0] if isinstance(rows[0][k], (int, float))}
    out["runs"] = len(rows)
    out["ttft_p50_ms_all"] = [r["ttft_p50_ms"] for r in rows]
    out["p_split_all"] = [r.get("p_split") for r in rows]
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--fronts", nargs="+", default=list(DEFAULT_FRONTS), choices=FRONTS)
    parser.add_argument("--workloads", nargs="+", default=list(WORKLOADS), choices=WORKLOADS)
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--hidden", type=int, default=256)
    parser.add_argument("--p-kv-mib", type=int, default=14,
                        help="KV cache of each P (MiB); the default holds about half the prefixes, so that where a "
                        "prompt goes decides whether its prefix is still there")
    parser.add_argument("--prefix-len", type=int, default=480)
    parser.add_argument("--suffix-len", type=int, default=32)
    parser.add_argument("--num-prefixes", type=int, default=12)
    parser.add_argument("--num-prompts", type=int, default=60)
    parser.add_argument("--rate", type=float, default=4.0)
    parser.add_argument("--output-len", type=int, default=16)
    parser.add_argument("--conversations", type=int, default=6)
    parser.add_argument("--turns", type=int, default=5)
    parser.add_argument("--system-len", type=int, default=256)
    parser.add_argument("--user-len", type=int, default=64)
    parser.add_argument("--think-s", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--repeats", type=int, default=1, help="runs of every front and workload (medians reported)")
    parser.add_argument("--run-timeout", type=float, default=900)
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    signal.signal(signal.SIGTERM, lambda s, f: (_ for _ in ()).throw(SystemExit(f"signal {s}")))
    model = make_tiny_llama(Path(tempfile.gettempdir()) / f"kvp2p-bench-llama-{args.layers}x{args.hidden}",
                            num_layers=args.layers, hidden=args.hidden, heads=args.hidden // 64, kv_heads=2)
    logs = Path(args.log_dir or tempfile.mkdtemp(prefix="kvp2p-routing-"))
    logs.mkdir(parents=True, exist_ok=True)
    print(f"[routing] logs in {logs}", file=sys.stderr)
    fronts = [f for f in args.fronts if f.startswith("proxy-") or _bin("vllm-router")]
    runs: dict[str, dict[str, list[dict[str, Any]]]] = {}
    errors: dict[str, dict[str, str]] = {}
    with Engines(model, logs, args.p_kv_mib) as engines:
        # Fronts interleaved within each repeat, in reverse order every other repeat, so that a slow spell of the
        # machine (or a trend over the run) does not land on one front.
        for rep in range(args.repeats):
            for workload in args.workloads:
                for name in fronts if rep % 2 == 0 else fronts[::-1]:
                    try:
                        row = run(name, workload, engines, model, args, logs)
                    except (RuntimeError, subprocess.TimeoutExpired, httpx.HTTPError) as exc:
                        errors.setdefault(workload, {})[name] = str(exc)[-600:]
                        print(f"[routing] {workload} {name} rep {rep}: {exc}", file=sys.stderr, flush=True)
                        continue
                    runs.setdefault(workload, {}).setdefault(name, []).append(row)
                    print(f"[routing] {workload} {name} rep {rep}: {row}", file=sys.stderr, flush=True)
    results = {w: {n: _median(rows) for n, rows in by_front.items()} for w, by_front in runs.items()}
    lines = ["| workload | front | TTFT p50 ms (runs) | TTFT p99 ms | P hit rate | best | KiB pulled / request | "
             "requests per P (runs) | TTFT p50 of full hits |", "|---|---|---|---|---|---|---|---|---|"]
    for workload, rows in results.items():
        for name, r in rows.items():
            lines.append(f"| {workload} | {name} | {r['ttft_p50_ms']} {r['ttft_p50_ms_all']} | {r['ttft_p99_ms']} | "
                         f"{r['p_hit_rate']} | {r['best_hit_rate']} | {r['pulled_kib_per_request']} | "
                         f"{', '.join(str(x) for x in r['p_split_all'])} | {r.get('hit_ttft_p50_ms', '')} |")
    for workload, by_front in errors.items():
        for name, err in by_front.items():
            lines.append(f"| {workload} | {name} | error: {err[:80]} | | | | | | |")
    print("\n".join(lines))
    if args.json:
        Path(args.json).write_text(json.dumps({"settings": vars(args), "results": results, "runs": runs,
                                               "errors": errors}, indent=1))


if __name__ == "__main__":
    main()
