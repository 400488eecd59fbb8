"""The two start-up refusals of vllm_kvp2p/transfer/kv_groups.py that docs/models.md states, on vLLM's own KV-cache
specs
(issue 38: claims without a test): a group of a kind the connector does not move (chunked local attention), and a
linear-attention state group with speculative decoding. Each next to the same group the connector does move, so
the refusal is the spec's doing, not the test's."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, KVCacheGroupSpec, MambaSpec

from vllm_kvp2p.transfer.kv_groups import FULL, STATE, KVGroup, UnsupportedKVCacheError, groups_from_vllm


def _config(*specs: object) -> SimpleNamespace:
    """What groups_from_vllm reads of vLLM's KVCacheConfig: its groups, real KVCacheGroupSpec objects."""
    return SimpleNamespace(kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.attn"], spec)
                                            for i, spec in enumerate(specs)])


def _mamba(speculative_blocks: int) -> MambaSpec:
    return MambaSpec(block_size=64, shapes=((4, 32), (8, 16, 16)), dtypes=(torch.float32, torch.float32),
                     num_speculative_blocks=speculative_blocks)


def test_a_group_of_another_kind_is_refused_naming_it() -> None:
    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32)
    assert groups_from_vllm(_config(full), [0]) == (KVGroup(FULL, 16),)
    chunked = ChunkedLocalAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float32,
                                        attention_chunk_size=128)
    with pytest.raises(UnsupportedKVCacheError, match=r"KV-cache group 1 \(ChunkedLocalAttentionSpec, layers "
                                                      r"model\.layers\.1\.attn\) holds a kind of cache"):
        groups_from_vllm(_config(full, chunked), [0, 1])


def test_linear_attention_state_with_speculative_decoding_is_refused() -> None:
    assert groups_from_vllm(_config(_mamba(0)), [0]) == (KVGroup(STATE, 64),)
    with pytest.raises(UnsupportedKVCacheError, match=r"linear-attention state of KV-cache group 0 with "
                                                      r"speculative decoding \(2 speculative state blocks\)"):
        groups_from_vllm(_config(_mamba(2)), [0])
