#!/usr/bin/env python
"""Concurrent pulls into one D worker, from several P instances and from one, next to raw Mooncake (not a test).

    python benchmarks/bench_concurrent.py [--producers 3] [--blocks 4 64] [--reps 5] [--json out.json]

Up to ``--producers`` P processes (bench_transfer.py's: each its own Mooncake engine, a HoldService on its own side
channel, random KV in vLLM's CPU layout, 64 layers x 8 KiB per block) and D here (one arena registered once, one
``PullLoop`` with its default 4 pull threads, as a D worker has). For each request size and concurrency k:

- **k P instances, one pull each**: k plans submitted at once, each naming another P (each P gets its own lane);
- **one P, k pulls**: k plans for one P submitted at once (one lane per P instance, so they run one after another,
  as designed: P's ranks see one reader at a time);
- **raw Mooncake, k segments**: k threads each reading the same bytes from another P with one
  ``batch_transfer_sync_read`` (one descriptor per plane), the transport's ceiling at that concurrency;
- **raw Mooncake, one segment**: k threads reading from one P at once.

Reported: per-pull latency (median over pulls and reps) and aggregate GB/s (all bytes / wall time of the batch).
Every connector pull's bytes are checked against P on sampled blocks.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import statistics
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_transfer as bt  # noqa: E402  (geometry, P process)

P_BLOCKS = 200  # blocks per P side (3 pulls of 64 from one P)


class Producer:
    def __init__(self, g: dict[str, int]) -> None:
        ctx = mp.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=bt.p_main, args=(child, g), name="bench-P", daemon=True)
        self.proc.start()
        child.close()
        if not self.conn.poll(300):
            raise TimeoutError("P process did not come up in 300 s")
        self.info = self.conn.recv()
        from vllm_kvp2p.transfer.descriptors import PlaneGeometry

        self.planes = [PlaneGeometry(*p) for p in self.info["planes"]]

    def call(self, op: str, arg: Any = None) -> Any:
        self.conn.send((op, arg))
        if not self.conn.poll(60):
            raise TimeoutError(f"P did not answer {op!r}")
        return self.conn.recv()

    def stop(self) -> None:
        bt.stop_p_process(self.conn, self.proc)


class Consumer:
    def __init__(self, g: dict[str, int], d_blocks: int) -> None:
        from vllm_kvp2p.decode.pull_loop import PullLoop
        from vllm_kvp2p.lifecycle.pull import LocalKV
        from vllm_kvp2p.transfer.engine import MooncakeEngine
        from vllm_kvp2p.transfer.layout import AttentionInterior, kv_geometry

        self.g = {**g, "num_blocks": d_blocks}
        self.tensors, self.keep, region, _ = bt._alloc_arena(self.g)
        for t in self.tensors:
            t.zero_()
        self.engine = MooncakeEngine(bt.HOST, "tcp", transfer_timeout=30)
        self.engine.register([region])
        layers = bt._views(self.tensors)
        planes, shapes = kv_geometry(layers, d_blocks, g["block_size"], g["kv_heads"], head_size=g["head_dim"],
                                     interior=AttentionInterior.HEAD_MAJOR_KV_HALVES)
        self.planes = planes
        local = LocalKV(tuple(planes), tuple(shapes), g["block_size"], tuple(n for n, _ in layers), "float16",
                        g["kv_heads"])
        self.loop = PullLoop(self.engine, reader="bench-d:0", tp_size=1, tp_rank=0, local=local,
                             side_channel_timeout=10, claim_wait=5, max_batch_entries=bt.MAX_ENTRIES)

    def close(self) -> None:
        self.loop.close()
        self.engine.close()


def connector_batch(d: Consumer, jobs: list[tuple[Producer, list[int], list[int]]], rng: random.Random) -> tuple[
        list[float], float]:
    """Submit every job at once; per-pull seconds (submit -> result) and the batch's wall time."""
    import torch

    from vllm_kvp2p.contract.protocol import RemotePrefill
    from vllm_kvp2p.lifecycle.consumer import PullPlan
    from vllm_kvp2p.lifecycle.pull import Outcome

    g = d.g
    plans, checks = [], []
    for p, lids, rids in jobs:
        req, hold = "req-" + uuid.uuid4().hex[:8], "hold-" + uuid.uuid4().hex[:6]
        picks = sorted({(rng.randrange(g["layers"]), rng.randrange(len(lids))) for _ in range(8)})
        expected = p.call("sample", [(layer, rids[i]) for layer, i in picks])
        for layer, i in picks:
            d.tensors[layer][lids[i]].view(torch.int16).fill_(-1)
        checks.append((lids, picks, expected))
        p.call("hold", (req, hold))
        remote = RemotePrefill(p.info["engine_id"], req, bt.HOST, p.info["port"], [list(rids)], hold,
                               len(rids) * g["block_size"], g["block_size"])
        plans.append(PullPlan("d-" + req, remote, (tuple(lids),), (tuple(rids),), True))
    t0 = time.perf_counter()
    for plan in plans:
        d.loop.submit(plan)
    done: list[Any] = []
    deadline = time.monotonic() + 120
    while len(done) < len(plans) and time.monotonic() < deadline:
        got = d.loop.take_results()
        done += got
        if not got:
            time.sleep(0.0002)
    wall = time.perf_counter() - t0
    if len(done) < len(plans):
        raise TimeoutError("pulls did not finish in 120 s")
    for r in done:
        if r.result.outcome is not Outcome.PULLED:
            raise RuntimeError(f"pull failed: {r.result.reason}")
    for lids, picks, expected in checks:
        for (layer, i), want in zip(picks, expected):
            got = d.tensors[layer][lids[i]].view(torch.int16)
            if not torch.equal(got, torch.frombuffer(bytearray(want), dtype=torch.int16).view(got.shape)):
                raise AssertionError("pulled bytes differ from P's")
    return [r.seconds for r in done], wall


