#!/usr/bin/env python
"""Where a P/D request's time to first token goes (not a test).

    python benchmarks/bench_ttft_timeline.py [--requests 20] [--prompt-tokens 480 [1024 ...]] [--model tiny|small]
        [--front proxy|router] [--json out.json]

Starts the demo's deployment (tiny test model; P pinned to core 0, D to core 1, the project's proxy in front, all on
127.0.0.1) with the connector's DEBUG lines on and every engine log line stamped with its wall-clock time in
microseconds (a ``VLLM_LOGGING_CONFIG_PATH`` written here). Then, one request at a time, alternately:

- **single**: the same kind of prompt streamed straight to P without ``kv_transfer_params``: an ordinary instance
  on one core (P's engine, nothing held);
- **pd**: a prompt streamed through the proxy: P prefills, D pulls and decodes.

Every prompt is fresh random token ids (no prefix-cache hits). For each P/D request the timeline is read from the
client's clock and the engines' log lines (one machine: one clock), each stage in ms since the client sent it:

    proxy has P's answer   (the proxy's "prefill ... (x ms)" figure)
    P worker has the hold  ("KV hold ...: N blocks kept for a decoder", P's worker, start of P's next step)
    D planned the pull     ("planned pull of ..." in D's scheduler)
    D sent the first claim ("... SendClaim with P rank 0")
    P answered a claim     ("claim by ...: granted/unknown", P's side channel; unknown = P had not the hold yet)
    D sent the release     ("... SendRelease")
    D's pull done          ("pull of ... done", D's pull thread)
    D's worker reported it ("rank N reports the receives of ...", get_finished in D's next engine step)
    D's scheduler knows    ("receives of ... reached the scheduler", that step's output)
    D scheduled it         ("scheduled ... with its pulled KV", the step that computes the first token)
    first token            (client: first streamed chunk with a token)

and the floor the performance issue sets: single-instance TTFT + the pull (claim sent -> pull done) + one D decode
step (D's median inter-token latency) + the second HTTP hop (proxy has P's answer -> D planned the pull).

Several ``--prompt-tokens`` run one after the other on the same engines, each with its own table; for each, the
pull's share of P/D's TTFT (claim sent -> pull done, over the client's TTFT) is the figure that says what
overlapping the transfer with P's prefill could save at most. ``--front router`` puts vllm-router (P/D mode) in
front instead of the project's proxy: its log has no "prefill" line, so the proxy's stage and the second hop are
blank and the floor leaves the hop out. ``--model small`` is bench_goodput.py's larger model.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_goodput import MODELS, kv_bytes_per_token  # noqa: E402
from bench_serving import Router  # noqa: E402

from vllm_kvp2p.testing.cluster import PDCluster  # noqa: E402
from vllm_kvp2p.testing.sse import sse_lines  # noqa: E402
from vllm_kvp2p.testing.tiny_model import make_tiny_llama  # noqa: E402

LOGGING_CONFIG = {
    "version": 1,
    "disable_existing_loggers": False,
    "formatters": {"stamped": {"format": "@%(created).6f %(levelname)s %(name)s %(message)s"}},
    "handlers": {"out": {"class": "logging.StreamHandler", "formatter": "stamped", "stream": "ext://sys.stdout"}},
    "loggers": {
        "vllm": {"handlers": ["out"], "level": "INFO", "propagate": False},
        "vllm.kvp2p": {"handlers": ["out"], "level": "DEBUG", "propagate": False},
    },
}

STAGES = ("proxy_has_p_answer", "p_hold", "d_plan", "d_claim", "p_claim", "d_release", "d_done", "d_reported",
          "d_known", "d_scheduled", "first_token")
LINE = re.compile(r"^@(\d+\.\d+) (\w+) (\S+) (.*)$")
PROXY_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d,\d{3}) INFO \S+: request (\S+) \S+: prefill \S+ "
                        r"\(([\d.]+) ms[,)]")  # "(28.1 ms, 0 tokens cached)" since routing by prefix


@dataclass
class Streamed:
    sent: float
    first: float = 0.0
    end: float = 0.0
    chunk_times: list[float] = field(default_factory=list)

    @property
    def ttft_ms(self) -> float:
        return 1000 * (self.first - self.sent)

    def itls_ms(self) -> list[float]:
        return [1000 * (b - a) for a, b in zip(self.chunk_times, self.chunk_times[1:])]


def stream(client: httpx.Client, url: str, body: dict) -> Streamed:
    out = Streamed(sent=time.time())
    with client.stream("POST", url + "/v1/completions", json={**body, "stream": True}) as resp:
        resp.raise_for_status()
        for line in sse_lines(resp):
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            # Every chunk with a choice carries one token, also when its text is empty (the detokenizer holds back
            # bytes that do not yet form a character): counted as vLLM's serving benchmark counts it.
            if chunk.get("choices"):
                now = time.time()
                out.first = out.first or now
                out.chunk_times.append(now)
    out.end = time.time()
    return out


def engine_events(log: Path) -> list[tuple[float, str]]:
    events = []
    for line in log.read_text(errors="replace").splitlines():
        m = LINE.match(line)
        if m and m.group(3).startswith("vllm.kvp2p"):
            events.append((float(m.group(1)), m.group(4)))
    return events


def proxy_events(log: Path) -> list[tuple[float, float]]:
    """(time the proxy had P's answer, P's round trip in ms) per request."""
    out = []
    for line in log.read_text(errors="replace").splitlines():
        m = PROXY_LINE.match(line)
        if m:
            stamp = datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S,%f").astimezone(timezone.utc).timestamp()
            out.append((stamp, float(m.group(3))))
    return out


def first(events: list[tuple[float, str]], lo: float, hi: float, needle: str) -> float | None:
    return next((t for t, msg in events if lo <= t <= hi and needle in msg), None)


def timeline(req: Streamed, p_ev: list, d_ev: list, px_ev: list) -> dict[str, float | None]:
    lo, hi = req.sent, req.end
    px = next(((t, ms) for t, ms in px_ev if lo - 0.002 <= t <= hi), None)
    at = {
        # The proxy's stamp has ms resolution; its own figure gives the same instant more precisely.
        "proxy_has_p_answer": px[1] / 1000 + lo if px else None,
        "p_hold": first(p_ev, lo, hi, "kept for a decoder"),
        "d_plan": first(d_ev, lo, hi, "planned pull of"),
        "d_claim": first(d_ev, lo, hi, "SendClaim"),
        "p_claim": first(p_ev, lo, hi, ": claim by "),
        "d_release": first(d_ev, lo, hi, "SendRelease"),
        "d_done": first(d_ev, lo, hi, "done (pulled)"),
        "d_reported": first(d_ev, lo, hi, "reports the receives of"),
        "d_known": first(d_ev, lo, hi, "reached the scheduler"),
        "d_scheduled": first(d_ev, lo, hi, "with its pulled KV"),
        "first_token": req.first,
    }
    row: dict[str, float | None] = {k: (1000 * (v - lo) if v is not None else None) for k, v in at.items()}
    row["claims"] = sum(1 for t, msg in p_ev if lo <= t <= hi and ": claim by " in msg)
    row["claims_unknown"] = sum(1 for t, msg in p_ev if lo <= t <= hi and ": claim by " in msg and "unknown" in msg)
    return row


def median(values: list[float | None]) -> float | None:
    vals = [v for v in values if v is not None]
    return statistics.median(vals) if vals else None


def _fmt(v: float | None) -> str:
    return "-" if v is None else f"{v:7.1f}"


def run(args: argparse.Namespace) -> list[dict]:
    longest = max(args.prompt_tokens) + args.max_tokens
    max_len = max(2048, 1024 * -(-longest // 1024))
    model = make_tiny_llama(f"{args.model_dir}-{args.model}-{max_len}", max_pos=max_len, **MODELS[args.model])
    log_dir = Path(args.log_dir or tempfile.mkdtemp(prefix="kvp2p-timeline-"))
    log_dir.mkdir(parents=True, exist_ok=True)
    cfg = log_dir / "logging.json"
    cfg.write_text(json.dumps(LOGGING_CONFIG))
    env = {"VLLM_LOGGING_CONFIG_PATH": str(cfg), "VLLM_CONFIGURE_LOGGING": "1", **dict(args.env)}
    # Room for a few of the longest prompts in the KV cache (fp32 K and V of every layer).
    cache = max(64 * 2**20, 4 * longest * kv_bytes_per_token(model))
    engine_args = ("--max-model-len", str(max_len), "--kv-cache-memory-bytes", str(cache), *args.engine_arg)
    print(f"[timeline] logs in {log_dir}", file=sys.stderr)
    results = []
    with PDCluster(model, log_dir, prefill_env=env, decode_env=env, engine_args=engine_args) as cluster, \
            httpx.Client(timeout=300, trust_env=False) as client:
        router = Router(cluster.prefill.url, cluster.decode.url, log_dir / "router.log") \
            if args.front == "router" else None
        try:
            front_url = router.url if router is not None else cluster.proxy_url
            for index, tokens in enumerate(args.prompt_tokens):
                results.append(run_length(args, cluster, client, front_url, tokens, args.seed + index))
        finally:
            if router is not None:
                router.stop()
    return results


def run_length(args: argparse.Namespace, cluster: PDCluster, client: httpx.Client, front_url: str, tokens: int,
               seed: int) -> dict:
    rng = random.Random(seed)
    singles: list[Streamed] = []
    pds: list[Streamed] = []
    body = {"model": cluster.prefill.model_name, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}
    for i in range(args.warmup + args.requests):
        for kind in ("single", "pd"):
            prompt = [rng.randrange(4, 500) for _ in range(tokens)]
            url = cluster.prefill.url if kind == "single" else front_url
            got = stream(client, url, {**body, "prompt": prompt})
            if i >= args.warmup:
                (singles if kind == "single" else pds).append(got)
            time.sleep(args.gap)
    time.sleep(0.5)  # let the last log lines reach the files
    p_ev = engine_events(cluster.prefill.log_path)
    d_ev = engine_events(cluster.decode.log_path)
    assert cluster.proxy is not None
    px_ev = proxy_events(cluster.proxy.log_path) if args.front == "proxy" else []

    rows = [timeline(r, p_ev, d_ev, px_ev) for r in pds]
    med = {k: median([r[k] for r in rows]) for k in (*STAGES, "claims", "claims_unknown")}
    single_ttft = statistics.median(r.ttft_ms for r in singles)
    pd_itl = statistics.median(x for r in pds for x in r.itls_ms())
    single_itl = statistics.median(x for r in singles for x in r.itls_ms())
    pulls = [r["d_done"] - r["d_claim"] for r in rows if r["d_done"] is not None and r["d_claim"] is not None]
    hops = [r["d_plan"] - r["proxy_has_p_answer"] for r in rows
            if r["d_plan"] is not None and r["proxy_has_p_answer"] is not None]
    pull_ms = statistics.median(pulls) if pulls else 0.0
    hop_ms = statistics.median(hops) if hops else 0.0
    floor = single_ttft + pull_ms + pd_itl + hop_ms
    pd_ttft = statistics.median(r.ttft_ms for r in pds)
    shares = [(r["d_done"] - r["d_claim"]) / p.ttft_ms for r, p in zip(rows, pds, strict=True)
              if r["d_done"] is not None and r["d_claim"] is not None]
    result = {
        "requests": args.requests, "prompt_tokens": tokens, "max_tokens": args.max_tokens, "model": args.model,
        "front": args.front, "env": dict(args.env), "engine_args": list(args.engine_arg),
        "single_ttft_ms": single_ttft, "single_itl_ms": single_itl, "pd_ttft_ms": pd_ttft,
        "pd_ttft_p90_ms": sorted(r.ttft_ms for r in pds)[int(0.9 * (len(pds) - 1))], "pd_itl_ms": pd_itl,
        "pull_ms": pull_ms, "pull_share_of_pd_ttft": statistics.median(shares) if shares else None,
        "second_hop_ms": hop_ms, "floor_ms": floor, "above_floor_ms": pd_ttft - floor,
        "above_single_ms": pd_ttft - single_ttft, "median_stage_ms": med, "rows": rows,
    }
    print(f"\nP/D timeline through the {args.front}, ms since the client sent the request (median of "
          f"{args.requests}; {tokens}-token prompts, {args.model} model):")
    prev = 0.0
    for stage in STAGES:
        v = med[stage]
        delta = "" if v is None else f"  (+{v - prev:5.1f})"
        print(f"  {stage:<20} {_fmt(v)}{delta}")
        prev = v if v is not None else prev
    print(f"  claims per request: {med['claims']:.0f} (P did not have the hold yet: {med['claims_unknown']:.0f})")
    share = result["pull_share_of_pd_ttft"]
    print(f"\n| | ms |\n|---|---|\n| single-instance TTFT (P's engine, one core) | {single_ttft:.1f} |"
          f"\n| pull (claim sent -> done) | {pull_ms:.1f} |\n| D decode step (ITL) | {pd_itl:.1f} |"
          f"\n| second HTTP hop (proxy has P's answer -> D planned) | {hop_ms:.1f} |\n| **floor** | {floor:.1f} |"
          f"\n| **P/D TTFT** (p90 {result['pd_ttft_p90_ms']:.1f}) | {pd_ttft:.1f} |"
          f"\n| above the floor (target <= 5) | {pd_ttft - floor:.1f} |"
          f"\n| above one instance (target <= 10) | {pd_ttft - single_ttft:.1f} |"
          f"\n| pull's share of P/D TTFT | {'-' if share is None else f'{100 * share:.1f}%'} |")
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=20, help="P/D requests (and as many single) (%(default)s)")
    parser.add_argument("--warmup", type=int, default=3, help="pairs not counted (%(default)s)")
    parser.add_argument("--prompt-tokens", type=int, nargs="+", default=[480], help="one or more (%(default)s)")
    parser.add_argument("--model", choices=list(MODELS), default="tiny", help="(%(default)s)")
    parser.add_argument("--front", choices=("proxy", "router"), default="proxy",
                        help="the project's proxy or vllm-router (%(default)s)")
    parser.add_argument("--max-tokens", type=int, default=24, help="(%(default)s)")
    parser.add_argument("--gap", type=float, default=0.3, help="seconds between requests (%(default)s)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--env", nargs=2, action="append", default=[], metavar=("NAME", "VALUE"),
                        help="extra environment for both engines, e.g. --env VLLM_KVP2P_IDLE_STEP_SLEEP 0")
    parser.add_argument("--engine-arg", action="append", default=[], metavar="FLAG",
                        help="one more `vllm serve` flag for P and D, e.g. --engine-arg=--async-scheduling")
    parser.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "kvp2p-bench-timeline"),
                        help="models are written to <this>-<model>-<max model len>")
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--json", default=None, help="write the figures (and every request's row) here")
    args = parser.parse_args()
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")
    results = run(args)
    if args.json:  # one length: its figures, as before; several: a list
        Path(args.json).write_text(json.dumps(results[0] if len(results) == 1 else results, indent=1))


if __name__ == "__main__":
    main()
