"""How one part of a KV head's block (its K, its V, or a whole row) lays out ``tokens x elements`` in memory, as
the attention kernel writes it. Pure: no torch, no vLLM.

A KV tensor's shape does not say this. vLLM's CPU kernels (``cpu_attn_reshape_and_cache``) store each head's K
transposed (element-major, ``[head_size][tokens]``) and V token-major on the ``vec`` ISA, and in AMX tiles (K: tiles
of 16 tokens, V: groups of 16 elements with tokens in pairs) on the ``amx`` ISA; which ISA runs depends on the
dtype, the block size and the CPU. Copying a block whole is right whatever the layout, as long as both sides use
the same one; copying *part* of a block (P and D block sizes differ) is right only when the runs follow it.

Every layout seen is one :class:`PartLayout`: the part's elements are split into ``group`` -wide column groups,
each group holds the part's tokens in ``tile`` -token tiles, every tile is one contiguous run of ``tile x group``
elements, and the order inside a tile is the same in every tile and group (``digest`` names it)::

    offset(token, element) = (element // group) * block_size * group + (token // tile) * tile * group
                             + inside[token % tile][element % group]

``group = elements, tile = 1`` with the identity inside is plain rows (V on ``vec``, MLA, NPU); ``group = 1,
tile = 1`` is element-major (K on ``vec``). :func:`classify` finds the layout from the offsets a kernel really
wrote (the CPU platform probes vLLM's op at start-up); :func:`part_runs` gives the runs that copy a token range.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from typing import Annotated

import msgspec

#: A layout's order name: ``"<n>x<m>:"`` + 16 hex digits, or ``"<why>:block <size>"``; peers send it (registrations).
MAX_LAYOUT_DIGEST_LENGTH = 40  # the longest real one: 30 ("fp8_ds_mla cache:block 1048576")


class PartLayout(msgspec.Struct, frozen=True, array_like=True):
    """The layout of one part (see the module docstring). Equal values on P and D: the same layout."""

    group: Annotated[int, msgspec.Meta(ge=0, le=1 << 20)] = 0  # elements per column group; 0: all (plain rows)
    tile: Annotated[int, msgspec.Meta(ge=1, le=1 << 20)] = 1  # tokens per contiguous tile inside a group
    # bytes of one element (0: the part is moved in whole rows, element size irrelevant)
    element_bytes: Annotated[int, msgspec.Meta(ge=0, le=64)] = 0
    # the order inside a tile ("": the identity)
    digest: Annotated[str, msgspec.Meta(max_length=MAX_LAYOUT_DIGEST_LENGTH)] = ""

    def describe(self) -> str:
        if self.group == 0 and self.tile == 1 and not self.digest:
            return "rows"
        group = "all elements" if self.group == 0 else f"{self.group} elements"
        return f"column groups of {group}, tiles of {self.tile} tokens" + (f" ({self.digest})" if self.digest else "")


#: Token-major rows: a token's bytes are one run, tokens in order. MLA latents, NPU K and V rows, state pages.
ROWS = PartLayout()


def classify(offsets: Sequence[Sequence[int]], element_bytes: int) -> PartLayout:
    """The layout of a part whose element ``(t, e)`` lies at element offset ``offsets[t][e]`` (from the part's
    start). The smallest tile (most freedom to cut blocks), then the widest group (fewest runs); a layout with
    no smaller structure comes out as one tile of the whole block (only whole blocks can be copied then).
    Raises ValueError if ``offsets`` is not a permutation of the part's elements."""
    tokens, elements = len(offsets), len(offsets[0]) if offsets else 0
    flat = [o for row in offsets for o in row]
    if sorted(flat) != list(range(tokens * elements)):
        raise ValueError(f"offsets of a {tokens} x {elements} part are not a permutation of its elements")
    for tile in _divisors(tokens):
        for group in reversed(_divisors(elements)):
            inside = _inside_if(offsets, tokens, elements, tile, group)
            if inside is None:
                continue
            identity = all(inside[t][e] == t * group + e for t in range(tile) for e in range(group))
            if group == elements and tile == 1 and identity:
                return ROWS
            digest = "" if identity else _digest(inside)
            return PartLayout(0 if group == elements else group, tile, element_bytes, digest)
    raise AssertionError("unreachable: one tile of the whole part always fits")


def _inside_if(offsets: Sequence[Sequence[int]], tokens: int, elements: int, tile: int,
               group: int) -> list[list[int]] | None:
    """The order inside a tile if every tile of every group follows the formula with the same one, else None."""
    inside = [[offsets[t][e] for e in range(group)] for t in range(tile)]
    for t in range(tokens):
        base_t = (t // tile) * tile * group
        row, inner = offsets[t], inside[t % tile]
        for e in range(elements):
            if row[e] != (e // group) * tokens * group + base_t + inner[e % group]:
                return None
    return inside


def part_runs(layout: PartLayout, row_bytes: int, local_tokens: int, local_token: int, remote_tokens: int,
              remote_token: int, num_tokens: int) -> list[tuple[int, int, int]]:
    """(local offset, remote offset, bytes) from the parts' starts, copying tokens ``[remote_token, +num_tokens)``
    of a remote part of ``remote_tokens`` tokens to ``[local_token, ...)`` of a local part of ``local_tokens``
    (``row_bytes``: one token's bytes in the part). Both parts have ``layout``. Raises ValueError when the tokens
    do not start and end on the layout's tiles (the copy would split a tile)."""
    tile = layout.tile
    whole = local_tokens == remote_tokens and local_token == remote_token == 0 and num_tokens == local_tokens
    if not whole and (local_token % tile or remote_token % tile or num_tokens % tile):
        raise ValueError(f"tokens [{remote_token}, +{num_tokens}) -> [{local_token}, ...) split a part laid out "
                         f"in {layout.describe()}")
    if layout.group == 0 or whole:
        return [(local_token * row_bytes, remote_token * row_bytes, num_tokens * row_bytes)]
    if not layout.element_bytes or row_bytes % (layout.group * layout.element_bytes):
        raise ValueError(f"a {row_bytes}-byte row is not made of column groups of {layout.describe()}")
    group_bytes = layout.group * layout.element_bytes
    return [
        (g * local_tokens * group_bytes + local_token * group_bytes,
         g * remote_tokens * group_bytes + remote_token * group_bytes,
         num_tokens * group_bytes)
        for g in range(row_bytes // group_bytes)
    ]


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def _digest(inside: list[list[int]]) -> str:
    text = ";".join(",".join(map(str, row)) for row in inside)
    return f"{len(inside)}x{len(inside[0])}:" + hashlib.sha256(text.encode()).hexdigest()[:16]