def raw_batch(d: Consumer, jobs: list[tuple[Producer, list[int], list[int]]]) -> tuple[list[float], float]:
    """One thread per job, each one batch_transfer_sync_read (one descriptor per plane), started together."""
    bb = bt._block_bytes(d.g)
    times: list[float] = [0.0] * len(jobs)
    barrier = threading.Barrier(len(jobs) + 1)

    def read(i: int, p: Producer, lids: list[int], rids: list[int]) -> None:
        la = [pl.base_addr + lids[0] * pl.block_stride for pl in d.planes]
        ra = [pl.base_addr + rids[0] * pl.block_stride for pl in p.planes]
        ln = [len(lids) * bb] * len(la)
        barrier.wait()
        t0 = time.perf_counter()
        rc = d.engine._engine.batch_transfer_sync_read(p.info["segment"], la, ra, ln)
        times[i] = time.perf_counter() - t0
        if rc != 0:
            raise RuntimeError(f"raw read returned {rc}")

    threads = [threading.Thread(target=read, args=(i, *job)) for i, job in enumerate(jobs)]
    for t in threads:
        t.start()
    barrier.wait()
    t0 = time.perf_counter()
    for t in threads:
        t.join()
    return times, time.perf_counter() - t0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--producers", type=int, default=3)
    parser.add_argument("--blocks", type=int, nargs="+", default=[4, 64])
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    bt._mc_env()
    g = {"layers": 64, "kv_heads": 2, "head_dim": 32, "block_size": 32, "num_blocks": P_BLOCKS,
         "request_blocks": max(args.blocks)}
    if max(args.blocks) * args.producers > P_BLOCKS:
        parser.error(f"--blocks x --producers must fit in {P_BLOCKS} blocks")
    rng = random.Random(args.seed)
    producers: list[Producer] = []
    d: Consumer | None = None
    rows = []
    try:
        producers = [Producer(g) for _ in range(args.producers)]
        d = Consumer(g, max(args.blocks) * args.producers + 8)
        for p in producers:  # warm-up: handshake, lanes, registration fetch
            raw_batch(d, [(p, [0], [0])])
            connector_batch(d, [(p, [1], [1])], rng)
        for n in args.blocks:
            for k in range(1, args.producers + 1):
                def spread(k: int = k, n: int = n) -> list[tuple[Producer, list[int], list[int]]]:
                    return [(producers[j], list(range(j * n, (j + 1) * n)), list(range(j * n, (j + 1) * n)))
                            for j in range(k)]

                def one_p(k: int = k, n: int = n) -> list[tuple[Producer, list[int], list[int]]]:
                    return [(producers[0], list(range(j * n, (j + 1) * n)), list(range(j * n, (j + 1) * n)))
                            for j in range(k)]

                cases = {"connector, k P instances": lambda: connector_batch(d, spread(), rng),
                         "connector, one P": lambda: connector_batch(d, one_p(), rng),
                         "raw Mooncake, k segments": lambda: raw_batch(d, spread()),
                         "raw Mooncake, one segment": lambda: raw_batch(d, one_p())}
                samples: dict[str, list[tuple[list[float], float]]] = {c: [] for c in cases}
                for _ in range(args.reps):  # interleaved
                    for name, fn in cases.items():
                        samples[name].append(fn())
                nbytes = k * n * g["layers"] * bt._block_bytes(g)
                for name, runs in samples.items():
                    per_pull = statistics.median(t for per, _ in runs for t in per)
                    wall = statistics.median(w for _, w in runs)
                    rows.append({"case": name, "blocks": n, "k": k, "bytes": nbytes, "per_pull_ms": per_pull * 1e3,
                                 "wall_ms": wall * 1e3, "gb_s": nbytes / wall / 1e9})
                    print(f"blocks {n:4d} k {k} {name:28s} per pull {per_pull * 1e3:7.2f} ms  batch {wall * 1e3:7.2f}"
                          f" ms  {nbytes / wall / 1e9:5.2f} GB/s", file=sys.stderr, flush=True)
    finally:
        if d is not None:
            d.close()
        for p in producers:
            p.stop()
    print("| blocks per pull | k | case | per pull ms | batch ms | aggregate GB/s | vs raw at the same k |")
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ref_case = "raw Mooncake, k segments" if "k P" in r["case"] or "k seg" in r["case"] else \
            "raw Mooncake, one segment"
        ref = next(x for x in rows if x["case"] == ref_case and x["blocks"] == r["blocks"] and x["k"] == r["k"])
        print(f"| {r['blocks']} | {r['k']} | {r['case']} | {r['per_pull_ms']:.2f} | {r['wall_ms']:.2f} | "
              f"{r['gb_s']:.2f} | {r['gb_s'] / ref['gb_s']:.0%} |")
    if args.json:
        Path(args.json).write_text(json.dumps({"cpus": os.cpu_count(), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
