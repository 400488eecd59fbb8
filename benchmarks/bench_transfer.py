#!/usr/bin/env python
"""Transfer benchmark for vllm_kvp2p: registration, descriptor building, pulled throughput (not a test).

    python benchmarks/bench_transfer.py [--quick] [--json PATH]

Synthetic model: ``--layers`` (64) KV layers in vLLM's CPU layout, one tensor per layer of shape
``(num_blocks, kv_heads, block_size, 2 * head_dim)`` (K and V packed in the last dimension), float16.
Defaults: kv_heads=2, block_size=32, head_dim=32 -> 8 KiB per block per layer, 512 KiB per block over all
layers, 512 MiB for a 1024-block request; 1280 blocks per side (640 MiB of KV per side).

Sections (all numbers are from this run; medians over repetitions):

1. Registration: Mooncake regions and ``batch_register_memory`` time for (a) one separately allocated tensor
   per layer (vLLM's default) registered per tensor, and the region count ``coalesce_regions`` makes of them;
   (b) all layer tensors inside one arena registered as one region (``vllm_kvp2p.platform.arena.KvArena`` when that
   module exists and is AVAILABLE, else views carved out of one big torch tensor).
1b. Region-count scaling (``--region-counts``): registration time of N small disjoint regions and the time a
   fresh peer's first read takes (it opens the segment, whose descriptor lists every region), next to a warm read.
2. Descriptor build for a 1024-block request over all planes: C++ (``vllm_kvp2p.transfer.native.build_descriptors``) vs
   Python (``build_descriptors_py``), contiguous ids (runs merge) and scattered ids; outputs must be identical.
3. Pulls of a 1024-block request between two Mooncake engines (TCP, 127.0.0.1), P in a spawned process:
   raw ``batch_transfer_sync_read`` with one descriptor per plane (the ceiling); the connector's descriptors with
   run merging (contiguous ids) and without (scattered ids), read in batches of <= 1024 entries; and the whole
   connector path (P: HoldService, D: PullLoop; registration (cached), claim, reads, release). Every pull is
   checked against P's bytes on a sample of blocks that were poisoned on D before the pull.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import platform
import random
import signal
import statistics
import sys
import time
import uuid
from typing import Any

HOST = "127.0.0.1"
MAX_ENTRIES = 1024  # per-peer in-flight cap (reference doc: > ~2048 fails and can break the peer)


# --------------------------------------------------------------------------- shared helpers


def _mc_env() -> None:
    os.environ.setdefault("MC_LOG_LEVEL", "ERROR")


def _shape(g: dict[str, int]) -> tuple[int, int, int, int]:
    return (g["num_blocks"], g["kv_heads"], g["block_size"], 2 * g["head_dim"])


def _block_bytes(g: dict[str, int]) -> int:
    return g["kv_heads"] * g["block_size"] * 2 * g["head_dim"] * 2  # float16


def _alloc_separate(g: dict[str, int]):
    """One torch allocation per layer, as vLLM's CPU worker does by default."""
    import torch

    return [torch.empty(_shape(g), dtype=torch.float16) for _ in range(g["layers"])]


def _alloc_arena(g: dict[str, int]) -> tuple[list, Any, tuple[int, int], str]:
    """All layer tensors inside one arena: (tensors, keep-alive object, the one region to register, how)."""
    import torch

    total = g["layers"] * g["num_blocks"] * _block_bytes(g)
    why = "vllm_kvp2p.platform.arena not importable"
    try:
        from vllm_kvp2p.platform import arena as arena_mod  # optional: a C++ allocator scope (csrc/arena*.cpp)
    except ImportError:
        arena_mod = None
    if arena_mod is not None:
        if getattr(arena_mod, "AVAILABLE", False):
            try:
                arena = arena_mod.KvArena(total + g["layers"] * 4096 + (2 << 20))
                with arena.scope():
                    tensors = _alloc_separate(g)
                if all(arena.contains(t.data_ptr(), t.numel() * t.element_size()) for t in tensors):
                    how = (f"vllm_kvp2p.platform.arena.KvArena(...).scope(), {g['layers']} torch.empty calls, "
                           f"huge_pages={arena.huge_pages}")
                    return tensors, arena, (arena.base, arena.size), how
                why = "tensors allocated in KvArena.scope() are not inside the arena"
                del tensors, arena
            except Exception as exc:  # fall back, but say why
                why = f"vllm_kvp2p.platform.arena failed: {type(exc).__name__}: {exc}"
        else:
            why = "vllm_kvp2p.platform.arena.AVAILABLE is False"
    n = total // 2
    big = torch.empty(n, dtype=torch.float16)
    per = n // g["layers"]
    tensors = [big[i * per : (i + 1) * per].view(_shape(g)) for i in range(g["layers"])]
    return tensors, big, (big.data_ptr(), total), f"views carved from one torch tensor ({why})"


