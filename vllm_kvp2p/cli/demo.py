"""``vllm-kvp2p-demo``: the main job on one machine.

Makes a tiny Llama-architecture model locally (no model hub needed), starts a prefill and a decode ``vllm serve``
with ``MooncakeP2PConnector`` and the P/D proxy on 127.0.0.1 (both engines with ``VLLM_KVP2P_HOST=127.0.0.1``,
set by :class:`~vllm_kvp2p.testing.server.VllmServer`), sends a few prompts through the proxy, prints each
answer with what D pulled from P (blocks, bytes, time) and whether it is right: the integrity verdict of the
pull (D runs ``integrity=full``: every pulled block's bytes checked against P's) and whether D's answer equals
the one a single ordinary instance gives (computed on P as a plain request). Then the connector's metrics,
a check that P holds no KV blocks any more, and a clean shutdown. Exits non-zero when anything is wrong.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from vllm_kvp2p.testing.cluster import PDCluster
from vllm_kvp2p.testing.tiny_model import make_tiny_llama

PROMPTS = [
    "The quick brown fox",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who " * 3,
    "Disaggregated serving splits prefill and decode across machines. " * 12,
]


def _post(url: str, body: dict) -> tuple[dict, float]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    t0 = time.perf_counter()
    with urllib.request.urlopen(req, timeout=300) as resp:
        out = json.loads(resp.read())
    return out, time.perf_counter() - t0


LOGPROB_TOL = 1e-3  # float32 noise between a one-shot prefill and D's decode from pulled KV (tests: 1e-4)
METRICS = (("D", "vllm:kvp2p_pulls_verified_total", "pulls verified"),
           ("D", "vllm:kvp2p_pull_failures_total", "pulls failed"),
           ("P", "vllm:kvp2p_holds_created_total", "holds created"),
           ("P", "vllm:kvp2p_holds_released_total", "holds released by D"),
           ("P", "vllm:kvp2p_holds_expired_total", "holds expired"))


def _verdict(pull: dict) -> str:
    if pull.get("failure") == "corrupted":
        return "CORRUPTED (D recomputed the prompt)"
    if pull.get("sums_lost"):
        return "sums lost (P's digests did not reach D: a resent release, docs/reliability.md)"
    if pull.get("unverified"):
        return "unverified (P sent no digests)"
    if pull.get("verified"):
        return f"verified: {pull['verified']} block-layers equal to P's"
    return "not checked"


def _same_answer(a: dict, b: dict) -> tuple[bool, float]:
    la, lb = a["choices"][0]["logprobs"], b["choices"][0]["logprobs"]
    if la["tokens"] != lb["tokens"]:
        return False, float("inf")
    gap = max((abs(x - y) for x, y in zip(la["token_logprobs"], lb["token_logprobs"])), default=0.0)
    return gap <= LOGPROB_TOL, gap


def run(model_dir: Path, log_dir: Path, max_tokens: int) -> int:
    print(f"[demo] model: {model_dir}")
    print(f"[demo] logs:  {log_dir}")
    t0 = time.perf_counter()
    wrong = 0
    with PDCluster(model_dir, log_dir, decode_extra_config={"integrity": "full"}) as cluster:
        print(f"[demo] P {cluster.prefill.url}, D {cluster.decode.url}, proxy {cluster.proxy_url} "
              f"up in {time.perf_counter() - t0:.0f} s")
        total_bytes = 0
        for i, prompt in enumerate(PROMPTS, 1):
            body = {"model": cluster.prefill.model_name, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0,
                    "logprobs": 1}
            out, seconds = _post(cluster.proxy_url + "/v1/completions", body)
            single, _ = _post(cluster.prefill.url + "/v1/completions", {**body, "cache_salt": "single-instance"})
            pull = (out.get("kv_transfer_params") or {}).get("kvp2p_pull", {})
            prompt_tokens = out["usage"]["prompt_tokens"]
            print(f"\n[{i}] prompt ({prompt_tokens} tokens): {prompt[:70]!r}{'...' if len(prompt) > 70 else ''}")
            print(f"    answer: {out['choices'][0]['text']!r}")
            if not pull.get("ok"):
                print(f"    D did NOT pull the prompt's KV: {pull or 'no transfer report'}")
                return 1
            mb = pull["bytes"] / 1e6
            rate = mb / pull["seconds"] if pull["seconds"] else float("inf")
            print(f"    D pulled {pull['blocks']} blocks = {pull['bytes']} bytes from P "
                  f"in {pull['seconds'] * 1e3:.1f} ms "
                  f"({rate:.0f} MB/s, {pull['descriptors']} Mooncake descriptors); end to end {seconds:.2f} s")
            same, gap = _same_answer(out, single)
            print(f"    integrity: {_verdict(pull)}")
            print(f"    equals a single instance's answer: {'yes' if same else 'NO'} "
                  f"(tokens {'equal' if gap != float('inf') else 'differ'}, largest logprob gap {gap:.1e})")
            wrong += (not same) + (not pull.get("verified"))
            total_bytes += pull["bytes"]
        deadline = time.monotonic() + 30
        usage = cluster.prefill.metric("vllm:kv_cache_usage_perc")
        while usage > 0 and time.monotonic() < deadline:
            time.sleep(0.2)
            usage = cluster.prefill.metric("vllm:kv_cache_usage_perc")
        print(f"\n[demo] D pulled {total_bytes} bytes in all; P KV-cache usage now {usage:.1%} "
              f"({'no blocks held' if usage == 0 else 'BLOCKS STILL HELD'})")
        print("[demo] connector metrics: " + ", ".join(
            f"{what} {(cluster.decode if side == 'D' else cluster.prefill).metric(name):.0f}"
            for side, name, what in METRICS))
        print("[demo] shutting down")
    print(f"[demo] done: {'every answer right and every pull verified' if not wrong else f'{wrong} problem(s) above'}")
    return 0 if usage == 0 and not wrong else 1


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="vllm-kvp2p-demo", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    cache = Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "vllm_kvp2p"
    parser.add_argument("--model-dir", type=Path, default=cache / "tiny-llama",
                        help="where to make (or reuse) the tiny model (default: %(default)s)")
    parser.add_argument("--log-dir", type=Path, default=None, help="engine and proxy logs (default: a temp dir)")
    parser.add_argument("--max-tokens", type=int, default=24)
    args = parser.parse_args(argv)
    log_dir = args.log_dir or Path(tempfile.mkdtemp(prefix="vllm-kvp2p-demo-"))
    model_dir = make_tiny_llama(args.model_dir)
    sys.exit(run(model_dir, log_dir, args.max_tokens))


if __name__ == "__main__":
    main()
