"""Which P ranks each D rank reads, as a pure function of both sides' parallel layout.

Computed once per remote engine layout. Today: equal TP sizes (D rank r reads P rank r). Heterogeneous TP, MLA
and head-slice placement extend :func:`read_sources` (issue "Parallelism"); every caller already handles a list.
"""

from __future__ import annotations

from functools import lru_cache

from vllm_kvp2p.lifecycle.consumer import Source


class UnsupportedLayout(ValueError):
    """P and D parallel layouts this connector cannot pair (yet)."""


@lru_cache(maxsize=256)
def read_sources(p_tp_size: int, d_tp_size: int, d_tp_rank: int) -> tuple[Source, ...]:
    if p_tp_size < 1 or d_tp_size < 1 or not 0 <= d_tp_rank < d_tp_size:
        raise UnsupportedLayout(f"invalid layout: P tp={p_tp_size}, D tp={d_tp_size}, D rank={d_tp_rank}")
    if p_tp_size == d_tp_size:
        return (Source(p_rank=d_tp_rank, expected_readers=1),)
    raise UnsupportedLayout(
        f"P tensor_parallel_size={p_tp_size} and D tensor_parallel_size={d_tp_size} differ; "
        "this version pairs equal TP sizes only"
    )
