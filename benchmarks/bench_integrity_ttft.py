#!/usr/bin/env python
"""What the integrity digest adds to a request's time to first token on real engines (not a test).

    python benchmarks/bench_integrity_ttft.py [--requests 120] [--prompt-tokens 480] [--json out.json]

The demo's engines (tiny test model, float32; P pinned to core 0, D to core 1, 127.0.0.1), started twice:

- D at ``integrity=sampled`` with ``integrity_sampled_pulls=0.5``: half of the pulls are verified (chosen by
  request id), the other half run exactly as with ``integrity=off``. Both halves are interleaved in one run, so
  the difference of their medians is the cost of a verified sampled pull, without the run-to-run noise that
  separate deployments would add (several ms here);
- D at ``integrity=sampled`` with ``integrity_sampled_pulls=0.5`` and ``integrity_sampled_units=1024`` (more
  than a pull of this model has): half of the pulls verified in every unit, exactly what ``full`` does, again
  against the unverified half of the same run.

One request at a time, each a fresh random prompt: P prefills it (``do_remote_decode``, one token), then D
(``max_tokens`` 1) pulls and computes the first token. Reported: P's time, D's time (pull + one step) and their
sum (the time to first token without the proxy's hop), medians per kind of pull, and the digest's cost as a share
of that time to first token, per verified pull and averaged at the default share of verified pulls.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import httpx

from vllm_kvp2p.connector.scheduler import PULL_REPORT_KEY
from vllm_kvp2p.contract.config import KVP2PConfig
from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

VOCAB_SIZE = 512  # make_tiny_llama's default vocabulary


def run(model: Path, log_dir: Path, extra: dict[str, object], requests: int, prompt_tokens: int,
        seed: int) -> list[dict[str, float | bool]]:
    rng = random.Random(seed)
    rows: list[dict[str, float | bool]] = []
    with PDCluster(model, log_dir, decode_extra_config=extra) as cluster, httpx.Client(timeout=120) as client:
        for i in range(requests + 5):
            prompt = [rng.randrange(4, VOCAB_SIZE) for _ in range(prompt_tokens)]
            t0 = time.perf_counter()
            p = client.post(cluster.prefill.url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 1,
                "kv_transfer_params": {"do_remote_decode": True}}).json()
            t1 = time.perf_counter()
            d = client.post(cluster.decode.url + "/v1/completions", json={
                "model": "tiny", "prompt": prompt, "max_tokens": 1,
                "kv_transfer_params": p["kv_transfer_params"]}).json()
            t2 = time.perf_counter()
            report = d["kv_transfer_params"][PULL_REPORT_KEY]
            assert report["ok"], report
            if i >= 5:  # the first few warm both engines up
                rows.append({"p_ms": (t1 - t0) * 1e3, "d_ms": (t2 - t1) * 1e3, "ttft_ms": (t2 - t0) * 1e3,
                             "verified": bool(report.get("verified")), "units": report.get("verified", 0)})
    return rows


def medians(rows: list[dict[str, float | bool]]) -> dict[str, float]:
    return {key: round(statistics.median(float(r[key]) for r in rows), 2)
            for key in ("p_ms", "d_ms", "ttft_ms", "units")} | {"n": len(rows)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--requests", type=int, default=120)
    parser.add_argument("--prompt-tokens", type=int, default=480)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    base = Path(tempfile.mkdtemp(prefix="kvp2p-integrity-ttft-"))
    model = make_tiny_llama(base / "model")
    half = {"integrity": "sampled", "integrity_sampled_pulls": 0.5}
    sampled = run(model, base / "sampled", half, args.requests, args.prompt_tokens, seed=1)
    whole = run(model, base / "full", {**half, "integrity_sampled_units": 1024}, args.requests, args.prompt_tokens,
                seed=2)
    share = KVP2PConfig().integrity_sampled_pulls
    result: dict[str, object] = {}
    for name, rows in (("sampled", sampled), ("full", whole)):
        plain, verified = medians([r for r in rows if not r["verified"]]), medians([r for r in rows if r["verified"]])
        cost = verified["d_ms"] - plain["d_ms"]
        result[name] = {"unverified_pulls": plain, "verified_pulls": verified,
                        "cost_ms_per_verified_pull": round(cost, 2),
                        "cost_pct_of_ttft_per_verified_pull": round(100 * cost / plain["ttft_ms"], 2)}
    sampled_cost = result["sampled"]["cost_ms_per_verified_pull"]  # type: ignore[index]
    ttft = result["sampled"]["unverified_pulls"]["ttft_ms"]  # type: ignore[index]
    result |= {"default_share_of_pulls_verified": share,
               "sampled_cost_pct_of_ttft_at_default_share": round(100 * share * sampled_cost / ttft, 2),
               "requests": args.requests, "prompt_tokens": args.prompt_tokens, "logs": str(base)}
    print(json.dumps(result, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
