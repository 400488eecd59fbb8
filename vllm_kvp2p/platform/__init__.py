"""Platform adapters behind one small interface: CPU now, Ascend NPU in production.

Everything platform-specific the connector needs goes through :class:`KVPlatform`; no other module asks which
platform it runs on.
"""

from __future__ import annotations

import importlib.util

from vllm_kvp2p.platform.base import KVPlatform


def get_platform(name: str = "auto") -> KVPlatform:
    """The adapter for ``name`` ("cpu", "npu", or "auto": NPU when torch_npu is installed)."""
    if name == "auto":
        name = "npu" if importlib.util.find_spec("torch_npu") is not None else "cpu"
    if name == "npu":
        from vllm_kvp2p.platform.npu import NpuPlatform

        return NpuPlatform()
    from vllm_kvp2p.platform.cpu import CpuPlatform

    return CpuPlatform()


__all__ = ["KVPlatform", "get_platform"]
