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

from vllm_kvp2p.hold_service import HoldService  # noqa: E402
from vllm_kvp2p.lifecycle.consumer import PullPlan  # noqa: E402
from vllm_kvp2p.lifecycle.integrity import IntegrityMode, verification_for  # noqa: E402
from vllm_kvp2p.lifecycle.pull import LocalKV, Outcome  # noqa: E402
from vllm_kvp2p.protocol import RankRegistration, RemotePrefill  # noqa: E402
from vllm_kvp2p.pull_loop import PullLoop  # noqa: E402
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


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--json", metavar="PATH")
    ap.add_argument("--layers", type=int, default=64)
    args = ap.parse_args()
    reps = 3 if args.quick else 7
    torch.set_num_threads(1)
    result = {
        "machine": {"cpus": os.cpu_count(), "torch": torch.__version__, "torch_threads": torch.get_num_threads()},
        "sums": bench_sums(reps),
        "question": bench_question(reps),
        "pulls": bench_pulls(args.layers, [16, 64, 256] if args.quick else [16, 64, 256, 1024], reps),
    }
    print(json.dumps({k: result[k] for k in ("machine", "sums", "question")}, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
