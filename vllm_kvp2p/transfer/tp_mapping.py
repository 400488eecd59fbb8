"""Which P ranks each D rank reads, and which KV heads, as a pure function of both sides' parallel layout.

Both sides compute the same answer from information they share (TP sizes, total KV heads, MLA or not), so P
knows how many D readers to wait for without another message, and every P rank that holds a request's blocks is
released by exactly the D ranks the mapping names.

* GQA/MHA, ``tp <= total_kv_heads``: rank r holds heads ``[r*K/tp, (r+1)*K/tp)``.
* ``tp > total_kv_heads``: heads are replicated; rank r holds head ``r // (tp/K)``. A D rank reading a replicated
  head picks replica ``d_rank % replicas`` (deterministic, spreads D ranks over replicas).
* MLA: every rank holds the whole latent cache; D rank d reads P rank ``d % p_tp`` only.
* P ranks nobody reads still hold the request's blocks: D rank ``p % d_tp`` sends them a release ("notify").
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache


class UnsupportedLayout(ValueError):
    """P and D parallel layouts this connector cannot pair."""


@dataclass(frozen=True)
class HeadSlice:
    """Read heads ``[remote_head, remote_head + num_heads)`` of P rank ``p_rank`` (numbered within that rank)
    into heads ``[local_head, local_head + num_heads)`` of this D rank."""

    p_rank: int
    remote_head: int
    local_head: int
    num_heads: int


@dataclass(frozen=True)
class RankPlan:
    """Everything one D rank does against one P instance."""

    reads: tuple[HeadSlice, ...]
    notify: tuple[int, ...]  # P ranks this D rank only releases
    expected_readers: dict[int, int]  # P rank -> number of D ranks that read or notify it (same on every D rank)

    @property
    def p_ranks(self) -> tuple[int, ...]:
        """P ranks this D rank talks to, in order: the ones it reads, then the ones it only notifies."""
        seen: list[int] = []
        for s in self.reads:
            if s.p_rank not in seen:
                seen.append(s.p_rank)
        return (*seen, *(p for p in self.notify if p not in seen))


@dataclass(frozen=True)
class Layout:
    tp_size: int
    total_kv_heads: int
    use_mla: bool = False

    def __post_init__(self) -> None:
        if self.tp_size < 1 or self.total_kv_heads < 1:
            raise UnsupportedLayout(f"invalid layout {self}")
        k, tp = self.total_kv_heads, self.tp_size
        if not self.use_mla and (k % tp if tp <= k else tp % k):
            raise UnsupportedLayout(
                f"tensor_parallel_size={tp} and {k} KV heads: one must divide the other"
            )

    @property
    def heads_per_rank(self) -> int:
        return 1 if self.use_mla else max(1, self.total_kv_heads // self.tp_size)

    def heads_of(self, rank: int) -> range:
        """Global KV heads held by ``rank``."""
        if self.use_mla:
            return range(1)
        k, tp = self.total_kv_heads, self.tp_size
        if tp <= k:
            n = k // tp
            return range(rank * n, (rank + 1) * n)
        head = rank // (tp // k)
        return range(head, head + 1)

    def holders_of(self, head: int) -> list[int]:
        """P ranks holding global head ``head``."""
        if self.use_mla:
            return list(range(self.tp_size))
        k, tp = self.total_kv_heads, self.tp_size
        if tp <= k:
            return [head // (k // tp)]
        r = tp // k
        return list(range(head * r, (head + 1) * r))


@lru_cache(maxsize=1024)
def rank_plan(p: Layout, d: Layout, d_rank: int) -> RankPlan:
    """What D rank ``d_rank`` reads from (and notifies on) a P instance of layout ``p``."""
    if p.use_mla != d.use_mla:
        raise UnsupportedLayout(f"MLA on P is {p.use_mla}, on D {d.use_mla}")
    if not p.use_mla and p.total_kv_heads != d.total_kv_heads:
        raise UnsupportedLayout(f"total KV heads differ: P has {p.total_kv_heads}, D has {d.total_kv_heads}")
    if not 0 <= d_rank < d.tp_size:
        raise UnsupportedLayout(f"D rank {d_rank} outside tensor_parallel_size={d.tp_size}")
    all_reads = {r: _reads(p, d, r) for r in range(d.tp_size)}
    read_by: dict[int, set[int]] = {q: set() for q in range(p.tp_size)}
    for r, slices in all_reads.items():
        for s in slices:
            read_by[s.p_rank].add(r)
    notify_by = {q: q % d.tp_size for q in range(p.tp_size) if not read_by[q]}
    expected = {q: len(read_by[q]) + (1 if q in notify_by else 0) for q in range(p.tp_size)}
    notify = tuple(q for q, r in notify_by.items() if r == d_rank)
    return RankPlan(all_reads[d_rank], notify, expected)


def _reads(p: Layout, d: Layout, d_rank: int) -> tuple[HeadSlice, ...]:
    if p.use_mla:
        return (HeadSlice(d_rank % p.tp_size, 0, 0, 1),)
    slices: list[HeadSlice] = []
    local_heads = d.heads_of(d_rank)
    for local, head in enumerate(local_heads):
        holders = p.holders_of(head)
        q = holders[d_rank % len(holders)]
        remote = head - p.heads_of(q).start
        last = slices[-1] if slices else None
        if last and last.p_rank == q and last.remote_head + last.num_heads == remote \
                and last.local_head + last.num_heads == local:
            slices[-1] = HeadSlice(q, last.remote_head, last.local_head, last.num_heads + 1)
        else:
            slices.append(HeadSlice(q, remote, local, 1))
    return tuple(slices)
