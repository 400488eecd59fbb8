#!/usr/bin/env python
"""What a peer's side-channel reply can cost D to decode, within the wire's bounds (not a test).

    python benchmarks/bench_peer_messages.py [--json out.json]

D decodes P's replies (registrations, rank tables, claim replies, integrity sums) on a pull thread of the worker
process that holds the model, with the GIL held. This prints:

1. the encoded size of the registration of each of the largest real models (protocol.py's table), plain and sealed
   with the shared secret: what sized ``side_channel.MAX_REPLY_BYTES``;
2. the encoded size of the largest message each bound of protocol.py still lets through (a registration at every
   bound, a rank table of ``MAX_ENGINE_RANKS`` ranks, an answer of ``MAX_DIGEST_UNITS`` sums);
3. decode time and memory (tracemalloc's peak: every object msgspec builds) of the costliest reply a peer can send,
   before (no bound in the types, replies up to 64 MiB) and now (the types' bounds and ``MAX_REPLY_BYTES``):
   planes and layer names, the elements a registration has most of, and, now, a block shape's ``layouts`` padded
   past their bound (refused while decoding, as every list over its bound);
4. the time to refuse a reply over the bounds (the refusal reads a list's length before any of its items).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
import tracemalloc
from collections.abc import Callable

import msgspec

from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import (
    MAX_DIGEST_UNITS,
    MAX_ENGINE_RANKS,
    MAX_HOST_LENGTH,
    MAX_KV_GROUPS,
    MAX_KV_LAYERS,
    MAX_LAYER_NAME_LENGTH,
    MAX_PLANES,
    RankEndpoint,
    RankRegistration,
    RankTable,
    Registration,
    Released,
    UnitSums,
)
from vllm_kvp2p.contract.side_channel import MAX_REPLY_BYTES, MAX_REQUEST_BYTES
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.interior import MAX_LAYOUT_DIGEST_LENGTH, PartLayout
from vllm_kvp2p.transfer.kv_groups import FULL, SLIDING, STATE, KVGroup
from vllm_kvp2p.transfer.slicing import MAX_PARTS, BlockShape

MIB = 1 << 20
OLD_MAX_REPLY_BYTES = 64 << 20  # side_channel.MAX_REPLY_BYTES before

# A real CPU block interior, the most bytes a plane's shape takes: K in column groups, a tile digest (vLLM CPU).
CPU_LAYOUTS = (PartLayout(1, 16, 2, "16x8:0123456789abcdef"), PartLayout())
BASE = 0x7F3A_0000_0000  # a 47-bit user-space address


def real_registration(name: str, layers: int, planes_per_layer: int, groups: list[KVGroup], *, mla: bool = False,
                      heads: int = 8, head_size: int = 128, prefix: str = "model.layers") -> RankRegistration:
    """A registration shaped as the model's would be at PP 1 (the most layers one rank registers): real layer names,
    48-bit addresses, a block of 128 tokens, 2 million blocks (8-byte numbers everywhere)."""
    n = layers * planes_per_layer
    block_bytes = 128 * (576 * 2 if mla else heads * head_size * 2 * 2 // planes_per_layer)
    planes = [PlaneGeometry(BASE + i * (1 << 36), block_bytes, block_bytes, 2_000_000) for i in range(n)]
    shape = BlockShape(False, 1, 128, 1152) if mla else BlockShape(True, heads, 128, head_size * 2, 2, CPU_LAYOUTS)
    return RankRegistration(
        f"{name}-prefill-0123456789abcdef", 7, 8, "fd12:3456:789a:1::1234:16001", planes, [shape] * n,
        [f"{prefix}.{i}.self_attn.attn" for i in range(layers)], 128, 2_000_000, "bfloat16", 1 if mla else heads,
        1 if mla else heads * 8, 576 if mla else head_size, use_mla=mla, groups=groups,
        plane_groups=[(i // planes_per_layer) % len(groups) for i in range(n)],
        incarnation="0123456789abcdef0123456789abcdef", model_fingerprint="fedcba9876543210", pp_rank=0, pp_size=1,
        plane_layers=[i // planes_per_layer for i in range(n)],
    )


REAL = {
    "Llama-3.1-405B (126 layers x K, V)": lambda: real_registration("llama405b", 126, 2, [KVGroup(FULL, 128)]),
    "Qwen3-235B-A22B (94 x 2)": lambda: real_registration("qwen3-235b", 94, 2, [KVGroup(FULL, 128)], heads=4),
    "DeepSeek-V3/R1 (61 + 1 MTP, MLA)": lambda: real_registration("dsv3", 62, 1, [KVGroup(FULL, 128)], mla=True),
    "DeepSeek-V3.2 on vllm-ascend (62 x 3)": lambda: real_registration("dsv32", 62, 3, [KVGroup(FULL, 128)], mla=True),
    "Nemotron-H-56B (118 x 2, hybrid)": lambda: real_registration(
        "nemotronh", 118, 2, [KVGroup(STATE, 128)] * 9 + [KVGroup(FULL, 128)], prefix="backbone.layers"),
    "Qwen3-Next-80B (48 x 2, 4 groups)": lambda: real_registration(
        "qwen3next", 48, 2, [KVGroup(STATE, 128)] * 3 + [KVGroup(FULL, 128)]),
    "Gemma-3-27B (62 x 2, 2 groups)": lambda: real_registration(
        "gemma3", 62, 2, [KVGroup(SLIDING, 128, 1024), KVGroup(FULL, 128)], prefix="language_model.model.layers"),
    "Llama-3.1-405B + EAGLE draft, vLLM CPU names": lambda: real_registration(
        "llama405b-eagle", 127, 2, [KVGroup(FULL, 128)], prefix="language_model.model.layers"),
}


def at_every_bound() -> RankRegistration:
    """The biggest registration the types accept: every list at its bound, every text at its length."""
    big = 1 << 62
    planes = [PlaneGeometry(big, big, big, big)] * MAX_PLANES
    shape = BlockShape(True, 1 << 16, 1 << 20, 1 << 40, MAX_PARTS,
                       (PartLayout(1 << 20, 1 << 20, 64, "o" * MAX_LAYOUT_DIGEST_LENGTH),) * MAX_PARTS)
    return RankRegistration(
        "e" * 256, 1023, 1024, "h" * (MAX_HOST_LENGTH + 8), planes, [shape] * MAX_PLANES,
        ["n" * MAX_LAYER_NAME_LENGTH] * MAX_KV_LAYERS, 1 << 20, big, "d" * 64, 1 << 16, 1 << 16, 1 << 16,
        protocol_version=big, groups=[KVGroup(SLIDING, 1 << 20, 1 << 40)] * MAX_KV_GROUPS,
        plane_groups=[MAX_KV_GROUPS - 1] * MAX_PLANES, incarnation="i" * 256, model_fingerprint="f" * 256,
        pp_rank=63, pp_size=64, plane_layers=[MAX_KV_LAYERS - 1] * MAX_PLANES,
    )


# --------------------------------------------------------------------------- the types as they were (no bounds)


class OldRankRegistration(msgspec.Struct, frozen=True):
    engine_id: str
    tp_rank: int
    tp_size: int
    segment: str
    planes: list[PlaneGeometry]
    block_shapes: list[BlockShape]
    layer_names: list[str]
    block_size: int
    num_blocks: int
    dtype: str
    num_kv_heads: int
    total_num_kv_heads: int
    head_size: int


class OldRegistration(msgspec.Struct, frozen=True, tag="registration"):
    registration: OldRankRegistration


def flood(planes: int, names: int, name: str = "") -> bytes:
    """A registration reply of ``planes`` planes and ``names`` layer names, smallest encoding of each (1-byte
    ints, 1-byte names), as a peer that wants the most objects per byte sends it."""
    reg = {"engine_id": "P", "tp_rank": 0, "tp_size": 1, "segment": "1.2.3.4:1", "planes": [[0, 0, 0, 0]] * planes,
           "block_shapes": [], "layer_names": [name] * names, "block_size": 16, "num_blocks": 1, "dtype": "f",
           "num_kv_heads": 1, "total_num_kv_heads": 1, "head_size": 1}
    return msgspec.msgpack.encode({"type": "registration", "registration": reg})


def layouts_flood(size: int) -> bytes:
    """Now: a registration within every other bound of the types, padded to ``size`` bytes with one block shape's
    ``layouts`` (5 bytes a PartLayout), past their bound of two."""
    head = {"engine_id": "P", "tp_rank": 0, "tp_size": 1, "segment": "1.2.3.4:1", "planes": [[0, 0, 0, 0]],
            "layer_names": ["l"], "block_size": 16, "num_blocks": 1, "dtype": "f", "num_kv_heads": 1,
            "total_num_kv_heads": 1, "head_size": 1}
    probe = msgspec.msgpack.encode({"type": "registration", "registration": {
        **head, "block_shapes": [[True, 1, 16, 1, 1, []]]}})
    count = (size - len(probe) - 5) // 5
    return msgspec.msgpack.encode({"type": "registration", "registration": {
        **head, "block_shapes": [[True, 1, 16, 1, 1, [[0, 1, 0, ""]] * count]]}})


def decode_cost(decode: Callable[[bytes], object], data: bytes) -> dict[str, object]:
    """Median decode time of 3 runs, and tracemalloc's peak during one (what the decoded reply holds at once)."""
    times, outcome = [], "decoded"
    for _ in range(3):
        t0 = time.perf_counter()
        try:
            decode(data)
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            outcome = f"refused: {str(exc)[:70]}"
        times.append(time.perf_counter() - t0)
    tracemalloc.start()
    try:
        decode(data)
    except (msgspec.ValidationError, msgspec.DecodeError):
        pass
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"bytes": len(data), "ms": statistics.median(times) * 1e3, "peak_mib": peak / MIB, "outcome": outcome}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--json", help="write the figures here")
    args = parser.parse_args()
    auth = Authenticator(b"benchmark-secret-0123456789abcdef", 30)
    out: dict[str, object] = {"max_reply_bytes": MAX_REPLY_BYTES}

    print(f"1. real registrations, encoded (MAX_REPLY_BYTES = {MAX_REPLY_BYTES} B = {MAX_REPLY_BYTES / MIB:g} MiB)")
    real = {}
    for name, make in REAL.items():
        reg = make()
        data = protocol.encode(Registration(reg))
        sealed = len(auth.seal_reply(data, b"n" * 16, 0))
        assert protocol.decode_reply(data) == Registration(reg)  # within every bound
        real[name] = {"planes": len(reg.planes), "layers": len(reg.layer_names), "bytes": len(data), "sealed": sealed}
        print(f"   {name:46s} {len(reg.planes):4d} planes {len(data):7,d} B (sealed {sealed:7,d} B)")
    largest = max(v["sealed"] for v in real.values())
    print(f"   largest: {largest:,} B sealed; MAX_REPLY_BYTES is {MAX_REPLY_BYTES / largest:.0f}x that")
    out["real"] = real

    print("2. the largest message each bound lets through, encoded")
    bounded = {
        "registration at every bound": Registration(at_every_bound()),
        f"rank table of {MAX_ENGINE_RANKS} ranks, hosts of {MAX_HOST_LENGTH} chars": RankTable(
            "e" * 256, "i" * 256, [RankEndpoint(r, "h" * MAX_HOST_LENGTH, 65535) for r in range(MAX_ENGINE_RANKS)]),
        f"rank table of {MAX_ENGINE_RANKS} ranks, IPv6 hosts (real)": RankTable(
            "e" * 40, "i" * 32, [RankEndpoint(r, f"fd12:3456:789a:{r:x}::1", 16001) for r in range(MAX_ENGINE_RANKS)]),
        f"integrity answer of {MAX_DIGEST_UNITS} sums": Released(True, [UnitSums((1 << 63) - 1, (1 << 63) - 1)]
                                                                 * MAX_DIGEST_UNITS),
    }
    out["bounded"] = {}
    for name, message in bounded.items():
        data = protocol.encode(message)
        cost = decode_cost(protocol.decode_reply, data)
        assert cost["outcome"] == "decoded", cost
        out["bounded"][name] = cost
        print(f"   {name:46s} {len(data):9,d} B, decoded in {cost['ms']:6.2f} ms, peak {cost['peak_mib']:6.2f} MiB")

    print(f"   requests P decodes (frame bound side_channel.MAX_REQUEST_BYTES = {MAX_REQUEST_BYTES >> 10} KiB)")
    reader = "r" * protocol.MAX_READER_LENGTH
    ids = "i" * protocol.MAX_ID_LENGTH
    one_unit = protocol.UnitRanges(1 << 30, 1 << 30, [])
    requests = {
        "claim at every bound": protocol.Claim(ids, ids, reader, 1 << 62, ids, True, 1 << 62),
        "release + question of 4096 units (no ranges)": protocol.Release(
            ids, ids, reader, 1, True, ids, protocol.DigestQuery([one_unit] * MAX_DIGEST_UNITS)),
        "release + question of 1-byte ranges, frame-full": protocol.Release(
            "r", "h", "d:0", 1, True, "t", protocol.DigestQuery([protocol.UnitRanges(0, 0, [0] * (
                MAX_REQUEST_BYTES - 128))])),
    }
    out["requests"] = {}
    for name, message in requests.items():
        data = protocol.encode(message)
        cost = decode_cost(protocol.decode_request, data)
        assert cost["outcome"] == "decoded" and len(data) <= MAX_REQUEST_BYTES, (name, len(data), cost)
        out["requests"][name] = cost
        print(f"   {name:46s} {len(data):9,d} B, decoded in {cost['ms']:6.2f} ms, peak {cost['peak_mib']:6.2f} MiB")

    print("3. the costliest reply a peer can send D")
    old_decoder = msgspec.msgpack.Decoder(OldRegistration)
    cases = {
        # The finding of issue 37: 25.6 MiB, 1.7 million planes and 4.2 million layer names.
        "before: the finding, 1.7 M planes + 4.2 M names": (old_decoder.decode, flood(1_700_000, 4_200_000)),
        "before: 64 MiB of planes (the old frame bound)": (old_decoder.decode,
                                                           flood((OLD_MAX_REPLY_BYTES - 200) // 5, 0)),
        "now: the same reply": (protocol.decode_reply, flood(1_700_000, 4_200_000)),
        f"now: {MAX_PLANES} planes + {MAX_KV_LAYERS} names, 1 over": (protocol.decode_reply,
                                                                       flood(MAX_PLANES + 1, MAX_KV_LAYERS)),
        f"now: {MAX_PLANES} planes + {MAX_KV_LAYERS} names": (protocol.decode_reply,
                                                               flood(MAX_PLANES, MAX_KV_LAYERS, "n" * 256)),
        f"now: {MAX_REPLY_BYTES / MIB:g} MiB of BlockShape.layouts (over their bound)": (protocol.decode_reply,
                                                                                    layouts_flood(MAX_REPLY_BYTES)),
    }
    out["flood"] = {}
    for name, (decode, data) in cases.items():
        cost = decode_cost(decode, data)
        if name.startswith("now") and len(data) > MAX_REPLY_BYTES:
            cost["outcome"] = f"dropped by ZMQ (over MAX_REPLY_BYTES), never decoded; the types: {cost['outcome']}"
        out["flood"][name] = cost
        print(f"   {name:46s} {len(data) / MIB:7.2f} MiB: {cost['ms']:8.2f} ms, peak {cost['peak_mib']:8.2f} MiB, "
              f"{cost['outcome']}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