def _views(tensors):
    from vllm_kvp2p.transfer.layout import TensorView

    return [(f"model.layers.{i}.self_attn", [TensorView(t.data_ptr(), tuple(t.shape), tuple(t.stride()),
                                                         t.element_size())]) for i, t in enumerate(tensors)]


def _median(xs: list[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


# --------------------------------------------------------------------------- P process


def p_main(conn, g: dict[str, int]) -> None:
    """P: separately allocated KV (vLLM's default), random contents, one Mooncake engine, a HoldService."""
    _mc_env()
    import torch

    from vllm_kvp2p.contract.protocol import RankRegistration
    from vllm_kvp2p.prefill.hold_service import HoldService
    from vllm_kvp2p.testing.server import free_port
    from vllm_kvp2p.transfer.engine import MooncakeEngine
    from vllm_kvp2p.transfer.layout import AttentionInterior, coalesce_regions, kv_geometry

    engine = holds = None
    try:
        tensors = _alloc_separate(g)
        gen = torch.Generator().manual_seed(1234)
        for t in tensors:
            t.view(torch.int16).random_(-32768, 32767, generator=gen)
        layers = _views(tensors)
        planes, shapes = kv_geometry(layers, g["num_blocks"], g["block_size"], g["kv_heads"], head_size=g["head_dim"],
                                     interior=AttentionInterior.HEAD_MAJOR_KV_HALVES)
        regions = coalesce_regions([v for _, vs in layers for v in vs])
        engine = MooncakeEngine(HOST, "tcp", transfer_timeout=30)
        t0 = time.perf_counter()
        engine.register(regions)
        reg_s = time.perf_counter() - t0
        port = free_port(HOST)  # outside the ephemeral range
        engine_id = "bench-p-" + uuid.uuid4().hex[:6]
        reg = RankRegistration(engine_id, 0, 1, engine.segment, list(planes), list(shapes),
                               [n for n, _ in layers], g["block_size"], g["num_blocks"], "float16",
                               g["kv_heads"], g["kv_heads"], g["head_dim"])
        holds = HoldService(reg, HOST, port, hold_timeout=120, lease_timeout=60)
        plane_tuples = [(p.base_addr, p.block_stride, p.block_bytes, p.num_blocks) for p in planes]
        conn.send({"segment": engine.segment, "planes": plane_tuples, "port": port,
                   "engine_id": engine_id, "regions": len(regions), "register_s": reg_s})
        for _ in range(1_000_000):  # bounded; ends on "stop" or when D goes away
            try:
                op, arg = conn.recv()
            except EOFError:
                return
            if op == "stop":
                conn.send("bye")
                return
            if op == "sample":  # [(layer, block)] -> raw bytes of each block
                conn.send([tensors[layer][b].view(torch.int16).numpy().tobytes() for layer, b in arg])
            elif op == "hold":
                holds.hold(*arg)
                conn.send("ok")
            elif op == "freed":
                deadline = time.monotonic() + 5
                freed: set[str] = set()
                while arg not in freed and time.monotonic() < deadline:
                    freed |= holds.take_freed()
                    time.sleep(0.005)
                conn.send(arg in freed)
    finally:
        if holds is not None:
            holds.close()
        if engine is not None:
            engine.close()


def stop_p_process(conn, proc) -> None:
    """Ask the P process of :func:`p_main` to stop; terminate, then kill it if it does not exit."""
    try:
        conn.send(("stop", None))
        conn.poll(10) and conn.recv()
    except (OSError, EOFError):
        pass
    proc.join(timeout=15)
    if proc.is_alive():
        proc.terminate()
        proc.join(timeout=5)
    if proc.is_alive():
        proc.kill()
        proc.join(timeout=5)


# --------------------------------------------------------------------------- section 1: registration


def bench_registration(g: dict[str, int], reps: int) -> tuple[dict[str, Any], Any, list, Any]:
    """Times registration on a fresh D engine; returns (results, engine, arena tensors, arena keep-alive, arena
    region) with the arena left registered for the pulls."""
    from vllm_kvp2p.transfer.engine import MooncakeEngine
    from vllm_kvp2p.transfer.layout import coalesce_regions

    engine = MooncakeEngine(HOST, "tcp", transfer_timeout=30)
    raw = engine._engine  # the Mooncake handle: register/unregister repeatedly for a median

    def time_regions(regions: list[tuple[int, int]]) -> list[float]:
        addrs, lens = [a for a, _ in regions], [n for _, n in regions]
        out = []
        for _ in range(reps):
            t0 = time.perf_counter()
            rc = raw.batch_register_memory(addrs, lens, "*")
            out.append(time.perf_counter() - t0)
            if rc != 0:
                raise RuntimeError(f"batch_register_memory of {len(regions)} regions returned {rc}")
            rc = raw.batch_unregister_memory(addrs)
            if rc != 0:
                raise RuntimeError(f"batch_unregister_memory returned {rc}")
        return out

    sep = _alloc_separate(g)
    sep_views = [v for _, vs in _views(sep) for v in vs]
    per_tensor = [(v.data_ptr, v.nbytes_span) for v in sep_views]
    coalesced = coalesce_regions(sep_views)
    gaps = sorted(b.data_ptr() - (a.data_ptr() + a.numel() * 2) for a, b in
                  zip(sorted(sep, key=lambda t: t.data_ptr()), sorted(sep, key=lambda t: t.data_ptr())[1:]))
    res: dict[str, Any] = {
        "separate_regions": len(per_tensor),
        "separate_register_ms": _median(time_regions(per_tensor)) * 1e3,
        "separate_coalesced_regions": len(coalesced),
        "separate_gap_bytes_min_median_max": [gaps[0], int(_median(gaps)), gaps[-1]] if gaps else [],
    }
    if len(coalesced) != len(per_tensor):
        res["separate_coalesced_register_ms"] = _median(time_regions(coalesced)) * 1e3
    del sep, sep_views
    arena_tensors, keep, span, how = _alloc_arena(g)
    for t in arena_tensors:  # touch every page now, so no pull pays first-touch page faults
        t.zero_()
    res["arena_how"] = how
    res["arena_tensors_coalesced_regions"] = len(coalesce_regions([v for _, vs in _views(arena_tensors) for v in vs]))
    res["arena_regions"] = 1
    res["arena_register_ms"] = _median(time_regions([span])) * 1e3
    res["arena_bytes"] = span[1]
    engine.register([span])  # kept: the pulls land here
    return res, engine, arena_tensors, keep, span


def bench_region_scaling(counts: list[int], piece: int = 4096) -> list[dict[str, Any]]:
    """Why the region count matters: for each count, engine A registers that many disjoint 4 KiB regions (8 KiB
    apart, so nothing merges); a fresh engine B then reads one piece from A's last region. B's first read opens
    A's segment (fetches its descriptor, which lists every region); the second read is warm."""
    import torch

    from vllm_kvp2p.transfer.engine import MooncakeEngine

    rows = []
    for n in counts:
        src = torch.arange(n * 2 * piece, dtype=torch.int64).to(torch.uint8)
        dst = torch.zeros(piece, dtype=torch.uint8)
        regions = [(src.data_ptr() + i * 2 * piece, piece) for i in range(n)]
        a = MooncakeEngine(HOST, "tcp", transfer_timeout=30)
        b = MooncakeEngine(HOST, "tcp", transfer_timeout=30)
        row: dict[str, Any] = {"regions": n}
        try:
            t0 = time.perf_counter()
            a.register(regions)
            row["register_ms"] = (time.perf_counter() - t0) * 1e3
            b.register([(dst.data_ptr(), piece)])
            last = regions[-1][0]
            for key in ("first_read_ms", "warm_read_ms"):
                dst.zero_()
                t0 = time.perf_counter()
                rc = b._engine.batch_transfer_sync_read(a.segment, [dst.data_ptr()], [last], [piece])
                row[key] = (time.perf_counter() - t0) * 1e3
                if rc != 0:
                    row["error"] = f"read returned {rc}"
                    break
                if not torch.equal(dst, src[last - src.data_ptr():last - src.data_ptr() + piece]):
                    row["error"] = "bytes differ"
                    break
        except Exception as exc:  # record, keep going: the point is where it breaks
            row["error"] = f"{type(exc).__name__}: {exc}"
        finally:
            b.close()
            a.close()
        print(f"[bench]   {row}", file=sys.stderr, flush=True)
        rows.append(row)
    return rows


# --------------------------------------------------------------------------- section 2: descriptor build


def bench_build(g: dict[str, int], reps: int, rng: random.Random) -> dict[str, Any]:
    from vllm_kvp2p.transfer import native as _ext
    from vllm_kvp2p.transfer.descriptors import PlaneGeometry, build_descriptors_py

    nb, bb, n = g["num_blocks"], _block_bytes(g), g["request_blocks"]
    lp = [PlaneGeometry(0x7F00_0000_0000 + i * nb * bb, bb, bb, nb) for i in range(g["layers"])]
    rp = [PlaneGeometry(0x7E00_0000_0000 + i * nb * bb, bb, bb, nb) for i in range(g["layers"])]
    cases = {
        "contiguous": (list(range(n)), list(range(nb - n, nb))),
        "scattered": (rng.sample(range(nb), n), rng.sample(range(nb), n)),
    }
    out: dict[str, Any] = {"cpp_available": _ext.build_descriptors is not None}
    for name, (lids, rids) in cases.items():
        ref = build_descriptors_py(lp, rp, lids, rids)
        row: dict[str, Any] = {"descriptors": len(ref)}
        ts = []
        for _ in range(reps):
            t0 = time.perf_counter()
            build_descriptors_py(lp, rp, lids, rids)
            ts.append(time.perf_counter() - t0)
        row["python_ms"] = _median(ts) * 1e3
        if _ext.build_descriptors is not None:
            fast = _ext.build_descriptors(lp, rp, lids, rids)
            assert tuple(fast) == (ref.local_addrs, ref.remote_addrs, ref.lengths), f"{name}: C++ != Python"
            ts = []
            for _ in range(reps):
                t0 = time.perf_counter()
                _ext.build_descriptors(lp, rp, lids, rids)
                ts.append(time.perf_counter() - t0)
            row["cpp_ms"] = _median(ts) * 1e3
            row["speedup"] = row["python_ms"] / row["cpp_ms"]
            row["identical"] = True
        out[name] = row
    return out


# --------------------------------------------------------------------------- section 3: pulls


class Puller:
    """D side of section 3: raw reads, connector-descriptor reads and the PullLoop, all verified."""

    def __init__(self, g, engine, region, d_tensors, p_info, conn, rng: random.Random, sample: int) -> None:
        from vllm_kvp2p.lifecycle.pull import LocalKV
        from vllm_kvp2p.transfer.descriptors import PlaneGeometry
        from vllm_kvp2p.transfer.layout import AttentionInterior, kv_geometry

        self.g, self.engine, self.d, self.conn, self.rng, self.sample = g, engine, d_tensors, conn, rng, sample
        self.region = region
        self.p = p_info
        self.segment = p_info["segment"]
        self.p_planes = [PlaneGeometry(*p) for p in p_info["planes"]]
        layers = _views(d_tensors)
        planes, shapes = kv_geometry(layers, g["num_blocks"], g["block_size"], g["kv_heads"], head_size=g["head_dim"],
                                     interior=AttentionInterior.HEAD_MAJOR_KV_HALVES)
        self.d_planes = planes
        self.local = LocalKV(tuple(planes), tuple(shapes), g["block_size"], tuple(n for n, _ in layers), "float16",
                             g["kv_heads"])
        self.loop = self._new_loop()
        self.request_bytes = g["layers"] * g["request_blocks"] * _block_bytes(g)

    def _new_loop(self):
        from vllm_kvp2p.decode.pull_loop import PullLoop

        return PullLoop(self.engine, reader="bench-d:0", tp_size=1, tp_rank=0, local=self.local,
                        side_channel_timeout=10, claim_wait=5, max_batch_entries=MAX_ENTRIES)

    def close(self) -> None:
        self.loop.close()

    def reset_engine(self) -> None:
        """A new D engine (arena registered again) and PullLoop: after a failed batch Mooncake can stay broken
        for that peer (reference doc), so the next case must not inherit a broken engine."""
        from vllm_kvp2p.transfer.engine import MooncakeEngine

        self.loop.close()
        self.engine.close()
        self.engine = MooncakeEngine(HOST, "tcp", transfer_timeout=30)
        self.engine.register([self.region])
        self.loop = self._new_loop()

    # ---- verification

    def _prepare_check(self, lids, rids) -> tuple[list, list]:
        """Pick sample (layer, position) pairs, fetch P's bytes for them, poison them on D."""
        import torch

        n, layers = len(lids), self.g["layers"]
        picks = {(0, 0), (layers - 1, n - 1), (0, n - 1), (layers - 1, 0)}
        while len(picks) < self.sample:
            picks.add((self.rng.randrange(layers), self.rng.randrange(n)))
        picks = sorted(picks)
        expected = self.conn_call("sample", [(layer, rids[i]) for layer, i in picks])
        for layer, i in picks:
            self.d[layer][lids[i]].view(torch.int16).fill_(-1)
        return picks, expected

    def _check(self, lids, picks, expected) -> None:
        import torch

        for (layer, i), want in zip(picks, expected):
            got = self.d[layer][lids[i]].view(torch.int16)
            ref = torch.frombuffer(bytearray(want), dtype=torch.int16).view(got.shape)
            if not torch.equal(got, ref):
                raise AssertionError(f"layer {layer}, request block {i} (local {lids[i]}): bytes differ from P")

    def conn_call(self, op: str, arg: Any = None) -> Any:
        self.conn.send((op, arg))
        if not self.conn.poll(60):
            raise TimeoutError(f"P did not answer {op!r}")
        return self.conn.recv()

    # ---- the cases; each returns a dict of timings for one verified pull

    def raw_ceiling(self, lids, rids) -> dict[str, float]:
        """One descriptor per plane covering the request's bytes (ids must be contiguous on both sides)."""
        n, bb = len(lids), _block_bytes(self.g)
        la = [p.base_addr + lids[0] * p.block_stride for p in self.d_planes]
        ra = [p.base_addr + rids[0] * p.block_stride for p in self.p_planes]
        ln = [n * bb] * len(la)
        picks, expected = self._prepare_check(lids, rids)
        raw = self.engine._engine
        t0 = time.perf_counter()
        for i in range(0, len(la), MAX_ENTRIES):
            rc = raw.batch_transfer_sync_read(self.segment, la[i:i + MAX_ENTRIES], ra[i:i + MAX_ENTRIES],
                                              ln[i:i + MAX_ENTRIES])
            if rc != 0:
                raise RuntimeError(f"raw batch_transfer_sync_read returned {rc}")
        t = time.perf_counter() - t0
        self._check(lids, picks, expected)
        return {"descriptors": len(la), "batches": -(-len(la) // MAX_ENTRIES), "build_ms": 0.0,
                "read_ms": t * 1e3, "total_ms": t * 1e3}

    def descriptor_reads(self, lids, rids) -> dict[str, float]:
        """The connector's descriptors (C++ build when available), split to <= 1024 entries, engine.read each."""
        from vllm_kvp2p.transfer.descriptors import build_descriptors

        picks, expected = self._prepare_check(lids, rids)
        t0 = time.perf_counter()
        d = build_descriptors(self.d_planes, self.p_planes, lids, rids)
        batches = d.batches(MAX_ENTRIES)
        t1 = time.perf_counter()
        for b in batches:
            self.engine.read(self.segment, b)
        t2 = time.perf_counter()
        self._check(lids, picks, expected)
        assert d.total_bytes == len(lids) * self.g["layers"] * _block_bytes(self.g)
        return {"descriptors": len(d), "batches": len(batches), "build_ms": (t1 - t0) * 1e3,
                "read_ms": (t2 - t1) * 1e3, "total_ms": (t2 - t0) * 1e3}

    def connector(self, lids, rids, check: bool = True) -> dict[str, float]:
        """HoldService on P + PullLoop on D: hold (not timed), then submit -> result (registration cached)."""
        from vllm_kvp2p.contract.protocol import RemotePrefill
        from vllm_kvp2p.lifecycle.consumer import PullPlan
        from vllm_kvp2p.lifecycle.pull import Outcome

        g = self.g
        req, hold = "req-" + uuid.uuid4().hex[:8], "hold-" + uuid.uuid4().hex[:6]
        if check:
            picks, expected = self._prepare_check(lids, rids)
        self.conn_call("hold", (req, hold))
        remote = RemotePrefill(self.p["engine_id"], req, HOST, self.p["port"], [list(rids)], hold,
                               len(rids) * g["block_size"], g["block_size"])
        plan = PullPlan("d-" + req, remote, (tuple(lids),), (tuple(rids),), True)
        t0 = time.perf_counter()
        self.loop.submit(plan)
        results = []
        deadline = time.monotonic() + 120
        while not results and time.monotonic() < deadline:
            results = self.loop.take_results()
            if not results:
                time.sleep(0.0005)
        wall = time.perf_counter() - t0
        if not results:
            raise TimeoutError("connector pull did not finish in 120 s")
        r = results[0].result
        if r.outcome is not Outcome.PULLED:
            raise RuntimeError(f"connector pull failed: {r.outcome} {r.reason}")
        if check:
            self._check(lids, picks, expected)
            want = len(lids) * g["layers"] * _block_bytes(g)
            assert r.num_bytes == want, (r.num_bytes, want)
        freed = self.conn_call("freed", req)
        if not freed:
            raise RuntimeError(f"P did not free {req} after the release")
        return {"descriptors": r.num_descriptors, "batches": -(-r.num_descriptors // MAX_ENTRIES),
                "loop_ms": results[0].seconds * 1e3, "total_ms": wall * 1e3}


def bench_pulls(g, reps: int, budget_s: float, state: dict[str, Any], d_tensors, p_info, conn, rng,
                sample: int) -> dict[str, Any]:
    """Interleaved reps of every case until ``reps`` or ``budget_s`` (at least one rep). ``state["engine"]`` is
    D's engine, replaced (and updated there) after a failed transfer."""
    n, nb = g["request_blocks"], g["num_blocks"]
    contiguous = (list(range(0, n)), list(range(nb - n, nb)))  # different offsets on the two sides
    puller = Puller(g, state["engine"], state["region"], d_tensors, p_info, conn, rng, sample)
    resets, max_resets = 0, 3
    t_start = time.monotonic()

    def reset(why: str) -> None:
        nonlocal resets
        resets += 1
        if resets > max_resets:
            raise RuntimeError(f"giving up after {max_resets} engine resets; last failure: {why}")
        print(f"[bench] resetting D's engine after: {why}", file=sys.stderr, flush=True)
        puller.reset_engine()
        state["engine"] = puller.engine

    try:
        # Warm-up: the first read to a new peer does the P2P handshake and opens the TCP lanes (a first large
        # read was consistently slower); the first PullLoop pull fetches P's registration (then cached). None of
        # that is part of a steady-state pull.
        for attempt in range(2):
            try:
                puller.descriptor_reads([0], [0])
                puller.raw_ceiling(*contiguous)
                puller.connector([1], [1], check=False)
                break
            except (RuntimeError, TimeoutError) as exc:
                if attempt:
                    raise
                reset(f"warm-up: {exc}")
        cases = {
            "raw ceiling: 1 descriptor per plane": lambda ids: puller.raw_ceiling(*contiguous),
            "connector descriptors, contiguous ids (runs merged)": lambda ids: puller.descriptor_reads(*contiguous),
            "connector descriptors, scattered ids (no merging)": lambda ids: puller.descriptor_reads(*ids),
            "connector end to end (HoldService+PullLoop), contiguous ids": lambda ids: puller.connector(*contiguous),
            "connector end to end (HoldService+PullLoop), scattered ids": lambda ids: puller.connector(*ids),
        }
        samples: dict[str, list[dict[str, float]]] = {k: [] for k in cases}
        errors: dict[str, list[str]] = {k: [] for k in cases}
        aborted = ""
        reps_done = 0
        for rep in range(reps):  # interleaved, so drifting machine load hits every case alike
            if rep and time.monotonic() - t_start > budget_s:
                break
            scattered = (rng.sample(range(nb), n), rng.sample(range(nb), n))
            for name, fn in cases.items():
                t0 = time.perf_counter()
                try:
                    samples[name].append(fn(scattered))
                except (RuntimeError, TimeoutError) as exc:  # TransferEngineError is a RuntimeError
                    why = f"{exc} (after {time.perf_counter() - t0:.2f} s)"
                    print(f"[bench] {name}: FAILED: {why}", file=sys.stderr, flush=True)
                    errors[name].append(why)
                    try:
                        reset(why)
                    except RuntimeError as stop:
                        aborted = str(stop)
                        break
            reps_done = rep + 1
            if aborted:
                break
        out: dict[str, Any] = {}
        for name, runs in samples.items():
            row: dict[str, Any] = {"reps": len(runs), "failed": len(errors[name]), "errors": errors[name]}
            out[name] = row
            if not runs:
                continue
            row.update(descriptors=runs[0]["descriptors"], batches=runs[0]["batches"])
            for key in runs[0]:
                if key.endswith("_ms"):
                    row[key] = _median([r[key] for r in runs])
            row["total_ms_all"] = [round(r["total_ms"], 1) for r in runs]
            row["gb_per_s"] = puller.request_bytes / (row["total_ms"] / 1e3) / 1e9
            row["us_per_descriptor"] = row["total_ms"] * 1e3 / row["descriptors"]
            row["best_gb_per_s"] = puller.request_bytes / (min(r["total_ms"] for r in runs) / 1e3) / 1e9
        return {"cases": out, "reps_done": reps_done, "engine_resets": resets, "aborted": aborted,
                "seconds": time.monotonic() - t_start}
    finally:
        puller.close()


# --------------------------------------------------------------------------- report


def _fmt(x: Any, nd: int = 2) -> str:
    if isinstance(x, float):
        return f"{x:.{nd}f}"
    return str(x)


def render(res: dict[str, Any]) -> str:
    g, m = res["geometry"], res["machine"]
    lines = [
        f"Geometry: {g['layers']} layers x tensor ({g['num_blocks']}, {g['kv_heads']}, {g['block_size']}, "
        f"{2 * g['head_dim']}) float16 per side; {g['block_bytes'] // 1024} KiB per block per layer; "
        f"request = {g['request_blocks']} blocks = {g['request_bytes'] / 2**20:.0f} MiB; "
        f"KV per side {g['kv_bytes_per_side'] / 2**20:.0f} MiB.",
        f"Machine: {m['cpus']} CPUs, {m['platform']}, Python {m['python']}, torch {m['torch']}, "
        f"mooncake {m['mooncake']}; loopback TCP 127.0.0.1; load average {m['loadavg_start']} -> "
        f"{m['loadavg_end']}.",
        "",
    ]
    r = res.get("registration")
    if r:
        lines += [
            "### 1. Registration (D process, batch_register_memory, median of "
            f"{res['settings']['register_reps']})",
            "",
            "| allocation | Mooncake regions | batch_register_memory ms |",
            "|---|---|---|",
            f"| (a) {g['layers']} separate tensors, per-tensor | {r['separate_regions']} | "
            f"{r['separate_register_ms']:.3f} |",
        ]
        if "separate_coalesced_register_ms" in r:
            lines.append(f"| (a') same, after coalesce_regions | {r['separate_coalesced_regions']} | "
                         f"{r['separate_coalesced_register_ms']:.3f} |")
        else:
            lines.append(f"| (a') same, after coalesce_regions | {r['separate_coalesced_regions']} | (same as a) |")
        lines += [
            f"| (b) one arena ({r['arena_how']}) | {r['arena_regions']} | {r['arena_register_ms']:.3f} |",
            "",
            f"coalesce_regions of the {g['layers']} arena tensors gives {r['arena_tensors_coalesced_regions']} "
            f"region(s); the arena registered is {r['arena_bytes'] / 2**20:.0f} MiB.",
            f"Gaps between the separate allocations (bytes, min/median/max): "
            f"{r['separate_gap_bytes_min_median_max']}.",
            "",
        ]
    sc = res.get("region_scaling")
    if sc:
        lines += [
            "### 1b. Region count vs registration and first read (4 KiB regions, 8 KiB apart; a fresh peer reads "
            "one piece of the last region)",
            "",
            "| regions | batch_register_memory ms | peer's first read ms (opens the segment) | warm read ms |",
            "|---|---|---|---|",
        ]
        for row in sc:
            if "error" in row:
                lines.append(f"| {row['regions']} | {_fmt(row.get('register_ms', '-'), 1)} | "
                             f"FAILED: {row['error']} | |")
            else:
                lines.append(f"| {row['regions']} | {row['register_ms']:.1f} | {row['first_read_ms']:.1f} | "
                             f"{row['warm_read_ms']:.2f} |")
        lines.append("")
    b = res.get("build")
    if b:
        lines += [
            f"### 2. Descriptor build, {g['request_blocks']} blocks x {g['layers']} planes "
            f"(median of {res['settings']['build_reps']})",
            "",
            "| ids | descriptors | Python ms | C++ ms | speedup | identical |",
            "|---|---|---|---|---|---|",
        ]
        for name in ("contiguous", "scattered"):
            row = b[name]
            lines.append(f"| {name} | {row['descriptors']} | {row['python_ms']:.3f} | "
                         f"{_fmt(row.get('cpp_ms', 'n/a'), 3)} | {_fmt(row.get('speedup', 'n/a'), 1)}x | "
                         f"{row.get('identical', 'n/a')} |")
        lines.append("")
    pulls = res.get("pulls")
    if pulls:
        p, pr = pulls["cases"], res["p_side"]
        lines += [
            f"### 3. Pull of {g['request_blocks']} blocks x {g['layers']} layers = "
            f"{g['request_bytes'] / 2**20:.0f} MiB, P in another process (median of "
            f"{pulls['reps_done']} interleaved reps, batches <= {MAX_ENTRIES} entries)",
            "",
            f"P: {g['layers']} separately allocated tensors registered as {pr['regions']} region(s) after "
            "coalescing; D: the arena above (1 region).",
            "",
            "| path | descriptors | batches | build ms | read ms | total ms | GB/s | best GB/s | µs/descriptor "
            "| runs (total ms) |",
            "|---|---|---|---|---|---|---|---|---|---|",
        ]
        for name, row in p.items():
            if not row["reps"]:
                lines.append(f"| {name} | FAILED {row['failed']}/{row['failed']}: {row['errors'][0]} |")
                continue
            failed = f" ({row['failed']} failed)" if row.get("failed") else ""
            build = _fmt(row["build_ms"], 2) if "build_ms" in row else "-"
            read = _fmt(row["read_ms"], 1) if "read_ms" in row else f"({row['loop_ms']:.1f} in loop)"
            lines.append(f"| {name} | {row['descriptors']} | {row['batches']} | {build} | {read} | "
                         f"{row['total_ms']:.1f} | {row['gb_per_s']:.2f} | {row['best_gb_per_s']:.2f} | "
                         f"{row['us_per_descriptor']:.1f} | "
                         f"{row['total_ms_all']}{failed} |")
        lines += ["", "GB/s = request bytes / median total ms; best = fastest rep (1 GB = 1e9 B); build, read, "
                  "total and µs/descriptor are medians. Every pull verified on sampled blocks.", ""]
        if pulls["engine_resets"] or pulls["aborted"]:
            lines += [f"Failed transfers: D's engine was recreated {pulls['engine_resets']} time(s)"
                      f"{'; ABORTED: ' + pulls['aborted'] if pulls['aborted'] else ''}. Errors are in the JSON.", ""]
    lines.append(f"Wall time of the benchmark: {res['wall_s']:.1f} s.")
    return "\n".join(lines)


def _on_sigterm(signum, frame) -> None:
    raise SystemExit(f"terminated by signal {signum}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer repetitions (~30 s)")
    ap.add_argument("--json", metavar="PATH", help="also write the results as JSON")
    ap.add_argument("--layers", type=int, default=64)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--head-dim", type=int, default=32)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--num-blocks", type=int, default=1280, help="blocks per side (>= --request-blocks)")
    ap.add_argument("--request-blocks", type=int, default=1024)
    ap.add_argument("--pull-reps", type=int, default=None)
    ap.add_argument("--build-reps", type=int, default=None)
    ap.add_argument("--register-reps", type=int, default=None)
    ap.add_argument("--pull-budget", type=float, default=None,
                    help="seconds after which no further pull rep is started (default 100; 20 with --quick)")
    ap.add_argument("--region-counts", default="64,128,256,1024,4096,8192",
                    help="region counts for section 1b (comma-separated; empty skips it)")
    ap.add_argument("--sample", type=int, default=32, help="blocks verified per pull")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    if args.num_blocks < args.request_blocks:
        ap.error("--num-blocks must be >= --request-blocks")
    _mc_env()
    signal.signal(signal.SIGTERM, _on_sigterm)  # so `finally` stops P and closes the engines
    t_start = time.perf_counter()
    rng = random.Random(args.seed)
    g = {"layers": args.layers, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "block_size": args.block_size,
         "num_blocks": args.num_blocks, "request_blocks": args.request_blocks}
    g["block_bytes"] = _block_bytes(g)
    g["request_bytes"] = g["layers"] * g["request_blocks"] * g["block_bytes"]
    g["kv_bytes_per_side"] = g["layers"] * g["num_blocks"] * g["block_bytes"]
    settings = {
        "pull_reps": args.pull_reps or (2 if args.quick else 7),
        "build_reps": args.build_reps or (5 if args.quick else 25),
        "register_reps": args.register_reps or (5 if args.quick else 20),
        "pull_budget_s": args.pull_budget if args.pull_budget is not None else (20.0 if args.quick else 100.0),
        "quick": args.quick,
    }

    import torch

    try:
        from importlib.metadata import version

        mc_version = version("mooncake-transfer-engine-non-cuda")
    except Exception:
        mc_version = "?"
    res: dict[str, Any] = {
        "geometry": g,
        "settings": settings,
        "machine": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version(),
                    "torch": torch.__version__, "mooncake": mc_version,
                    "loadavg_start": [round(x, 1) for x in os.getloadavg()]},
    }

    print("[bench] descriptor build ...", file=sys.stderr, flush=True)
    res["build"] = bench_build(g, settings["build_reps"], rng)
    print("[bench] registration ...", file=sys.stderr, flush=True)
    res["registration"], engine, d_tensors, keep, region = bench_registration(g, settings["register_reps"])
    state = {"engine": engine, "region": region}
    counts = [int(c) for c in args.region_counts.split(",") if c.strip()]
    if counts:
        print("[bench] region scaling ...", file=sys.stderr, flush=True)
        res["region_scaling"] = bench_region_scaling(counts)

    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=p_main, args=(child, g), name="bench-P", daemon=True)
    print("[bench] starting P process ...", file=sys.stderr, flush=True)
    proc.start()
    child.close()
    try:
        if not parent.poll(180):
            raise TimeoutError("P process did not come up in 180 s")
        p_info = parent.recv()
        res["p_side"] = {"regions": p_info["regions"], "register_ms": p_info["register_s"] * 1e3}
        print("[bench] pulls ...", file=sys.stderr, flush=True)
        res["pulls"] = bench_pulls(g, settings["pull_reps"], settings["pull_budget_s"], state, d_tensors, p_info,
                                   parent, rng, args.sample)
    finally:
        stop_p_process(parent, proc)
        state["engine"].close()
    del d_tensors, keep
    res["machine"]["loadavg_end"] = [round(x, 1) for x in os.getloadavg()]
    res["wall_s"] = time.perf_counter() - t_start
    print(render(res))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(res, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())
