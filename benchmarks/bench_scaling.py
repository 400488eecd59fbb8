#!/usr/bin/env python
"""Pull time against blocks and layers, next to raw Mooncake and an in-process copy (not a test).

    python benchmarks/bench_scaling.py [--blocks 1 4 16 64 256 1024 4096] [--layers 64]
                                       [--layer-sweep 4 16 64 128] [--reps 5] [--json out.json] [--png out.png]

The geometry, the P process and the verified pull cases are bench_transfer.py's (vLLM's CPU layout, float16,
8 KiB per block per layer at the defaults; P in a spawned process with its own Mooncake engine and HoldService,
D here; TCP over 127.0.0.1). For each request size (contiguous block ids on both sides, so runs merge to one
descriptor per plane), median of ``--reps``:

- **connector**: the whole D path (``PullLoop``: cached registration, claim, reads, release with P's confirmation),
  timed from ``submit`` to the result, every pull checked against P's bytes on sampled blocks;
- **raw Mooncake**: one ``batch_transfer_sync_read`` with one descriptor per plane (the transport's ceiling);
- **memcpy**: ``torch`` copying the same bytes between two tensors of this process (the physical limit here: both
  ends of the TCP pull share this machine's memory bandwidth too).

``--layer-sweep`` repeats a 64-block request for other layer counts (planes = layers: K and V packed).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench_transfer as bt  # noqa: E402  (the geometry, P process and verified pull cases)


def memcpy_ms(nbytes: int, reps: int) -> float:
    import torch

    src = torch.ones(nbytes, dtype=torch.uint8)
    dst = torch.empty_like(src)
    dst.copy_(src)  # touch
    times = []
    for _ in range(reps):
        t0 = time.perf_counter()
        dst.copy_(src)
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def sweep(layers: int, blocks: list[int], reps: int, sample: int) -> list[dict[str, Any]]:
    import random

    from vllm_kvp2p.transfer.engine import MooncakeEngine

    most = max(blocks)
    g = {"layers": layers, "kv_heads": 2, "head_dim": 32, "block_size": 32, "num_blocks": most + 8,
         "request_blocks": most}
    g["block_bytes"] = bt._block_bytes(g)
    tensors, keep, region, _how = bt._alloc_arena(g)
    for t in tensors:
        t.zero_()
    engine = MooncakeEngine(bt.HOST, "tcp", transfer_timeout=30)
    engine.register([region])
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=bt.p_main, args=(child, g), name="bench-P", daemon=True)
    proc.start()
    child.close()
    rows = []
    puller = None
    try:
        if not parent.poll(300):
            raise TimeoutError("P process did not come up in 300 s")
        p_info = parent.recv()
        # A sample can only pick among layers x blocks distinct pairs (the 1-block warm-up: the layers).
        puller = bt.Puller(g, engine, region, tensors, p_info, parent, random.Random(0), min(sample, layers))
        puller.descriptor_reads([0], [0])  # warm-up: handshake and lanes, then the registration fetch
        puller.connector([1], [1], check=False)
        for n in blocks:
            lids, rids = list(range(n)), list(range(g["num_blocks"] - n, g["num_blocks"]))
            nbytes = n * layers * g["block_bytes"]
            conn, raw = [], []
            for _ in range(reps):  # interleaved
                conn.append(puller.connector(lids, rids)["total_ms"])
                raw.append(puller.raw_ceiling(lids, rids)["total_ms"])
            row = {"layers": layers, "blocks": n, "bytes": nbytes, "connector_ms": statistics.median(conn),
                   "raw_ms": statistics.median(raw), "memcpy_ms": memcpy_ms(nbytes, reps)}
            row["connector_gb_s"] = nbytes / row["connector_ms"] / 1e6
            row["raw_gb_s"] = nbytes / row["raw_ms"] / 1e6
            row["memcpy_gb_s"] = nbytes / row["memcpy_ms"] / 1e6
            row["connector_over_raw_ms"] = row["connector_ms"] - row["raw_ms"]
            rows.append(row)
            print(f"layers {layers:4d} blocks {n:5d} {nbytes / 2**20:9.2f} MiB: connector {row['connector_ms']:8.2f} ms"
                  f"  raw {row['raw_ms']:8.2f} ms  memcpy {row['memcpy_ms']:7.2f} ms", file=sys.stderr, flush=True)
    finally:
        if puller is not None:
            puller.close()
        bt.stop_p_process(parent, proc)
        engine.close()
        del tensors, keep
    return rows


def plot(rows: list[dict[str, Any]], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for key, label in (("connector_ms", "connector (claim, read, release)"), ("raw_ms", "raw Mooncake read"),
                       ("memcpy_ms", "memcpy, same bytes")):
        ax.loglog([r["bytes"] / 2**20 for r in rows], [r[key] for r in rows], "o-", label=label)
    ax.set_xlabel("MiB per pull")
    ax.set_ylabel("ms")
    ax.set_title(f"Pull time, {rows[0]['layers']} layers, TCP over 127.0.0.1, 2 cores")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--blocks", type=int, nargs="+", default=[1, 4, 16, 64, 256, 1024, 4096])
    parser.add_argument("--layers", type=int, default=64)
    parser.add_argument("--layer-sweep", type=int, nargs="*", default=[4, 16, 64, 128],
                        help="layer counts for a 64-block request (none: skip)")
    parser.add_argument("--reps", type=int, default=5)
    parser.add_argument("--sample", type=int, default=16, help="blocks verified per connector pull")
    parser.add_argument("--json", default=None)
    parser.add_argument("--png", default=None, help="plot of the blocks sweep (needs matplotlib)")
    args = parser.parse_args()
    bt._mc_env()
    result: dict[str, Any] = {"cpus": os.cpu_count(), "blocks_sweep": sweep(args.layers, args.blocks, args.reps,
                                                                          args.sample)}
    result["layers_sweep"] = [r for n in args.layer_sweep for r in sweep(n, [64], args.reps, args.sample)]
    for title, rows in (("blocks", result["blocks_sweep"]), ("layers (64 blocks)", result["layers_sweep"])):
        print(f"\nby {title}:\n| layers | blocks | MiB | connector ms | raw Mooncake ms | memcpy ms | connector GB/s |"
              f" raw GB/s | memcpy GB/s |\n|---|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['layers']} | {r['blocks']} | {r['bytes'] / 2**20:.2f} | {r['connector_ms']:.2f} | "
                  f"{r['raw_ms']:.2f} | {r['memcpy_ms']:.3f} | {r['connector_gb_s']:.2f} | {r['raw_gb_s']:.2f} | "
                  f"{r['memcpy_gb_s']:.1f} |")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    if args.png:
        plot(result["blocks_sweep"], args.png)


if __name__ == "__main__":
    main()
