"""vLLM's KV-cache events as the proxy reads them: typed, bounded decoding of one published message. No I/O.

An engine started with ``--kv-events-config '{"enable_kv_cache_events": true, "publisher": "zmq", ...}'`` publishes
one ZMQ multipart message per scheduler step that changed its prefix cache: ``(topic, seq, payload)``, where
``seq`` is an 8-byte big-endian counter starting at 0 in each engine process and ``payload`` is a msgpack
``KVEventBatch``: ``[ts, [event, ...], data_parallel_rank]``. Each event is a map tagged by ``"type"`` (vLLM 0.32)
or an array ``["BlockStored", field, ...]`` (vLLM 0.23): ``BlockStored`` (full blocks now in the prefix cache:
their hashes, the parent's, their tokens), ``BlockRemoved`` (blocks evicted) or ``AllBlocksCleared``
(``reset_prefix_cache``). Its replay socket answers a start ``seq`` with the buffered messages from there on and
an end marker whose seq is -1 (``vllm/distributed/kv_events.py``).

The proxy turns block hashes into 64-bit keys the way vLLM does under ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``
(the hash's last 8 bytes, big-endian), so events with byte or int hashes index alike.

Everything here is hostile-input safe: a frame larger than :data:`MAX_PAYLOAD_BYTES`, more than
:data:`MAX_EVENTS` events, more than :data:`MAX_HASHES` hashes in one event or :data:`MAX_BATCH_KEYS` in one batch,
a wrong shape or type all give one :class:`BadEvents` with a short reason; event types this version does not know
are skipped and counted.

No part of a message is decoded into Python objects before its size is known to be within those bounds, and an
event's type is read from its tag alone (:func:`event_tag`: O(the tag), whatever the body), so an event of a type
this proxy does not know (a future vLLM's, or a hostile one) is skipped unread. Before, such an event was decoded
whole to learn its type: 4 MiB of nested lists held the GIL for ~2 s and allocated ~300 MiB (issue 45, item 4).
msgspec, which vLLM's events are encoded with, writes a tagged struct's tag first (the first key ``"type"`` of the
map form, the first element of the array form); an event without its tag there is refused.

Only what routing uses is kept: the block keys, and the first block's token ids of a prompt's first block (what
:meth:`~vllm_kvp2p.proxy.block_hashes.PromptHasher.check` compares). A ``BlockStored`` of a 64k-token prompt carries
all 64k token ids; they are skipped undecoded (``msgspec.Raw``), so decoding costs O(hashes), not O(tokens), and no
single C call (which holds the GIL, see :mod:`kv_event_feed`) lasts long.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Annotated

import msgspec

#: One engine step's events. vLLM writes ~3-5 bytes per token id and ~35 per hash: a step storing 64k tokens
#: publishes ~0.3 MiB, so 4 MiB is ~800k tokens in one step. ZMQ disconnects a peer sending more (MAXMSGSIZE).
MAX_PAYLOAD_BYTES = 4 * 1024 * 1024
MAX_EVENTS = 65_536
MAX_HASHES = 65_536
#: Block keys (stored + removed) of one batch: what applying it costs on the proxy's event loop (~10 ms at most).
MAX_BATCH_KEYS = 65_536
MAX_TOKENS = MAX_HASHES * 1024
#: A first block longer than this is not kept for the hash check (which then cannot tell, and waits for another).
MAX_CHECKED_BLOCK_TOKENS = 65_536
#: The seq of the replay socket's end-of-replay marker.
END_OF_REPLAY = -1
_KEY_MASK = (1 << 64) - 1
#: The event types this decoder knows, by their tag's bytes.
KNOWN_TYPES = frozenset({b"BlockStored", b"BlockRemoved", b"AllBlocksCleared"})
#: A longer tag names no type known here: counted unknown without reading it.
MAX_TAG_BYTES = 64

BlockKey = int


class BadEvents(ValueError):
    """A message that is not a well-formed, bounded KV event batch."""


def block_key(block_hash: bytes | int) -> BlockKey:
    """vLLM's external 64-bit form of a block hash (its ``maybe_convert_block_hash``): the same for both forms."""
    if isinstance(block_hash, int):
        return block_hash & _KEY_MASK
    return int.from_bytes(block_hash, "big") & _KEY_MASK


