#!/usr/bin/env python
"""What a pull between block sizes costs in descriptors on CPU (not a test).

    python benchmarks/bench_block_sizes.py [--tokens 1024] [--layers 32] [--heads 8] [--head-size 128]

Builds, in this process, the descriptors of one pull of ``--tokens`` tokens from P blocks of 32 into D blocks of 64
(``build_sliced_descriptors``, what a D pull thread runs), for the block layouts vLLM's CPU kernel writes: float32
on the ``vec`` ISA (each head's K element-major, V rows) and bfloat16 on ``amx`` (K in 16-token tiles, V in groups
of 16 elements with tokens in pairs), next to equal block sizes (whole blocks, merged). Prints the descriptor count
and the build time.
"""

from __future__ import annotations

import argparse
import time

from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.interior import ROWS, PartLayout
from vllm_kvp2p.transfer.slicing import BlockShape, build_sliced_descriptors, token_chunks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=1024)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--head-size", type=int, default=128)
    args = parser.parse_args()
    cases = [
        ("float32, vec (K element-major)", 4, 32, 64,
         (PartLayout(group=1, tile=1, element_bytes=4), ROWS)),
        ("bfloat16, amx (K 16-token tiles)", 2, 32, 64,
         (PartLayout(group=0, tile=16, element_bytes=2, digest="k"), PartLayout(group=16, tile=2, element_bytes=2,
                                                                                digest="v"))),
        ("equal block sizes (whole blocks)", 4, 64, 64, (PartLayout(group=1, tile=1, element_bytes=4), ROWS)),
    ]
    for label, element, p_bs, d_bs, layouts in cases:
        p_shape = BlockShape(True, args.heads, p_bs, args.head_size * element, parts=2, layouts=layouts)
        d_shape = BlockShape(True, args.heads, d_bs, args.head_size * element, parts=2, layouts=layouts)
        p_planes = [PlaneGeometry((1 << 32) + i * (1 << 30), p_shape.block_bytes, p_shape.block_bytes, 4096)
                    for i in range(args.layers)]
        d_planes = [PlaneGeometry((1 << 44) + i * (1 << 30), d_shape.block_bytes, d_shape.block_bytes, 4096)
                    for i in range(args.layers)]
        chunks = token_chunks(list(range(1, args.tokens // d_bs + 1)), d_bs, list(range(1, args.tokens // p_bs + 1)),
                              p_bs, 0)
        t0 = time.perf_counter()
        built = build_sliced_descriptors(d_planes, [d_shape] * args.layers, p_planes, [p_shape] * args.layers, chunks,
                                         0, 0, args.heads)
        print(f"{label:36} P {p_bs} -> D {d_bs}: {len(built):>9,} descriptors, {time.perf_counter() - t0:.2f} s")


if __name__ == "__main__":
    main()
