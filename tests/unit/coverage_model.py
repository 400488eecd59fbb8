"""One request through D, on a memory model of both sides (for the coverage property: test_coverage_property.py,
test_coverage_cut_lists.py):

1. P's params are built as P issues them: per group the ids vLLM allocated on P, cut by ``kv_groups.needed_tail``;
2. D's scheduler half (:class:`ConsumerSchedule`) says how many tokens vLLM is told to wait for
   (``matched_tokens``) and plans the pull (``on_alloc``) on the blocks vLLM's allocator gives for that count
   (:func:`d_allocation`);
3. D's worker half (:class:`ConsumerPull`) is driven through registration, claim, reads and releases against a
   registration of every P rank the TP mapping names, and its reads are applied to a memory model of both sides
   in which every byte of P says which (plane, position, KV head, part, element, byte) it is.

:func:`holes` lists the told bytes of D that do not hold the same byte of P, :func:`stray_writes` the bytes written
outside the plan's blocks."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from tests.unit.coverage_scenarios import (
    ELEMENT_BYTES,
    ELEMENTS,
    GARBAGE,
    HOST,
    MAX_HEADS,
    MAX_POS,
    MAX_RANKS,
    NUM_BLOCKS,
    OLD_STATE,
    ROW,
    SPECS,
    STATE_CODE,
    STATE_PAGE,
    UNWRITTEN,
    Scenario,
    part_layout,
    part_offset,
)
from vllm_kvp2p.contract.protocol import ClaimReply, ClaimStatus, RankRegistration
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule, PullPlan
from vllm_kvp2p.lifecycle.pull import (
    ConsumerPull,
    FetchRegistration,
    Finish,
    LocalKV,
    PullResult,
    ReadBatch,
    SendClaim,
    SendRelease,
    SendRenew,
    Source,
)
from vllm_kvp2p.transfer.descriptors import Descriptors, PlaneGeometry
from vllm_kvp2p.transfer.kv_groups import FULL, NULL_BLOCK_ID, SLIDING, STATE, needed_tail, prompt_blocks
from vllm_kvp2p.transfer.slicing import BlockShape
from vllm_kvp2p.transfer.tp_mapping import rank_plan

# ------------------------------------------------------------------------------------------------ vLLM on D


def d_allocation(sc: Scenario, local_hit: int, total: int) -> list[list[tuple[int, int]]]:
    """Per group, the blocks vLLM's allocator hands D for an async load of [local_hit, total), past the hit, in
    token order, null blocks skipped (``get_unhashed_block_ids_all_groups``): (prompt block index, block id).

    Full attention: every block from the hit on. Sliding window: blocks before the window of the next token are
    null (``get_num_skipped_tokens(total) = total - w + 1``). State: nulls up to the one block of the last token
    (``get_num_skipped_tokens = total - 1``)."""
    bs = sc.d_bs
    pool = iter(sc.d_pool)
    out = []
    for g in sc.d_groups:
        hit_blocks = local_hit // bs
        if g.kind == FULL:
            skipped = 0
        elif g.kind == SLIDING:
            skipped = max(0, total - g.sliding_window + 1) // bs
        else:
            skipped = max(0, total - 1) // bs
        for _ in range(max(0, hit_blocks - skipped)):
            next(pool)  # D's own prefix-cache blocks (hashed): not handed to the connector
        first = max(hit_blocks, skipped)
        out.append([(j, next(pool)) for j in range(first, prompt_blocks(total, bs))])
    return out


# ------------------------------------------------------------------------------------------------ memory model


@dataclass
class Side:
    """One rank's KV memory: planes, their block shapes, and per plane the byte offset inside a block of every
    (head, part, token, element, byte) (attention) or every byte of the page (state)."""

    planes: list[PlaneGeometry]
    shapes: list[BlockShape]
    plane_groups: list[int]
    tables: list[np.ndarray | None]  # None: a state page
    head0: int  # global index of the rank's first KV head
    heads: int
    block_size: int
    memory: list[np.ndarray] = field(default_factory=list)  # one int64 code per byte


def attention_table(shape: BlockShape, spec_names: tuple[str, str] | None) -> np.ndarray:
    """Byte offsets in a block, indexed [head, part, token, element, byte]."""
    h, p, t, e, k = np.ix_(range(shape.num_heads), range(shape.parts), range(shape.num_tokens), range(ELEMENTS),
                           range(ELEMENT_BYTES))
    if shape.head_major:
        assert spec_names is not None
        offs = np.array([[[part_offset(SPECS[spec_names[pp]], shape.num_tokens, tt, ee) for ee in range(ELEMENTS)]
                          for tt in range(shape.num_tokens)] for pp in range(shape.parts)])  # [part, token, element]
        table = (h * shape.parts + p) * shape.num_tokens * ROW + offs[None, :, :, :, None] * ELEMENT_BYTES + k
    else:
        table = ((t * shape.num_heads + h) * shape.parts + p) * ROW + e * ELEMENT_BYTES + k
    flat = np.sort(table.ravel())
    assert (flat == np.arange(shape.block_bytes)).all(), "the model's layout is not a permutation of the block"
    return table


def build_side(sc: Scenario, rank: int, tp: int, block_size: int, base: int) -> Side:
    layout = sc.layout(tp)
    heads = layout.heads_per_rank
    planes, shapes, plane_groups, tables = [], [], [], []
    specs = (sc.k_layout, sc.v_layout)
    for g, kind in enumerate(sc.group_kinds):
        for _ in range(sc.layers):
            if kind == STATE:
                layer = [(BlockShape(False, 1, 1, STATE_PAGE), None)]  # as the worker registers a state page
            elif sc.interior == "cpu":
                shape = BlockShape(True, heads, block_size, ROW, parts=2,
                                   layouts=tuple(part_layout(name, block_size) for name in specs))
                layer = [(shape, attention_table(shape, specs))]
            elif sc.interior == "npu":  # K and V tensors apart: two planes of [tokens][heads][head_size]
                shape = BlockShape(False, heads, block_size, ROW)
                layer = [(shape, attention_table(shape, None))] * 2
            else:  # MLA: one latent row per token
                shape = BlockShape(False, 1, block_size, ROW)
                layer = [(shape, attention_table(shape, None))]
            for shape, table in layer:
                nbytes = STATE_PAGE if table is None else shape.block_bytes
                planes.append(PlaneGeometry(base + len(planes) * (1 << 24), nbytes, nbytes, NUM_BLOCKS))
                shapes.append(shape)
                plane_groups.append(g)
                tables.append(table)
    return Side(planes, shapes, plane_groups, tables, layout.heads_of(rank).start, heads, block_size)


def attention_codes(plane: int, first_pos: int, head0: int, table: np.ndarray) -> np.ndarray:
    """What each byte of a block holds (same index as ``table``): plane, position, global head, part, element,
    byte, as one integer."""
    heads, parts, tokens = table.shape[:3]
    h, p, t, e, k = np.ix_(range(heads), range(parts), range(tokens), range(ELEMENTS), range(ELEMENT_BYTES))
    return ((((plane * MAX_POS + first_pos + t) * MAX_HEADS + head0 + h) * 2 + p) * ELEMENTS + e) * ELEMENT_BYTES + k


def state_codes(plane: int, p_rank: int) -> np.ndarray:
    return STATE_CODE + (plane * MAX_RANKS + p_rank) * STATE_PAGE + np.arange(STATE_PAGE)


def describe_code(code: int) -> str:
    code = int(code)
    if code == UNWRITTEN:
        return "never written"
    if code == GARBAGE:
        return "a P byte holding none of the prompt's KV (another block, or past the prompt)"
    if code == OLD_STATE:
        return "an older state checkpoint of P"
    if code >= STATE_CODE:
        rest, byte = divmod(code - STATE_CODE, STATE_PAGE)
        plane, p_rank = divmod(rest, MAX_RANKS)
        return f"state page byte {byte} of plane {plane} on P rank {p_rank}"
    rest, k = divmod(code, ELEMENT_BYTES)
    rest, e = divmod(rest, ELEMENTS)
    rest, part = divmod(rest, 2)
    rest, head = divmod(rest, MAX_HEADS)
    plane, pos = divmod(rest, MAX_POS)
    return f"plane {plane} position {pos} head {head} part {part} element {e} byte {k}"


def fill_p_memory(sc: Scenario, side: Side, p_rank: int) -> None:
    """P's memory: each block of a group's list holds the positions its place in the list says (the list starts at
    the prompt's first block); the running state block holds this rank's state; every other byte is garbage."""
    state_block = {g: needed_tail(grp, sc.p_lists[g], sc.p_tokens)[-1]
                   for g, grp in enumerate(sc.p_groups) if grp.kind == STATE}
    for i, (plane, table, g) in enumerate(zip(side.planes, side.tables, side.plane_groups)):
        mem = np.full(NUM_BLOCKS * plane.block_stride, GARBAGE, dtype=np.int64)
        for index, block in enumerate(sc.p_lists[g]):
            if block == NULL_BLOCK_ID:
                continue
            start = block * plane.block_stride
            if table is None:
                page = state_codes(i, p_rank) if block == state_block[g] else OLD_STATE
                mem[start:start + STATE_PAGE] = page
            else:
                mem[start + table] = attention_codes(i, index * sc.p_bs, side.head0, table)
        side.memory.append(mem)


def apply_reads(d: Side, p_sides: dict[int, Side], reads: list[tuple[int, Descriptors]]) -> list[np.ndarray]:
    """Carry the reads out on the model (each descriptor must stay inside one plane on each side); returns which
    bytes of D were written, per plane."""
    written = [np.zeros(len(m), dtype=bool) for m in d.memory]

    def locate(side: Side, addr: int, n: int, what: str) -> tuple[int, int]:
        for i, plane in enumerate(side.planes):
            end = plane.base_addr + plane.num_blocks * plane.block_stride
            if plane.base_addr <= addr and addr + n <= end:
                return i, addr - plane.base_addr
        raise AssertionError(f"{what} run [{addr:#x}, +{n}) is not inside one plane")

    for p_rank, desc in reads:
        p = p_sides[p_rank]
        for la, ra, n in zip(desc.local_addrs, desc.remote_addrs, desc.lengths):
            assert n > 0
            li, lo = locate(d, la, n, "D")
            ri, ro = locate(p, ra, n, f"P rank {p_rank}")
            d.memory[li][lo:lo + n] = p.memory[ri][ro:ro + n]
            written[li][lo:lo + n] = True
    return written


# ------------------------------------------------------------------------------------------------ D's two halves


def registration(sc: Scenario, side: Side, p_rank: int) -> RankRegistration:
    return RankRegistration(
        "P", p_rank, sc.p_tp, f"{HOST}:{17000 + p_rank}", side.planes, side.shapes,
        [f"layer{i}" for i in range(len(sc.group_kinds) * sc.layers)], sc.p_bs, NUM_BLOCKS, "float32",
        side.heads, sc.heads, ELEMENTS, use_mla=sc.mla, groups=list(sc.p_groups), plane_groups=side.plane_groups,
    )


def local_kv(sc: Scenario, side: Side) -> LocalKV:
    return LocalKV(tuple(side.planes), tuple(side.shapes), sc.d_bs,
                   tuple(f"layer{i}" for i in range(len(sc.group_kinds) * sc.layers)), "float32", sc.heads,
                   use_mla=sc.mla, groups=sc.d_groups, plane_groups=tuple(side.plane_groups), tp_size=sc.d_tp)


def drive(job: ConsumerPull, registrations: dict[int, RankRegistration]) -> tuple[PullResult, list, list[int]]:
    """Run the pull state machine against P ranks that answer everything: every read succeeds. Returns the
    result, the reads (P rank, descriptors) and the P ranks released."""
    reads: list[tuple[int, Descriptors]] = []
    released: list[int] = []
    granted = ClaimReply(ClaimStatus.GRANTED, lease=1e9, lease_token="lease")
    for _ in range(100_000):
        action = job.next_action(0.0)
        if isinstance(action, Finish):
            return action.result, reads, released
        q = action.source.p_rank
        if isinstance(action, FetchRegistration):
            job.on_registration(action.source, registrations[q])
        elif isinstance(action, SendClaim):
            job.on_claim_reply(action.source, granted, now=0.0)
        elif isinstance(action, ReadBatch):
            assert action.segment == registrations[q].segment
            reads.append((q, action.descriptors))
            job.on_batch_done(action.source, True)
        elif isinstance(action, SendRenew):
            job.on_renewed(action.source, granted, now=0.0)
        elif isinstance(action, SendRelease):
            released.append(q)
            job.on_release_sent(action.source, True)
        else:
            raise AssertionError(f"unexpected action {action}")
    raise AssertionError("the pull never finished")


@dataclass
class Run:
    """One request through D: what vLLM was told and what the pull did."""

    matched: int
    external: int  # tokens vLLM registers as loaded once the receive is finished
    plan: PullPlan | None
    allocation: list[list[tuple[int, int]]]
    result: PullResult | None = None
    d: Side | None = None
    written: list[np.ndarray] | None = None
    reads: list[tuple[int, Descriptors]] = field(default_factory=list)
    released: list[int] = field(default_factory=list)

    @property
    def told_loaded(self) -> bool:
        """vLLM marks the external tokens computed: a finished receive it is not told failed."""
        return (self.result is not None and self.external > 0 and self.result.report_finished
                and not self.result.report_failed)


def run(sc: Scenario, params: dict | None = None) -> Run:
    params = sc.params() if params is None else params
    sched = ConsumerSchedule(sc.d_bs, sc.d_groups)
    pr, hit = sc.prompt, sc.local_hit
    matched, load_async = sched.matched_tokens("d1", params, pr, hit)
    assert sched.matched_tokens("d1", params, pr, hit) == (matched, load_async)  # pure
    external = matched
    if sc.vllm_trims and matched > 0:
        external = matched - matched % sc.d_bs  # vLLM may keep only whole blocks of what the connector offers
    allocation = d_allocation(sc, hit, hit + external) if external > 0 else []
    plan = sched.on_alloc("d1", params, external, [[b for _, b in g] for g in allocation], hit, pr)
    out = Run(matched, external, plan, allocation)
    if plan is None:
        return out
    d = build_side(sc, sc.d_rank, sc.d_tp, sc.d_bs, 1 << 44)
    d.memory = [np.full(NUM_BLOCKS * p.block_stride, UNWRITTEN, dtype=np.int64) for p in d.planes]
    mapping = rank_plan(sc.layout(sc.p_tp), sc.layout(sc.d_tp), sc.d_rank)
    sources = [Source(q, mapping.expected_readers[q], tuple(s for s in mapping.reads if s.p_rank == q))
               for q in mapping.p_ranks]
    p_sides = {}
    for q in range(sc.p_tp):
        p_sides[q] = build_side(sc, q, sc.p_tp, sc.p_bs, (1 + q) << 36)
        fill_p_memory(sc, p_sides[q], q)
    registrations = {q: registration(sc, side, q) for q, side in p_sides.items()}
    job = ConsumerPull(plan, sources, f"D:{sc.d_rank}", local_kv(sc, d), claim_wait=1.0,
                       max_batch_entries=sc.max_batch, now=0.0)
    out.result, out.reads, out.released = drive(job, registrations)
    out.d, out.written = d, apply_reads(d, p_sides, out.reads)
    return out


def holes(sc: Scenario, r: Run, limit: int = 1) -> list[str]:
    """Told bytes of this D rank that do not hold the same byte of P (empty: the rule holds)."""
    assert r.d is not None
    d, lo, hi = r.d, sc.local_hit, sc.local_hit + r.external
    found: list[str] = []
    for i, (plane, table, g) in enumerate(zip(d.planes, d.tables, d.plane_groups)):
        mem = d.memory[i]
        for j, block in r.allocation[g]:  # every block vLLM gave this group (all of them hold told positions)
            start = block * plane.block_stride
            if table is None:
                got, want = mem[start:start + STATE_PAGE], state_codes(i, sc.d_rank)
                bad = np.argwhere(got != want)
                for (byte,) in bad[:limit - len(found)]:
                    found.append(f"state plane {i} D block {block} byte {byte}: holds {describe_code(got[byte])}, "
                                 f"not {describe_code(want[byte])}")
            else:
                got, want = mem[start + table], attention_codes(i, j * sc.d_bs, d.head0, table)
                positions = j * sc.d_bs + np.arange(sc.d_bs)
                told = (positions >= lo) & (positions < hi)
                bad = np.argwhere((got != want) & told[None, None, :, None, None])
                for h, p, t, e, k in bad[:limit - len(found)]:
                    found.append(
                        f"plane {i} (group {g}, {sc.group_kinds[g]}) D block {block} token {t} (position "
                        f"{j * sc.d_bs + t}) head {h} (global {d.head0 + h}) part {p} element {e} byte {k}: holds "
                        f"{describe_code(got[h, p, t, e, k])}, not {describe_code(want[h, p, t, e, k])}")
            if len(found) >= limit:
                return found
    return found


def stray_writes(r: Run) -> list[str]:
    """Bytes of D written outside the plan's blocks of the plane's group."""
    assert r.d is not None and r.written is not None and r.plan is not None
    out = []
    for i, (plane, g) in enumerate(zip(r.d.planes, r.d.plane_groups)):
        allowed = np.zeros(len(r.written[i]), dtype=bool)
        ids = r.plan.local_block_ids[g] if g < len(r.plan.local_block_ids) else ()
        for b in ids:
            allowed[b * plane.block_stride:(b + 1) * plane.block_stride] = True
        stray = np.flatnonzero(r.written[i] & ~allowed)
        if len(stray):
            out.append(f"plane {i}: {len(stray)} bytes written outside the plan's blocks, first in block "
                       f"{stray[0] // plane.block_stride}")
    return out


def interiors_match(sc: Scenario) -> bool:
    """The CPU kernel lays a part out the same at both block sizes (else P's registration is refused)."""
    if sc.interior != "cpu":
        return True
    return all(part_layout(n, sc.p_bs) == part_layout(n, sc.d_bs) for n in (sc.k_layout, sc.v_layout))