# msgspec checks a list's length from its header, before decoding any element: a longer one costs nothing.
_Hashes = Annotated[list[bytes | int], msgspec.Meta(max_length=MAX_HASHES)]


class _Stored(msgspec.Struct, tag="BlockStored"):
    block_hashes: _Hashes
    parent_block_hash: bytes | int | None
    # Skipped, not decoded: only the first block's ids are read (see _first_tokens).
    token_ids: msgspec.Raw
    block_size: int
    lora_id: int | None = None
    medium: str | None = None
    lora_name: str | None = None
    # One entry per block (vLLM: a tuple of keys, or None): only whether any is non-empty counts (_has_extra_keys).
    extra_keys: msgspec.Raw = msgspec.field(default_factory=lambda: msgspec.Raw(b"\xc0"))  # nil when absent
    group_idx: int | None = None


class _Removed(msgspec.Struct, tag="BlockRemoved"):
    block_hashes: _Hashes
    medium: str | None = None
    group_idx: int | None = None


class _Cleared(msgspec.Struct, tag="AllBlocksCleared"):
    pass


# vLLM 0.23 lays events out as arrays, ``["BlockStored", hashes, ...]``, in the
# field order above; vLLM 0.32 as maps with a "type" key. Trailing fields a release adds are ignored.
class _StoredArray(_Stored, array_like=True, tag="BlockStored"):
    pass


class _RemovedArray(_Removed, array_like=True, tag="BlockRemoved"):
    pass


class _ClearedArray(_Cleared, array_like=True, tag="AllBlocksCleared"):
    pass


class _Batch(msgspec.Struct, array_like=True):
    ts: float
    events: Annotated[list[msgspec.Raw], msgspec.Meta(max_length=MAX_EVENTS)]
    data_parallel_rank: int | None = None


_batch_decoder = msgspec.msgpack.Decoder(_Batch)
_map_event_decoder = msgspec.msgpack.Decoder(_Stored | _Removed | _Cleared)
_array_event_decoder = msgspec.msgpack.Decoder(_StoredArray | _RemovedArray | _ClearedArray)
_token_list = msgspec.msgpack.Decoder(list[int])


@dataclass(frozen=True)
class BlocksStored:
    """Full blocks now in the engine's prefix cache, in prompt order."""

    keys: tuple[BlockKey, ...]
    parent: BlockKey | None
    #: For checking the proxy's own hashes against the engine's (see :mod:`block_hashes`).
    raw_first_hash: bytes | int
    raw_parent: bytes | int | None
    #: The first block's token ids (at most ``block_size``) when this is a prompt's first block without extra keys
    #: (the only event :meth:`PromptHasher.check` compares); empty otherwise. The rest are never kept.
    token_ids: tuple[int, ...]
    block_size: int
    #: True when the hashes depend on more than the tokens (LoRA, multimodal input, a cache salt).
    has_extra_keys: bool
    #: GPU (the device cache the proxy routes by) unless an offloading tier says otherwise.
    medium: str | None
    group_idx: int | None


@dataclass(frozen=True)
class BlocksRemoved:
    keys: tuple[BlockKey, ...]
    medium: str | None
    group_idx: int | None


@dataclass(frozen=True)
class AllCleared:
    pass


Event = BlocksStored | BlocksRemoved | AllCleared


@dataclass(frozen=True)
class EventBatch:
    """One published message: its sequence number and the events of one engine step."""

    seq: int
    ts: float
    events: tuple[Event, ...]
    data_parallel_rank: int | None
    #: Events of types this decoder does not know (skipped).
    unknown: int = 0


def decode_seq(seq_bytes: bytes) -> int:
    """The 8-byte big-endian sequence number; the replay end marker is -1."""
    if len(seq_bytes) != 8:
        raise BadEvents(f"sequence number of {len(seq_bytes)} bytes (want 8)")
    return int.from_bytes(seq_bytes, "big", signed=True)


