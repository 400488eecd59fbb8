"""The generated P/D pairs of the coverage property (test_coverage_property.py, test_coverage_cut_lists.py): block
sizes, TP sizes, KV heads or MLA, KV-cache groups (one full group, full + sliding window, full + linear-attention
state, sliding windows only), block interiors (vLLM CPU's head-major ``[heads][K, V][tokens]`` with its part
layouts, token-major rows as on NPU, MLA latent rows), prompts and D's local prefix-cache hits, and P's block lists
as vLLM holds them when the prefill ends."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from hypothesis import strategies as st

from tests.support.prompts import prompt, remote
from vllm_kvp2p.lifecycle.admission import Prompt
from vllm_kvp2p.transfer.interior import PartLayout, classify
from vllm_kvp2p.transfer.kv_groups import (
    FULL,
    NULL_BLOCK_ID,
    SLIDING,
    STATE,
    KVGroup,
    needed_count,
    needed_tail,
    prompt_blocks,
)
from vllm_kvp2p.transfer.tp_mapping import Layout

ELEMENTS, ELEMENT_BYTES = 2, 2  # a head's part row: 2 elements of 2 bytes (tiny head dims)
ROW = ELEMENTS * ELEMENT_BYTES
STATE_PAGE = 24  # bytes of one linear-attention state page
NUM_BLOCKS = 72  # blocks per plane on every rank (id 0 is vLLM's null block)
MAX_POS, MAX_HEADS, MAX_RANKS = 256, 8, 8
STATE_CODE = 1 << 40  # state page bytes are coded from here; attention bytes below; unwritten / garbage < 0
UNWRITTEN, GARBAGE, OLD_STATE = -1, -2, -3
HOST = "127.0.0.1"

BLOCK_SIZES = (4, 8, 12, 16, 24, 32)
BS_PAIRS = tuple((p, d) for p in BLOCK_SIZES for d in BLOCK_SIZES if p % d == 0 or d % p == 0)
KINDS = ("full", "full+sliding", "full+state", "sliding")

# How one part (K or V) of a head's block lays out tokens x elements, as (column group, token tile, order inside a
# tile): the formula of vllm_kvp2p/transfer/interior.py. Offsets are in elements from the part's start.
SPECS: dict[str, tuple[int, int, list[list[int]]]] = {
    "rows": (ELEMENTS, 1, [list(range(ELEMENTS))]),  # V on vLLM CPU's vec ISA; NPU; MLA
    "element-major": (1, 1, [[0]]),  # K on the vec ISA: [head_size][tokens]
    "tiles16": (ELEMENTS, 16, [[e * 16 + t for e in range(ELEMENTS)] for t in range(16)]),  # AMX K: 16-token tiles
    "pairs": (ELEMENTS, 2, [[e * 2 + t for e in range(ELEMENTS)] for t in range(2)]),  # AMX V: tokens in pairs
}


def part_offset(spec: tuple[int, int, list[list[int]]], block: int, token: int, element: int) -> int:
    group, tile, inside = spec
    return (element // group) * block * group + (token // tile) * tile * group + inside[token % tile][element % group]


def part_layout(name: str, block: int) -> PartLayout:
    """The layout as the CPU platform finds it from the offsets its kernel wrote (classify, per block size)."""
    spec = SPECS[name]
    return classify([[part_offset(spec, block, t, e) for e in range(ELEMENTS)] for t in range(block)], ELEMENT_BYTES)


# ------------------------------------------------------------------------------------------------ scenarios


@dataclass(frozen=True)
class Scenario:
    kind: str
    windows: tuple[int, ...]  # per group (0 unless sliding)
    p_bs: int
    d_bs: int
    p_tp: int
    d_tp: int
    heads: int  # total KV heads (1 with MLA)
    mla: bool
    interior: str  # "cpu" (head-major, K and V parts), "npu" (token-major K and V planes), "mla" (latent rows)
    k_layout: str
    v_layout: str
    layers: int  # per group
    prompt_len: int
    local_hit: int  # D's prefix-cache hit, a multiple of D's block size
    d_rank: int
    group_kinds: tuple[str, ...]
    p_lists: tuple[tuple[int, ...], ...]  # per group: P's block list as vLLM holds it when the prefill ends
    d_pool: tuple[int, ...]  # D's free blocks in the order vLLM hands them out
    max_batch: int
    seed: int
    vllm_trims: bool = False  # vLLM passes on_alloc fewer external tokens (block-aligned) than matched

    @property
    def holdback(self) -> int:
        return 1 if STATE in self.group_kinds else 0

    @property
    def p_tokens(self) -> int:  # what P computed and reports (remote_num_tokens)
        return self.prompt_len - self.holdback

    def groups(self, block_size: int) -> tuple[KVGroup, ...]:
        return tuple(KVGroup(k, block_size, w) for k, w in zip(self.group_kinds, self.windows))

    @property
    def d_groups(self) -> tuple[KVGroup, ...]:
        return self.groups(self.d_bs)

    @property
    def p_groups(self) -> tuple[KVGroup, ...]:
        return self.groups(self.p_bs)

    @property
    def offered(self) -> list[list[int]]:
        """What P issues: each group's list cut by needed_tail (vllm_kvp2p/connector/scheduler.py, _offer)."""
        return [needed_tail(g, ids, self.p_tokens) for g, ids in zip(self.p_groups, self.p_lists)]

    def params(self, offered: Sequence[Sequence[int]] | None = None) -> dict:
        lists = [list(ids) for ids in (self.offered if offered is None else offered)]
        return remote(lists, self.p_tokens, self.p_bs, seed=self.seed, tp_size=self.p_tp).to_params()

    @property
    def prompt(self) -> Prompt:
        return prompt(self.prompt_len, self.seed)

    def layout(self, tp: int) -> Layout:
        return Layout(tp, self.heads, self.mla)


