"""KV-cache groups: what vLLM's hybrid allocator (HMA) hands a connector, and which blocks of each a decoder needs.

With HMA, vLLM keeps one block table per *KV-cache group* (layers of one attention type share a table) and gives
the connector one list of block ids per group. For a prompt of ``n`` tokens a decoder needs, per group:

* full attention: every block of the prompt;
* sliding window of ``w`` tokens: only the blocks holding the window, from the block of token ``n - w + 1`` on
  (at most ``cdiv(w, block_size) + 1``: the window rarely starts on a block boundary). vLLM frees the older ones on
  P and never gives D any;
* linear attention / Mamba (vLLM's ``MambaSpec``, e.g. Qwen3-Next's Gated DeltaNet): the one block holding the
  running state (conv and SSM state together in one page). A state cannot be rewound, and D always computes the
  prompt's last token itself, so for such models P prefills all but the last prompt token (the decoder then
  applies it to the state it pulled: vLLM's own connectors do the same) and reports that many tokens.

Both sides cut the lists the same way (:func:`needed_tail`), and every list is *tail-aligned*: it ends with the
block holding the prompt's last token, so list index ``i`` of a group with ``k`` of the prompt's ``m`` blocks is
block ``m - k + i`` of the prompt on P and on D alike.

Any other group (chunked local attention, speculative-decoding state slots, ...) is refused by
:func:`groups_from_vllm` with a message naming the group, at engine start-up, instead of a wrong answer later.

Pure except :func:`groups_from_vllm`, the adapter from vLLM's ``KVCacheConfig``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Annotated, Any

import msgspec

if TYPE_CHECKING:
    from vllm.v1.kv_cache_interface import KVCacheConfig

FULL = "full"
SLIDING = "sliding"
STATE = "state"  # Mamba / linear-attention state (one block per request)
NULL_BLOCK_ID = 0  # vLLM's placeholder block: no data (freed sliding-window blocks, align-mode state slots)


class UnsupportedKVCacheError(ValueError):
    """The model's KV cache has a group this connector cannot move (the message names it)."""


