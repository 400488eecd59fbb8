"""D side: may a P rank's registration serve a plan on this D rank? Pure: no sockets, threads, clocks or torch.

A registration comes from whatever answers at the address the params name, so it is checked against the params
(who P is: engine, incarnation, rank, host) and against this D (what the KV holds: model, geometry, groups)
before it is cached or read (docs/security.md).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Sequence
from typing import TYPE_CHECKING

from vllm_kvp2p.contract.protocol import PROTOCOL_VERSION, RankRegistration
from vllm_kvp2p.lifecycle.stages import plane_pairs, staged, unknown_layers_problem
from vllm_kvp2p.transfer.kv_groups import STATE, KVGroup
from vllm_kvp2p.transfer.slicing import BlockShape

if TYPE_CHECKING:
    from vllm_kvp2p.lifecycle.consumer import PullPlan
    from vllm_kvp2p.lifecycle.pull_actions import LocalKV, Source


def registration_problem(plan: PullPlan, local: LocalKV, source: Source, reg: RankRegistration) -> str:
    """Why this registration must not be used for this plan ("" if it may): it is checked against the params
    (who P is) and against this D (what the KV holds) before it is cached or read."""
    r = plan.remote
    if reg.protocol_version != PROTOCOL_VERSION:
        return f"protocol version: P speaks {reg.protocol_version}, D {PROTOCOL_VERSION} (same release on both)"
    if reg.engine_id != r.remote_engine_id:
        return f"its side channel answers for engine {reg.engine_id}, the params name engine {r.remote_engine_id}"
    if r.remote_incarnation and reg.incarnation != r.remote_incarnation:
        return (f"P restarted: the params are from incarnation {r.remote_incarnation}, its side channel serves "
                f"{reg.incarnation or 'none'}")
    if reg.rank != source.p_rank or reg.tp_size != r.tp_size or reg.pp_size != r.pp_size:
        return (f"it is rank {reg.rank} (stage {reg.pp_rank} of {reg.pp_size}, TP rank {reg.tp_rank} of "
                f"{reg.tp_size}), the params name rank {source.p_rank} of tp_size {r.tp_size} x pp_size {r.pp_size}")
    rank_host = plan.p_endpoint(source.p_rank)[0]
    if not _same_address(reg.segment.rpartition(":")[0], rank_host):
        return (f"its Mooncake segment {reg.segment[:80]!r} is not on the host of P rank {source.p_rank}'s side "
                f"channel ({rank_host!r}); D reads only from the host P named")
    if local.model_fingerprint and reg.model_fingerprint != local.model_fingerprint:
        return (f"model: P serves fingerprint {reg.model_fingerprint or 'none'}, D {local.model_fingerprint} "
                "(the same model on both, vllm_kvp2p/contract/identity.py)")
    if reg.num_blocks <= max((b for ids in plan.remote_block_ids for b in ids), default=-1):
        return f"the params name blocks beyond the {reg.num_blocks} blocks of P rank {reg.rank}"
    if reg.block_size != r.remote_block_size:
        # The plan's token offsets and block pairing were made from the params' block size: P's own must agree.
        return (f"block size: the params say P's blocks hold {r.remote_block_size} tokens, P rank {reg.rank} "
                f"registers blocks of {reg.block_size}")
    if not staged(local, reg) and tuple(reg.layer_names) != tuple(local.layer_names):
        return _layers_problem(reg.layer_names, local.layer_names)
    unknown = unknown_layers_problem(local, reg)
    if unknown:
        return unknown
    if reg.dtype != local.dtype:
        return f"KV cache dtype: P uses {reg.dtype}, D uses {local.dtype}"
    if reg.use_mla != local.use_mla:
        return f"MLA: P {reg.use_mla}, D {local.use_mla}"
    if reg.total_num_kv_heads != local.total_num_kv_heads:
        return f"total KV heads: P has {reg.total_num_kv_heads}, D has {local.total_num_kv_heads}"
    pairs = plane_pairs(local, reg)
    if isinstance(pairs, str):
        return pairs
    p_groups, d_groups = reg.group_of_planes(), local.group_of_planes()
    if len(reg.block_shapes) != len(reg.planes) or len(p_groups) != len(reg.planes):
        return f"it describes {len(reg.planes)} KV planes with {len(reg.block_shapes)} block shapes and " \
               f"{len(p_groups)} group indices"
    if _kinds(reg.kv_groups()) != _kinds(local.kv_groups()) or any(p_groups[q] != d_groups[d] for d, q in pairs):
        return (f"KV-cache groups: P has {_groups_text(reg.kv_groups())}, D has {_groups_text(local.kv_groups())} "
                "(the same model on both, with the hybrid allocator on both or off on both)")
    for i, q in pairs:
        p_sh, d_sh = reg.block_shapes[q], local.shapes[i]
        if p_sh.inner_bytes != d_sh.inner_bytes:
            return f"plane {i}: bytes per head and token: P {p_sh.inner_bytes}, D {d_sh.inner_bytes} (head size)"
        if _interior(p_sh) != _interior(d_sh):
            return (f"plane {i}: block interior: P (block size {reg.block_size}) {p_sh.describe()}, D (block size "
                    f"{local.block_size}) {d_sh.describe()}: the attention kernels lay out a block differently "
                    "(another platform, ISA or dtype; on CPU the ISA also depends on the block size: use the same "
                    "block size on both)")
    if any(g.kind == STATE for g in local.kv_groups()) and reg.tp_size != local.tp_size:
        return (f"tensor parallel size: P {reg.tp_size}, D {local.tp_size}; models with a linear-attention "
                "state need the same on both")
    # Block sizes: the registration's equals the params' (above), which admission checked against D's.
    return ""


def _layers_problem(p_layers: Sequence[str], d_layers: Sequence[str]) -> str:
    """Planes are matched by position, so the layers must be the same, in the same order. A speculative-decoding
    draft model (MTP, EAGLE) adds its attention layers to the KV cache: P fills them during its prefill and D
    needs them, so a P without D's ``--speculative-config`` lacks layers D would otherwise decode from garbage."""
    p_set, d_set = set(p_layers), set(d_layers)  # once: P may send any number of names
    only_d = [n for n in d_layers if n not in p_set]
    only_p = [n for n in p_layers if n not in d_set]
    if not only_d and not only_p:
        return "KV layers: P registers the same layers as D in another order"
    text = f"KV layers: P has {len(p_layers)}, D has {len(d_layers)}"
    for side, names in (("only D", only_d), ("only P", only_p)):
        if names:
            text += f"; {side}: {', '.join(n[:80] for n in names[:3])}{' ...' if len(names) > 3 else ''}"
    return (text + " (a speculative-decoding draft model's layers, MTP or EAGLE, are KV layers too: start P and D "
            "with the same --speculative-config)")


def _same_address(a: str, b: str) -> bool:
    """Two IP addresses, however written (``::1`` and ``0:0::1``); a name is never equal to anything."""
    try:
        return ipaddress.ip_address(a.strip("[]")) == ipaddress.ip_address(b.strip("[]"))
    except ValueError:
        return False


def _interior(shape: BlockShape) -> tuple[object, ...]:
    return (shape.parts, *(shape.part_layout(i) for i in range(shape.parts)))


def _kinds(groups: Sequence[KVGroup]) -> list[tuple[str, int]]:
    """What must match between P and D (block sizes are checked on their own: without HMA they may differ)."""
    return [(g.kind, g.sliding_window) for g in groups]


def _groups_text(groups: Sequence[KVGroup]) -> str:
    return "[" + ", ".join(g.describe() for g in groups) + "]"
