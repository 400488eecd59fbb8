"""Which prefix-cache blocks one instance holds, kept from its KV events: a state machine, no I/O.

One :class:`InstanceCache` per instance (a field of its record in :mod:`instances`). The feed adapter
(:mod:`kv_event_feed`) hands it every decoded batch and carries out what :meth:`InstanceCache.apply` returns:

* in order (``seq == last + 1``, or the first batch seen): applied;
* a gap (``seq > last + 1``: the subscriber missed messages): :class:`Replay` from ``last + 1``; the adapter asks
  the engine's replay socket and feeds the replayed batches back in (a replay that cannot reach back that far
  resets the index, and it restarts from what it gets);
* a repeat of a seq already applied right after a replay: dropped;
* any other ``seq <= last`` (the engine restarted: its counter began again at 0): the index is reset, then the
  batch applied.

The index is bounded (``max_blocks``; past it the oldest stored keys go first, as an LRU cache would have evicted
them) and answers :meth:`InstanceCache.cached_blocks` in O(blocks of the prompt). Being wrong costs only routing
quality: a request routed to an instance that lost the prefix recomputes or pulls it.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvp2p.proxy.kv_events import AllCleared, BlockKey, BlocksRemoved, BlocksStored, EventBatch

DEFAULT_MAX_BLOCKS = 262_144
#: Only the device cache answers a prompt without recompute; offloaded tiers publish other media.
ROUTED_MEDIA = (None, "GPU")


@dataclass(frozen=True)
class Applied:
    stored: int
    removed: int


@dataclass(frozen=True)
class Replay:
    """Ask the engine's replay socket for every batch from ``from_seq`` on."""

    from_seq: int


@dataclass(frozen=True)
class Dropped:
    reason: str


Verdict = Applied | Replay | Dropped


class InstanceCache:
    """The block keys one instance holds, and where its event stream stands."""

    def __init__(self, max_blocks: int = DEFAULT_MAX_BLOCKS) -> None:
        if max_blocks < 1:
            raise ValueError(f"max_blocks={max_blocks}: at least 1")
        self.max_blocks = max_blocks
        # Insertion-ordered: the first key is the oldest stored, the one dropped past max_blocks.
        self._blocks: dict[BlockKey, None] = {}
        self.last_seq: int | None = None
        #: After a replay, seqs in (replayed_from - 1, replayed_through] may arrive again from the live stream.
        self._duplicates_through: int | None = None
        self.resets = 0
        self.gaps = 0
        self.bad_messages = 0
        self.block_size: int | None = None

    def __len__(self) -> int:
        return len(self._blocks)

    # -- events ---------------------------------------------------------------------------------------------

    def apply(self, batch: EventBatch) -> Verdict:
        """Apply one batch in stream order, or say what must happen first."""
        last = self.last_seq
        if last is not None and batch.seq <= last:
            if self._duplicates_through is not None and batch.seq <= self._duplicates_through:
                return Dropped(f"seq {batch.seq} already applied")
            self.reset()  # the counter began again: a restarted engine with an empty cache
        elif last is not None and batch.seq > last + 1:
            self.gaps += 1
            return Replay(last + 1)
        return self._apply_in_order(batch)

    def replayed(self, batches: Sequence[EventBatch], from_seq: int) -> Applied:
        """Apply what the replay socket returned for a :class:`Replay` from ``from_seq`` (the end marker excluded).

        If the replay does not start at ``from_seq`` (the engine's buffer no longer reaches back), what came
        before is unknown: the index restarts from the replayed batches.
        """
        stored = removed = 0
        expected = from_seq
        for batch in batches:
            if self.last_seq is not None and batch.seq <= self.last_seq:
                continue  # already applied (the live message that showed the gap is replayed too)
            if batch.seq != expected:
                self.reset()  # the buffer no longer reaches back, or a hole inside the replay itself
            applied = self._apply_in_order(batch)
            stored += applied.stored
            removed += applied.removed
            expected = batch.seq + 1
        if self.last_seq is not None:
            self._duplicates_through = self.last_seq
        return Applied(stored, removed)

    def _apply_in_order(self, batch: EventBatch) -> Applied:
        stored = removed = 0
        for event in batch.events:
            if isinstance(event, AllCleared):
                removed += len(self._blocks)
                self._blocks.clear()
            elif event.medium not in ROUTED_MEDIA:
                continue
            elif isinstance(event, BlocksStored):
                self.block_size = event.block_size
                for key in event.keys:
                    self._blocks.pop(key, None)  # a re-store counts as new: it moves to the young end
                    self._blocks[key] = None
                    stored += 1
                while len(self._blocks) > self.max_blocks:
                    del self._blocks[next(iter(self._blocks))]
            elif isinstance(event, BlocksRemoved):
                for key in event.keys:
                    if self._blocks.pop(key, 0) is None:
                        removed += 1
        self.last_seq = batch.seq
        if self._duplicates_through is not None and batch.seq > self._duplicates_through:
            self._duplicates_through = None
        return Applied(stored, removed)

    def reset(self) -> None:
        """Forget everything: the instance restarted, died, or its stream cannot be followed."""
        self._blocks.clear()
        self.last_seq = None
        self._duplicates_through = None
        self.resets += 1

    # -- routing --------------------------------------------------------------------------------------------

    def cached_blocks(self, prompt_keys: Sequence[BlockKey]) -> int:
        """How many leading blocks of the prompt this instance holds (a prefix: the first miss ends it)."""
        n = 0
        for key in prompt_keys:
            if key not in self._blocks:
                break
            n += 1
        return n

    def snapshot(self) -> dict[str, object]:
        return {
            "blocks": len(self._blocks),
            "last_seq": self.last_seq,
            "gaps": self.gaps,
            "resets": self.resets,
            "bad_messages": self.bad_messages,
        }