@st.composite
def scenarios(draw: st.DrawFn) -> Scenario:
    kind = draw(st.sampled_from(("full", *KINDS)))  # the one group twice as often: block sizes may differ
    hybrid = kind != "full"
    if hybrid:
        p_bs = d_bs = draw(st.sampled_from(BLOCK_SIZES))
    else:
        p_bs, d_bs = draw(st.sampled_from(BS_PAIRS))
    mla = draw(st.sampled_from((False, False, True)))
    heads = 1 if mla else draw(st.sampled_from((2, 4, 8)))
    p_tp = draw(st.sampled_from((1, 2, 4)))
    d_tp = p_tp if kind == "full+state" else draw(st.sampled_from((1, 2, 4)))  # a state needs the same TP
    interior = "mla" if mla else draw(st.sampled_from(("cpu", "npu")))
    k_layout = v_layout = "rows"
    if interior == "cpu":
        fits = [n for n, spec in SPECS.items() if p_bs % spec[1] == 0 and d_bs % spec[1] == 0]  # whole tiles
        k_layout = draw(st.sampled_from([n for n in fits if n != "pairs"]))
        v_layout = draw(st.sampled_from([n for n in fits if n != "element-major"]))
    if kind == "full":
        kinds: tuple[str, ...] = (FULL,)
    elif kind == "full+sliding":
        kinds = (FULL, SLIDING)
    elif kind == "full+state":
        kinds = (FULL, STATE)
    else:
        kinds = (SLIDING,) * draw(st.integers(1, 2))
    if len(kinds) > 1:
        kinds = tuple(draw(st.permutations(kinds)))  # vLLM's order of groups
    windows = tuple(draw(st.integers(1, 64)) if k == SLIDING else 0 for k in kinds)
    layers = draw(st.integers(1, 2))
    prompt_len = draw(st.integers(2 if STATE in kinds else 1, 100))
    n = prompt_len - (1 if STATE in kinds else 0)
    local_hit = d_bs * draw(st.integers(0, (prompt_len - 1) // d_bs))  # vLLM caps a hit at the prompt's last token
    d_rank = draw(st.integers(0, d_tp - 1))
    pool = iter(draw(st.permutations(range(1, NUM_BLOCKS))))
    p_lists = []
    m = prompt_blocks(n, p_bs)
    for k, w in zip(kinds, windows):
        extra = draw(st.integers(0, 1))  # a block for the next token's slot, past the prompt's blocks
        if k == FULL:
            ids = [next(pool) for _ in range(m + extra)]
        elif k == SLIDING:
            # vLLM freed (nulled) blocks before the window; never one a decoder needs
            freed = draw(st.integers(0, m - needed_count(KVGroup(SLIDING, p_bs, w), n)))
            ids = [NULL_BLOCK_ID] * freed + [next(pool) for _ in range(m - freed + extra)]
        else:  # the running state is the last real block of the prompt's; earlier ones are null or checkpoints
            ids = [next(pool) if draw(st.booleans()) else NULL_BLOCK_ID for _ in range(m - 1)] + [next(pool)]
        p_lists.append(tuple(ids))
    d_pool = tuple(draw(st.permutations(range(1, NUM_BLOCKS))))
    return Scenario(kind, windows, p_bs, d_bs, p_tp, d_tp, heads, mla, interior, k_layout, v_layout, layers,
                    prompt_len, local_hit, d_rank, kinds, tuple(p_lists), d_pool,
                    max_batch=draw(st.sampled_from((1, 5, 4096))), seed=draw(st.integers(0, 3)),
                    vllm_trims=draw(st.sampled_from((False, False, False, True))))