def decode_message(frames: list[bytes]) -> EventBatch:
    """``(topic, seq, payload)`` as published (or as replayed) -> :class:`EventBatch`."""
    if len(frames) != 3:
        raise BadEvents(f"{len(frames)} frames (want topic, seq, payload)")
    return decode_batch(decode_seq(frames[1]), frames[2])


def decode_batch(seq: int, payload: bytes) -> EventBatch:
    if len(payload) > MAX_PAYLOAD_BYTES:
        raise BadEvents(f"payload of {len(payload)} bytes exceeds {MAX_PAYLOAD_BYTES}")
    try:
        batch = _batch_decoder.decode(payload)
    except msgspec.MsgspecError as exc:
        raise BadEvents(f"not a KV event batch: {exc}") from None
    events: list[Event] = []
    unknown = keys = 0
    for raw in batch.events:
        if event_tag(raw) not in KNOWN_TYPES:
            unknown += 1  # a type this proxy does not know: its body is never read
            continue
        decoder = _array_event_decoder if _is_array(raw) else _map_event_decoder
        try:
            event = decoder.decode(raw)
        except msgspec.MsgspecError as exc:
            raise BadEvents(f"malformed event: {exc}") from None
        converted = _convert(event)
        if not isinstance(converted, AllCleared):
            keys += len(converted.keys)
            if keys > MAX_BATCH_KEYS:
                raise BadEvents(f"more than {MAX_BATCH_KEYS} block hashes in one batch")
        events.append(converted)
    return EventBatch(seq, batch.ts, tuple(events), batch.data_parallel_rank, unknown)


def _is_array(raw: msgspec.Raw) -> bool:
    """An event in vLLM 0.23's array form (a msgpack array), not 0.32's map."""
    return _header(memoryview(raw), 0, *_ARRAY) is not None


def _header(buf: memoryview, at: int, fix: tuple[int, int], sized: dict[int, int]) -> tuple[int, int] | None:
    """A msgpack container or string header at ``at``: (its length, where its content starts), or None when the
    byte there is another kind. ``fix``: the fix form's first byte and mask; ``sized``: 8/16/32-bit forms' first
    bytes -> their length's bytes."""
    if at >= len(buf):
        return None
    head = buf[at]
    if fix[0] <= head <= fix[0] | fix[1]:
        return head & fix[1], at + 1
    width = sized.get(head)
    if width is None or at + 1 + width > len(buf):
        return None
    return int.from_bytes(buf[at + 1 : at + 1 + width], "big"), at + 1 + width


_MAP = ((0x80, 0x0F), {0xDE: 2, 0xDF: 4})
_ARRAY = ((0x90, 0x0F), {0xDC: 2, 0xDD: 4})
_STR = ((0xA0, 0x1F), {0xD9: 1, 0xDA: 2, 0xDB: 4})


def _string(buf: memoryview, at: int) -> tuple[bytes, int] | None:
    """The msgpack string at ``at`` (only its first :data:`MAX_TAG_BYTES` + 1 bytes: longer names no known type)
    and where it ends, or None when there is none."""
    header = _header(buf, at, *_STR)
    if header is None:
        return None
    size, start = header
    if start + size > len(buf):
        return None
    return buf[start : start + min(size, MAX_TAG_BYTES + 1)].tobytes(), start + size


def event_tag(raw: msgspec.Raw) -> bytes:
    """An event's type, read from its tag alone: the first element of vLLM 0.23's array form, the value of the
    first key, ``"type"``, of vLLM 0.32's map form (msgspec writes a tagged struct's tag first). O(the tag),
    whatever the event's body; :class:`BadEvents` when the tag is not there."""
    buf = memoryview(raw)
    if (header := _header(buf, 0, *_ARRAY)) is not None:
        length, at = header
        tag = _string(buf, at) if length else None
    elif (header := _header(buf, 0, *_MAP)) is not None:
        length, at = header
        key = _string(buf, at) if length else None
        tag = _string(buf, key[1]) if key is not None and key[0] == b"type" else None
    else:
        raise BadEvents("an event that is neither a map nor an array: no type tag")
    if tag is None:
        raise BadEvents("an event without its type tag first (a string: the map's first key \"type\" or the "
                        "array's first element)")
    return tag[0]


