"""CPU: KV cache in host memory, Mooncake over TCP."""

from __future__ import annotations

from typing import Any

from vllm_kvp2p.platform.base import KVPlatform


class CpuPlatform(KVPlatform):
    name = "cpu"
    default_protocol = "tcp"

    def memory_location(self, tensor: Any) -> str:
        return "cpu"

    def synchronize(self) -> None:
        # Host memory written by the forward pass is visible once the step returns.
        return None
