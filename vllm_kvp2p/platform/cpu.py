"""CPU: KV cache in host memory, Mooncake over TCP."""

from __future__ import annotations

import os
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from vllm_kvp2p.platform.base import KVArenaLike, KVPlatform
from vllm_kvp2p.transfer.interior import PartLayout
from vllm_kvp2p.transfer.layout import AttentionInterior


class CpuPlatform(KVPlatform):
    name = "cpu"
    default_protocol = "tcp"
    # vLLM's CPU attention (cpu_attn.py, 0.23 to 0.32) allocates [blocks, heads, tokens, 2 x head] and reads it as
    # [blocks, heads, 2 x tokens, head] split in two: per head all K rows, then all V rows.
    attention_interior = AttentionInterior.HEAD_MAJOR_KV_HALVES
    # Cores are few and shared with the forward pass: vLLM's 1 s spin after each step message would keep every
    # worker and engine core spinning while transfers are pending (platform/worker_polling.py).
    default_worker_busy_poll = 0.002

    def attention_part_layouts(
        self, dtype: Any, block_size: int, head_size: int, kv_cache_dtype: str
    ) -> tuple[PartLayout, ...]:
        from vllm_kvp2p.platform.cpu_interior import attention_part_layouts

        return attention_part_layouts(dtype, block_size, head_size, kv_cache_dtype)

    def memory_location(self, tensor: Any) -> str:
        return "cpu"

    def synchronize(self) -> None:
        # Host memory written by the forward pass is visible once the step returns.
        return None

    def kv_arena(self, size_bytes: int) -> KVArenaLike | None:
        from vllm_kvp2p.platform import arena

        if not arena.available():
            return None
        return arena.KvArena(size_bytes)

    @contextmanager
    def service_threads(self) -> Iterator[None]:
        """vLLM's CPU worker pins its process to the compute cores (``VLLM_CPU_OMP_THREADS_BIND``, by default one
        core per worker, the others reserved). Threads inherit their creator's affinity, so Mooncake's transfer
        threads, which busy-poll, would share that one core with the forward pass and with each other, and a peer
        on the same core could not answer for seconds. Threads created in this scope may run on every core this
        process tree was given."""
        own = os.sched_getaffinity(0)
        try:
            wide = own | os.sched_getaffinity(os.getppid())
        except OSError:
            wide = own
        if wide == own:
            yield
            return
        os.sched_setaffinity(0, wide)
        try:
            yield
        finally:
            os.sched_setaffinity(0, own)
