"""Ascend NPU (910B): KV cache in device HBM, Mooncake's ``ascend`` transport (ADXL/HIXL).

Not runnable on these CI machines (no NPU); kept import-safe so the package imports anywhere.
"""

from __future__ import annotations

from typing import Any

from vllm_kvp2p.log import get_logger
from vllm_kvp2p.platform.base import KVArenaLike, KVPlatform
from vllm_kvp2p.transfer.layout import AttentionInterior

logger = get_logger(__name__)


class NpuPlatform(KVPlatform):
    name = "npu"
    default_protocol = "ascend"
    # vllm-ascend's NPUModelRunner._reshape_kv_cache_tensors views K and V as separate [blocks, tokens, heads,
    # head] tensors (MLA: nope and rope, one head); tests/unit/test_vllm_ascend_release_layout.py reads it there.
    attention_interior = AttentionInterior.TOKEN_MAJOR
    # vllm-ascend hard-codes this HCCL per-process limit (MAX_HCCL_REGISTER_REGIONS).
    max_registered_regions = 256

    def unsupported_setting(self, vllm_config: Any) -> str:
        extra = getattr(vllm_config, "additional_config", None) or {}
        if isinstance(extra, dict) and extra.get("enable_kv_nz"):
            return ("vllm-ascend's additional_config enable_kv_nz keeps D's MLA cache in the NZ format and relies on "
                    "vllm-ascend's own MooncakeConnector to reformat what it receives; MooncakeP2PConnector moves "
                    "blocks as they lie: remove enable_kv_nz (docs/deploy-ascend.md)")
        return ""

    def memory_location(self, tensor: Any) -> str:
        return f"npu:{tensor.device.index}"

    def synchronize(self) -> None:
        import torch
        import torch_npu  # noqa: F401  (registers torch.npu)

        torch.npu.synchronize()

    def kv_arena(self, size_bytes: int) -> KVArenaLike | None:
        from vllm_kvp2p.platform import npu_arena

        reason = npu_arena.unavailable_reason()
        if reason is not None:
            logger.warning("no NPU KV arena: %s", reason)
            return None
        return npu_arena.NpuKvArena(size_bytes)
