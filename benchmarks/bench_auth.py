#!/usr/bin/env python
"""What the shared secret costs per message (not a test).

    python benchmarks/bench_auth.py [--reps 20000] [--json out.json]

Times, in this process, each operation the secret adds (vllm_kvp2p/contract/auth.py): P signing the kv_transfer_params
of
one finished prompt and D checking them (done again at every scheduler admission call), and sealing and opening a
side-channel request (a claim) and a reply (a claim reply, and a registration of a 64-layer model, the largest
message). Also the round trip of a claim over a real ZMQ side channel on 127.0.0.1 with and without the secret.
Prints a table (microseconds per operation, median of 5 runs) and optionally writes JSON.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.auth import Authenticator, ReplayGuard
from vllm_kvp2p.contract.protocol import Claim, ClaimReply, ClaimStatus, RankRegistration, Registration, RemotePrefill
from vllm_kvp2p.contract.side_channel import SideChannelClient
from vllm_kvp2p.prefill.hold_service import HoldService
from vllm_kvp2p.testing.server import free_port
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape

SECRET = b"benchmark-secret-0123456789abcdef"


def per_op_us(fn: Callable[[], object], reps: int) -> float:
    runs = []
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        runs.append((time.perf_counter() - t0) / reps * 1e6)
    return statistics.median(runs)


def registration(layers: int) -> RankRegistration:
    planes = [PlaneGeometry(1 << 30 | i << 24, 65536, 65536, 4096) for i in range(2 * layers)]
    shapes = [BlockShape(True, 8, 128, 256)] * (2 * layers)
    return RankRegistration("prefill-0", 0, 8, "10.0.0.7:16001", planes, shapes,
                            [f"model.layers.{i}.self_attn" for i in range(layers)], 128, 4096, "bfloat16", 1, 8, 128,
                            incarnation="0123456789abcdef", model_fingerprint="fedcba9876543210")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--reps", type=int, default=20000)
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    auth = Authenticator(SECRET, 30)
    now = time.time_ns() // 1_000_000
    remote = RemotePrefill("prefill-0", "cmpl-3f1c-0", "10.0.0.7", 14600, [list(range(100, 164))], "a" * 32, 8192,
                           128, tp_size=8, remote_incarnation="0123456789abcdef")
    signed = auth.sign_params(remote, now + 120_000)
    claim = protocol.encode(Claim("cmpl-3f1c-0", "a" * 32, "decode-0:3", 1, "b" * 32))
    reply = protocol.encode(ClaimReply(ClaimStatus.GRANTED, 60.0, lease_token="c" * 32))
    big = protocol.encode(Registration(registration(64)))
    sealed_claim, nonce = auth.seal_request(claim, now)
    sealed_reply = auth.seal_reply(reply, nonce, now)
    sealed_big = auth.seal_reply(big, nonce, now)

    def open_claim() -> None:
        auth.open_request(sealed_claim, now, ReplayGuard(60_000))  # a fresh guard: the same frame every time

    rows = [
        ("sign params (P, per finished prompt)", per_op_us(lambda: auth.sign_params(remote, now), args.reps), 0),
        ("check params (D, per admission call)", per_op_us(lambda: auth.params_problem(signed, now), args.reps), 0),
        ("seal claim request", per_op_us(lambda: auth.seal_request(claim, now), args.reps), len(claim)),
        ("open claim request (+ replay check)", per_op_us(open_claim, args.reps), len(claim)),
        ("seal claim reply", per_op_us(lambda: auth.seal_reply(reply, nonce, now), args.reps), len(reply)),
        ("open claim reply", per_op_us(lambda: auth.open_reply(sealed_reply, nonce, now), args.reps), len(reply)),
        ("seal registration, 64 layers", per_op_us(lambda: auth.seal_reply(big, nonce, now), args.reps // 10),
         len(big)),
        ("open registration, 64 layers", per_op_us(lambda: auth.open_reply(sealed_big, nonce, now),
                                                   args.reps // 10), len(big)),
    ]
    for label, with_auth in (("claim round trip over ZMQ, no secret", None), ("claim round trip over ZMQ, secret",
                                                                             Authenticator(SECRET, 30))):
        port = free_port()
        service = HoldService(registration(2), "127.0.0.1", port, hold_timeout=600, lease_timeout=600, auth=with_auth)
        client = SideChannelClient(5.0, auth=with_auth)
        service.hold("r", "h")
        counter = iter(range(10**9))
        try:
            rows.append((label, per_op_us(
                lambda client=client, port=port, counter=counter: client.request(
                    "127.0.0.1", port, Claim("r", "h", f"d:{next(counter)}", 1)),
                max(50, args.reps // 100)), len(claim)))
        finally:
            client.close()
            service.close()
    print(f"{'operation':44} {'bytes':>8} {'us/op':>9}")
    for label, us, size in rows:
        print(f"{label:44} {size:>8} {us:>9.2f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([{"operation": label, "bytes": size, "us_per_op": round(us, 3)} for label, us, size in rows],
                      f, indent=2)


if __name__ == "__main__":
    main()