def _convert(event: _Stored | _Removed | _Cleared) -> Event:  # the array variants are subclasses
    if isinstance(event, _Cleared):
        return AllCleared()
    keys = tuple(block_key(h) for h in event.block_hashes)
    if isinstance(event, _Removed):
        return BlocksRemoved(keys, event.medium, event.group_idx)
    if not keys:
        raise BadEvents("BlockStored without block hashes")
    if not 0 < event.block_size <= 1_048_576:
        raise BadEvents(f"block_size {event.block_size} out of range")
    extra = bool(event.lora_name or event.lora_id or _has_extra_keys(event.extra_keys))
    checked = event.parent_block_hash is None and not extra and event.block_size <= MAX_CHECKED_BLOCK_TOKENS
    tokens = _first_tokens(event.token_ids, event.block_size if checked else 0)
    return BlocksStored(
        keys=keys,
        parent=None if event.parent_block_hash is None else block_key(event.parent_block_hash),
        raw_first_hash=event.block_hashes[0],
        raw_parent=event.parent_block_hash,
        token_ids=tokens,
        block_size=event.block_size,
        has_extra_keys=extra,
        medium=event.medium,
        group_idx=event.group_idx,
    )


# Elements that are msgpack nil or the empty array: blocks without extra keys (matched in C, nothing copied).
_NO_KEYS = re.compile(rb"[\xc0\x90]*")


def _has_extra_keys(raw: msgspec.Raw) -> bool:
    """Whether vLLM's ``extra_keys`` (nil, or an array of one entry per block: nil or a tuple of keys) holds any
    key, without decoding it: an array whose every element is one byte, nil or ``[]``, holds none; anything else
    (a non-empty entry, or not the shape vLLM writes) counts as extra keys, so the block is not hash-checked.
    O(its bytes) in C."""
    buf = memoryview(raw)
    if buf[:1] == b"\xc0":
        return False
    header = _header(buf, 0, *_ARRAY)
    if header is None:
        return True
    length, start = header
    return len(buf) - start != length or _NO_KEYS.fullmatch(buf, start) is None


# msgpack int encodings -> their size in bytes: positive / negative fixint 1, uint8 / int8 2, ... 64-bit 9.
_INT_SIZES = {**{b: 1 for b in range(0x80)}, **{b: 1 for b in range(0xE0, 0x100)},
              0xCC: 2, 0xD0: 2, 0xCD: 3, 0xD1: 3, 0xCE: 5, 0xD2: 5, 0xCF: 9, 0xD3: 9}


def _first_tokens(raw: msgspec.Raw, want: int) -> tuple[int, ...]:
    """The first ``want`` ints of the msgpack array ``raw`` (all of it when shorter), the others skipped unread.

    Walks ``want`` element headers in Python (a block: 16..a few hundred) and decodes just those bytes, so a
    64k-token event costs what its first block costs.
    """
    buf = memoryview(raw)
    if not buf:
        raise BadEvents("token_ids: empty")
    head = buf[0]
    if 0x90 <= head <= 0x9F:
        n, start = head & 0x0F, 1
    elif head == 0xDC and len(buf) >= 3:
        n, start = int.from_bytes(buf[1:3], "big"), 3
    elif head == 0xDD and len(buf) >= 5:
        n, start = int.from_bytes(buf[1:5], "big"), 5
    else:
        raise BadEvents("token_ids: not an array")
    if n > MAX_TOKENS:
        raise BadEvents(f"{n} token ids in one event exceeds {MAX_TOKENS}")
    take = min(n, want)
    if take == 0:
        return ()
    end = start
    for _ in range(take):
        size = _INT_SIZES.get(buf[end]) if end < len(buf) else None
        if size is None:
            raise BadEvents("token_ids: not an array of ints")
        end += size
    if end > len(buf):
        raise BadEvents("token_ids: truncated")
    try:
        return tuple(_token_list.decode(b"\xdd" + take.to_bytes(4, "big") + buf[start:end].tobytes()))
    except msgspec.MsgspecError as exc:
        raise BadEvents(f"token_ids: {exc}") from None