class KVGroup(msgspec.Struct, frozen=True):
    """One KV-cache group as the connector sees it (also part of each rank's registration)."""

    kind: Annotated[str, msgspec.Meta(max_length=16)]  # FULL, SLIDING or STATE (peers send it: registrations)
    block_size: int  # tokens per block of this group
    sliding_window: int = 0  # tokens (SLIDING only)

    @property
    def max_blocks(self) -> int | None:
        """Most blocks of a prompt a decoder needs from this group (None: all of them)."""
        if self.kind == SLIDING:
            return -(-self.sliding_window // self.block_size) + 1
        if self.kind == STATE:
            return 1
        return None

    def describe(self) -> str:
        if self.kind == SLIDING:
            return f"sliding window {self.sliding_window}"
        return "linear-attention state" if self.kind == STATE else "full attention"


def has_state(groups: Sequence[KVGroup]) -> bool:
    """A model with a recurrent state: P prefills one token less (see the module docstring)."""
    return any(g.kind == STATE for g in groups)


#: The one group of a model without HMA (every model before hybrid support, and D's view of old params).
def single_full_group(block_size: int) -> tuple[KVGroup, ...]:
    return (KVGroup(FULL, block_size),)


def common_block_size(groups: Sequence[KVGroup], default: int) -> int:
    """The block size of every group (vLLM raises the attention block size of a hybrid model to fit its state
    pages, e.g. 288 tokens, without telling the cache config on every process); ``default`` if they differ."""
    sizes = {g.block_size for g in groups}
    return sizes.pop() if len(sizes) == 1 else default


def prompt_blocks(num_tokens: int, block_size: int) -> int:
    return -(-num_tokens // block_size) if num_tokens > 0 else 0


def needed_count(group: KVGroup, num_tokens: int) -> int:
    """How many blocks of this group a decoder needs for a ``num_tokens`` prompt, exactly the real blocks vLLM gives
    a request that loads ``num_tokens`` tokens: what :func:`needed_tail` keeps of P's list and what D must be
    offered (vllm_kvp2p/lifecycle/admission.py). A sliding window skips ``num_tokens - w + 1`` tokens, as vLLM's
    ``SlidingWindowManager.get_num_skipped_tokens`` (0.23 and 0.32): blocks wholly before them are null on D, and P
    may have freed them (nulls in its list) when its last chunk was short."""
    blocks = prompt_blocks(num_tokens, group.block_size)
    if group.kind == SLIDING:
        return blocks - max(0, num_tokens - group.sliding_window + 1) // group.block_size
    limit = group.max_blocks
    return min(blocks, limit) if limit is not None else blocks


def needed_tail(group: KVGroup, block_ids: Sequence[int], num_tokens: int) -> list[int]:
    """The blocks of one group's list (in token order, starting at the prompt's first block) that hold what a
    decoder needs of a ``num_tokens`` prompt: the list is cut to the prompt's blocks, then to the window."""
    ids = list(block_ids[: prompt_blocks(num_tokens, group.block_size)])
    if group.kind == STATE:  # the running state is the last real block; the others are placeholders
        ids = [b for b in ids if b != NULL_BLOCK_ID]
    count = needed_count(group, num_tokens)
    return ids[len(ids) - count:] if len(ids) > count else ids  # count may be 0 (a window of one token)


def load_failure_problem(num_groups: int, loads_kv: bool, reports_failed_requests: bool) -> str | None:
    """Why an engine could not survive one failed pull (None: it can).

    A vLLM that takes failed loads only as block ids (0.23) maps them back to requests through one block list per
    request, and its scheduler raises (``(req_block_ids,) = get_block_ids(...)``: too many values to unpack) for a
    model with several KV-cache groups: the first failed pull would stop D's engine. Such a D is refused at
    start-up instead; P never loads, so it is not concerned."""
    if not loads_kv or reports_failed_requests or num_groups <= 1:
        return None
    return (
        f"MooncakeP2PConnector cannot run as a decoder on this vLLM with {num_groups} KV-cache groups (vLLM's hybrid "
        "allocator, e.g. sliding-window and full-attention layers): this vLLM reports a failed KV load to its "
        "scheduler only as block ids, which it cannot map back to requests with several groups, so the first "
        "failed pull would stop this engine. Start D and P with --disable-hybrid-kv-cache-manager (one group: "
        "sliding-window layers then keep and move every block; P and D must agree), or run a vLLM that reports "
        "failed requests (0.32 does). docs/models.md"
    )


def groups_from_vllm(kv_cache_config: KVCacheConfig, transfer_group_ids: Sequence[int]) -> tuple[KVGroup, ...]:
    """The transfer groups of vLLM's KV-cache config as :class:`KVGroup` s; raises
    :class:`UnsupportedKVCacheError` for a group of any other attention type (Mamba / linear attention state,
    chunked local attention, ...)."""
    groups = kv_cache_config.kv_cache_groups
    out = []
    for gid in transfer_group_ids:
        spec = groups[gid].kv_cache_spec
        kind = _kind_of(spec)
        if kind is None:
            layers = list(groups[gid].layer_names)
            shown = ", ".join(layers[:3]) + (", ..." if len(layers) > 3 else "")
            raise UnsupportedKVCacheError(
                f"MooncakeP2PConnector cannot move the KV cache of this model: KV-cache group {gid} "
                f"({type(spec).__name__}, layers {shown}) holds a kind of cache this connector does not transfer; "
                "it moves full-attention, MLA and sliding-window KV and Mamba / linear-attention state "
                "(docs/models.md). Serve this model without --kv-transfer-config, or with a connector that "
                "supports it."
            )
        if kind == STATE and getattr(spec, "num_speculative_blocks", 0):
            raise UnsupportedKVCacheError(
                f"MooncakeP2PConnector does not move the linear-attention state of KV-cache group {gid} with "
                f"speculative decoding ({spec.num_speculative_blocks} speculative state blocks); serve this model "
                "without speculative decoding on P and D (docs/models.md)."
            )
        window = int(getattr(spec, "sliding_window", 0) or 0) if kind == SLIDING else 0
        out.append(KVGroup(kind, int(spec.block_size), window))
    return tuple(out)


def layer_groups_from_vllm(kv_cache_config: KVCacheConfig, transfer_group_ids: Sequence[int]) -> dict[str, int]:
    """Layer name -> index into the transfer groups (layers of groups that are not transferred are absent)."""
    groups = kv_cache_config.kv_cache_groups
    return {name: i for i, gid in enumerate(transfer_group_ids) for name in groups[gid].layer_names}


def _kind_of(spec: Any) -> str | None:
    from vllm.v1 import kv_cache_interface as kvi

    uniform = getattr(kvi, "UniformTypeKVCacheSpecs", None)
    if uniform is not None and isinstance(spec, uniform):
        kinds = {_kind_of(s) for s in spec.kv_cache_specs.values()}
        return kinds.pop() if len(kinds) == 1 else None
    if isinstance(spec, kvi.SlidingWindowSpec):
        return SLIDING
    if type(spec) is kvi.MambaSpec:
        return STATE
    if type(spec) in (kvi.FullAttentionSpec, kvi.MLAAttentionSpec) or _is_plain_full(spec, kvi):
        return FULL
    return None


def _is_plain_full(spec: Any, kvi: Any) -> bool:
    """Subclasses of FullAttentionSpec that still keep every token's KV in the block table (sinks, quantised)."""
    names = ("SinkFullAttentionSpec", "TQFullAttentionSpec")
    return any(isinstance(spec, getattr(kvi, n)) for n in names if hasattr(kvi, n))
