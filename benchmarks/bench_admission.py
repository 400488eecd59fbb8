#!/usr/bin/env python
"""What D's one verdict on kv_transfer_params costs per admission (not a test).

    python benchmarks/bench_admission.py [--reps 2000] [--json out.json]

Times, in this process, ``vllm_kvp2p.lifecycle.admission.judge`` on genuine params for prompts of 300, 8,192 and
32,768 tokens (block size 16), without and with the shared secret, and the part of it that binds the params to
the prompt (``prompt_digest`` of the prompt's tokens, which P also computes once per finished prefill). Prints a
table (microseconds per call, median of 5 runs) and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle.admission import Admitted, Decoder, Prompt, judge
from vllm_kvp2p.transfer.kv_groups import single_full_group

SECRET = b"benchmark-secret-0123456789abcdef"
BLOCK = 16
NOW_MS = 1_800_000_000_000

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_auth import per_op_us as per_call_us  # noqa: E402  (median of 5 runs, microseconds per call)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--reps", type=int, default=2000)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    auth = Authenticator(SECRET, 30.0)
    decoder = Decoder(BLOCK, single_full_group(BLOCK))
    rows = []
    for n in (300, 8192, 32768):
        tokens = [(i * 7919) % 150_000 for i in range(n)]
        prompt = Prompt(n, lambda k, tokens=tokens: prompt_digest(tokens[:k]))
        blocks = -(-n // BLOCK)
        remote = RemotePrefill("prefill-0", "cmpl-3f1c-0", "10.0.0.7", 14600, [list(range(1, blocks + 1))],
                               "a" * 32, n, BLOCK, remote_prompt_digest=prompt_digest(tokens))
        plain = remote.to_params()
        signed = auth.sign_params(remote, NOW_MS + 60_000).to_params()
        assert isinstance(judge(plain, prompt, decoder), Admitted)
        assert isinstance(judge(signed, prompt, decoder, lambda r: auth.params_problem(r, NOW_MS)), Admitted)
        reps = max(20, args.reps * 300 // n)
        row = {
            "prompt_tokens": n,
            "digest_us": per_call_us(lambda tokens=tokens: prompt_digest(tokens), reps),
            "verdict_us": per_call_us(lambda p=plain, q=prompt: judge(p, q, decoder), reps),
            "verdict_with_secret_us": per_call_us(
                lambda p=signed, q=prompt: judge(p, q, decoder, lambda r: auth.params_problem(r, NOW_MS)), reps),
        }
        rows.append(row)
    print(f"{'prompt tokens':>14} {'digest':>10} {'verdict':>10} {'+ secret':>10}   (microseconds per call)")
    for r in rows:
        print(f"{r['prompt_tokens']:>14} {r['digest_us']:>10.1f} {r['verdict_us']:>10.1f} "
              f"{r['verdict_with_secret_us']:>10.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"block_size": BLOCK, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
