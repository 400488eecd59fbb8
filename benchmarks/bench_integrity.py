#!/usr/bin/env python
"""What the integrity digest costs (issue 23; not a test).

    python benchmarks/bench_integrity.py [--quick] [--json PATH]

Synthetic model in vLLM's CPU layout, float16: ``--layers`` (64) KV layers of ``(num_blocks, kv_heads=2,
block_size=32, 2 * head_dim=64)``: 8 KiB per block per layer, 512 KiB per block over all layers.

1. Sums per MiB (``digest_runs``, what P and D run): whole blocks (the common case: the matrix-product path) and
   scattered runs (D after a block-size or TP mismatch: runs of one element's bytes, the byte path).
2. The question D builds from its descriptors (``verification_for``, pure Python): per descriptor.
3. Whole pulls through the connector (P: HoldService, D: PullLoop, two Mooncake engines over TCP on 127.0.0.1,
   one process) of ``--request-blocks`` sizes with integrity off, sampled (4 + 1 units) and full: median pull
   seconds, and the overhead over ``off``.
4. P's check of a sampled question (5 units) about a hold of an 80-layer model (K and V planes, 256 KiB blocks of
   128 tokens), holds of 32k and 128k tokens: the CPU of ProducerLedger.verifiable_units + query_problem per
   question, the first about a hold and the next ones (issue 45, finding 6).
5. Fairness on P's side channel (HoldService over ZMQ, real sums over ~1 GiB of KV made cheaply): an honest
   5-unit question's release round trip, and a claim's, alone and while another hold's 1 GiB question is summed
   (issue 45, item 2).

``--only check,fair`` runs the named sections (sums, question, pulls, check, fair). Sections 4 and 5 use only
APIs older releases have, so the same file run from an older checkout's ``benchmarks/`` measures "before".
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("MC_LOG_LEVEL", "ERROR")

import torch  # noqa: E402

from vllm_kvp2p.contract.protocol import RankRegistration, RemotePrefill  # noqa: E402
from vllm_kvp2p.contract.side_channel import SideChannelClient  # noqa: E402
from vllm_kvp2p.decode.pull_loop import PullLoop  # noqa: E402
from vllm_kvp2p.lifecycle.consumer import PullPlan  # noqa: E402
from vllm_kvp2p.lifecycle.integrity import IntegrityMode, verification_for  # noqa: E402
from vllm_kvp2p.lifecycle.pull import LocalKV, Outcome  # noqa: E402
from vllm_kvp2p.prefill.hold_service import HoldService  # noqa: E402
from vllm_kvp2p.testing.server import free_port  # noqa: E402
from vllm_kvp2p.transfer.descriptors import Descriptors  # noqa: E402
from vllm_kvp2p.transfer.digest import KVMemory, Runs, digest_runs, sums_of_units  # noqa: E402
from vllm_kvp2p.transfer.engine import MooncakeEngine  # noqa: E402
from vllm_kvp2p.transfer.layout import AttentionInterior, TensorView, coalesce_regions, kv_geometry  # noqa: E402

HEADS, BLOCK, HEAD = 2, 32, 32
MIB = 1 << 20


def timed(fn, reps: int) -> float:
    fn()
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def bench_sums(reps: int) -> dict[str, float]:
    flat = torch.randint(0, 256, (512 * 8192,), dtype=torch.uint8)  # 4 MiB of 8 KiB blocks
    blocks = Runs([b * 8192 for b in range(512)], [0] * 512, [8192] * 512, list(range(512)))
    whole = timed(lambda: digest_runs(flat, blocks, 512), reps)
    n = 1 << 20  # 1 MiB in 2-byte runs, scattered
    starts = torch.randperm(flat.numel() // 2)[: n // 2].mul(2).tolist()
    runs = Runs(starts, [s % 8192 for s in starts], [2] * len(starts), [s // 8192 for s in starts])
    scattered = timed(lambda: digest_runs(flat, runs, 512), max(1, reps // 2))
    return {"whole_blocks_ms_per_mib": whole * 1e3 / 4, "scattered_2B_runs_ms_per_mib": scattered * 1e3}


def bench_question(reps: int) -> dict[str, float]:
    from vllm_kvp2p.transfer.descriptors import PlaneGeometry

    planes = [PlaneGeometry(0x100000000 + i * 0x10000000, 8192, 8192, 4096) for i in range(64)]
    n = 100_000
    d = Descriptors(list(range(0, 4 * n, 4)), [planes[i % 64].base_addr + (i // 64) * 4 for i in range(n)], [4] * n)
    full = timed(lambda: verification_for(d, planes, IntegrityMode.FULL, 1), max(1, reps // 2))
    sampled = timed(lambda: verification_for(d, planes, IntegrityMode.SAMPLED, 1), max(1, reps // 2))
    return {"full_us_per_descriptor": full * 1e6 / n, "sampled_us_per_descriptor": sampled * 1e6 / n}


class Pair:
    def __init__(self, layers: int, num_blocks: int) -> None:
        self.p_kv = [torch.randn(num_blocks, HEADS, BLOCK, 2 * HEAD).half() for _ in range(layers)]
        self.d_kv = [torch.zeros(num_blocks, HEADS, BLOCK, 2 * HEAD).half() for _ in range(layers)]
        names = [f"layer.{i}" for i in range(layers)]

        def geometry(kv):
            views = [(n, [TensorView(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())])
                     for n, t in zip(names, kv)]
            planes, shapes = kv_geometry(views, num_blocks, BLOCK, HEADS, head_size=HEAD,
                                         interior=AttentionInterior.HEAD_MAJOR_KV_HALVES)
            return planes, shapes, coalesce_regions([v for _, vs in views for v in vs])

        p_planes, p_shapes, p_regions = geometry(self.p_kv)
        d_planes, d_shapes, d_regions = geometry(self.d_kv)
        self.p_engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=30)
        self.p_engine.register(p_regions)
        self.d_engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=30)
        self.d_engine.register(d_regions)
        self.port, self.engine_id = free_port(), "p-" + uuid.uuid4().hex[:6]
        reg = RankRegistration(self.engine_id, 0, 1, self.p_engine.segment, p_planes, p_shapes, names, BLOCK,
                               num_blocks, "float16", HEADS, HEADS, HEAD)
        p_memory = KVMemory(self.p_kv)
        self.holds = HoldService(reg, "127.0.0.1", self.port, hold_timeout=60, lease_timeout=60,
                                 digester=lambda q: sums_of_units(p_memory, p_planes, q))
        local = LocalKV(tuple(d_planes), tuple(d_shapes), BLOCK, tuple(names), "float16", HEADS)
        self.pulls = PullLoop(self.d_engine, reader="d:0", tp_size=1, tp_rank=0, local=local,
                              side_channel_timeout=5, claim_wait=2, max_batch_entries=1024,
                              memory=KVMemory(self.d_kv), pull_timeout=120)
        self.n = 0

    def pull(self, mode: IntegrityMode, blocks: int) -> float:
        self.pulls.integrity = mode
        self.n += 1
        rid = f"r{self.n}"
        ids = list(range(blocks))
        self.holds.hold(rid, "h", blocks, [ids])
        remote = RemotePrefill(self.engine_id, rid, "127.0.0.1", self.port, [ids], "h", blocks * BLOCK, BLOCK)
        t0 = time.perf_counter()
        self.pulls.submit(PullPlan("d-" + rid, remote, (tuple(ids),), (tuple(ids),), True))
        while True:
            results = self.pulls.take_results()
            if results:
                break
            time.sleep(0.0005)
        took = time.perf_counter() - t0
        result = results[0].result
        assert result.outcome is Outcome.PULLED, result.reason
        assert mode is IntegrityMode.OFF or result.verified_units > 0
        self.holds.take_freed()
        return took

    def close(self) -> None:
        self.pulls.close()
        self.holds.close()
        self.d_engine.close()
        self.p_engine.close()


def bench_pulls(layers: int, sizes: list[int], reps: int) -> list[dict[str, float]]:
    pair = Pair(layers, max(sizes))
    out = []
    try:
        for blocks in sizes:
            row: dict[str, float] = {"blocks": blocks, "mib": blocks * layers * HEADS * BLOCK * 2 * HEAD * 2 / MIB}
            for mode in (IntegrityMode.OFF, IntegrityMode.SAMPLED, IntegrityMode.FULL):
                pair.pull(mode, blocks)  # warm
                row[f"{mode.value}_ms"] = statistics.median(pair.pull(mode, blocks) for _ in range(reps)) * 1e3
            for mode in ("sampled", "full"):
                row[f"{mode}_overhead_pct"] = (row[f"{mode}_ms"] / row["off_ms"] - 1) * 100
            out.append(row)
            print(json.dumps(row), flush=True)
    finally:
        pair.close()
    return out


def bench_check(layers: int = 80, tokens: tuple[int, ...] = (32768, 131072), reps: int = 7) -> list[dict[str, float]]:
    """P's CPU for the check of one sampled question (5 units) about a hold, as the side channel's handler and the
    sums thread run it (the hold's units from the ledger, then the rules); blocks of 16 tokens (vLLM's CPU default)
    and 128 (Ascend's)."""
    import random

    from vllm_kvp2p.contract.protocol import DigestQuery, UnitRanges
    from vllm_kvp2p.lifecycle.integrity import query_problem
    from vllm_kvp2p.lifecycle.producer import ProducerLedger
    from vllm_kvp2p.transfer.descriptors import PlaneGeometry

    out = []
    for block_tokens, n in [(b, n) for b in (16, 128) for n in tokens]:
        unit = 8 * 128 * 2 * block_tokens  # 8 KV heads x 128 x bf16
        blocks = n // block_tokens
        planes = [PlaneGeometry((1 << 40) + i * (1 << 34), unit, unit, 2 * blocks) for i in range(2 * layers)]
        groups = (0,) * len(planes)
        ledger = ProducerLedger(600, 600)
        ledger.hold("r", "h", 0, blocks, (tuple(range(blocks)),))
        token = ledger.claim("r", "h", "d:0", 1, 0).lease_token
        rng, cpu = random.Random(1), []
        for _ in range(reps):
            query = DigestQuery([UnitRanges(rng.randrange(len(planes)), rng.randrange(blocks), [0, unit])
                                 for _ in range(5)])
            t0 = time.thread_time()
            held = ledger.verifiable_units("r", "h", "d:0", 1, token, planes, groups)
            assert held is not None and query_problem(query, planes, held) == ""
            cpu.append(time.thread_time() - t0)
        row = {"layers": layers, "block_tokens": block_tokens, "tokens": n, "first_question_cpu_ms": cpu[0] * 1e3,
               "next_question_cpu_ms": statistics.median(cpu[1:]) * 1e3}
        print(json.dumps(row), flush=True)
        out.append(row)
    return out


def bench_fair(reps: int = 3) -> dict[str, float]:
    """Round trips on P's side channel (one HoldService, real sums over ~1 GiB of KV, never written but for the honest
    blocks): an honest reader's claim, and its release asking 5 units, alone and while another hold's 1 GiB question
    is summed."""
    import zmq

    from vllm_kvp2p.contract.protocol import Claim, DigestQuery, Release, UnitRanges, encode

    layers, blocks, heads, head, block = 3, 1400, 2, 1024, 16
    unit = heads * block * 2 * head * 4  # 256 KiB
    kv = [torch.empty(blocks, heads, block, 2 * head) for _ in range(layers)]
    for t in kv:
        t[:8].normal_()
    names = [f"layer.{i}" for i in range(layers)]
    views = [(n, [TensorView(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())])
             for n, t in zip(names, kv)]
    planes, shapes = kv_geometry(views, blocks, block, heads, head_size=head,
                                 interior=AttentionInterior.HEAD_MAJOR_KV_HALVES)
    engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=30)
    engine.register(coalesce_regions([v for _, vs in views for v in vs]))
    port = free_port()
    reg = RankRegistration("p-" + uuid.uuid4().hex[:6], 0, 1, engine.segment, planes, shapes, names, block, blocks,
                           "float32", heads, heads, head)
    memory = KVMemory(kv)
    holds = HoldService(reg, "127.0.0.1", port, hold_timeout=600, lease_timeout=600,
                        digester=lambda q: sums_of_units(memory, planes, q))
    client = SideChannelClient(30.0)
    hostile = list(range(16, 16 + 1366))
    big = [UnitRanges(p, b, [0, unit]) for b in hostile for p in range(layers)][:4096]
    n = 0

    def honest() -> tuple[float, float]:
        nonlocal n
        n += 1
        rid = f"honest-{n}"
        holds.hold(rid, "h", 2, [[0, 1]])
        t0 = time.perf_counter()
        granted = client.request("127.0.0.1", port, Claim(rid, "h", "d:0", 1, "c" + rid))
        t1 = time.perf_counter()
        question = DigestQuery([UnitRanges(p, b, [0, unit]) for p, b in ((0, 0), (1, 0), (2, 0), (0, 1), (2, 1))])
        answer = client.request("127.0.0.1", port, Release(rid, "h", "d:0", 1, True, granted.lease_token, question))
        t2 = time.perf_counter()
        assert answer.sums, answer
        return t1 - t0, t2 - t1

    out: dict[str, list[float]] = {"claim_alone": [], "release_alone": [], "claim_busy": [], "release_busy": []}
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    try:
        for _ in range(reps):
            claim, release = honest()
            out["claim_alone"].append(claim)
            out["release_alone"].append(release)
        for i in range(reps):
            rid = f"hostile-{i}"
            holds.hold(rid, "h", len(hostile), [hostile])
            token = client.request("127.0.0.1", port, Claim(rid, "h", "x:0", 1, "c" + rid)).lease_token
            sock.send_multipart([b"", encode(Release(rid, "h", "x:0", 1, True, token, DigestQuery(big)))])
            time.sleep(0.2)  # its sums under way
            claim, release = honest()
            out["claim_busy"].append(claim)
            out["release_busy"].append(release)
            sock.recv_multipart()  # its answer: the 1 GiB summed (or answered without sums)
    finally:
        sock.close()
        client.close()
        holds.close()
        engine.close()
    row = {f"{k}_ms": statistics.median(v) * 1e3 for k, v in out.items()}
    print(json.dumps(row), flush=True)
    return row


SECTIONS = ("sums", "question", "pulls", "check", "fair")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--only", default=",".join(SECTIONS), help=f"sections, comma-separated: {', '.join(SECTIONS)}")
    args = ap.parse_args()
    reps = 3 if args.quick else 7
    only = set(args.only.split(","))
    torch.set_num_threads(1)
    runs = {
        "sums": lambda: bench_sums(reps),
        "question": lambda: bench_question(reps),
        "pulls": lambda: bench_pulls(args.layers, [16, 64, 256] if args.quick else [16, 64, 256, 1024], reps),
        "check": lambda: bench_check(reps=reps),
        "fair": lambda: bench_fair(3),
    }
    result = {"machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()}}
    result.update({name: run() for name, run in runs.items() if name in only})
    print(json.dumps({k: v for k, v in result.items() if k != "pulls"}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
