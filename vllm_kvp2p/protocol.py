"""Everything that crosses a process boundary, as typed msgspec structs.

Three boundaries:

* ``kv_transfer_params`` (P's ``request_finished`` -> proxy -> D's request): :class:`RemotePrefill`. It is a plain
  dict on the wire (vLLM and proxies treat it as JSON); the field names follow vLLM's NIXL connector so existing
  proxies work unchanged.
* the side channel (D worker <-> P worker, ZMQ): the :data:`Request` / :data:`Reply` tagged unions, msgpack-encoded.
  Never pickle: a side channel must not execute what a peer sends.
* per-rank registration metadata (:class:`RankRegistration`), served by each P worker and cached by D per remote
  engine.
"""

from __future__ import annotations

import functools
import ipaddress
import re
from enum import Enum
from typing import Any, Union

import msgspec

from vllm_kvp2p.kv_groups import KVGroup, prompt_blocks, single_full_group
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape

# 2: block ids per KV-cache group; 3: incarnation, model fingerprint, signed params; 4: block interiors with parts
# (vLLM CPU's K and V halves), params bound to their prompt, claims with D's deadline
PROTOCOL_VERSION = 4

# Bounds on what a client may put in kv_transfer_params (vLLM's OpenAI server accepts them from anyone).
MAX_TP_SIZE = 1024
MAX_KV_GROUPS = 64
MAX_BLOCK_SIZE = 1 << 20  # tokens
MAX_ID_LENGTH = 256
PortRanges = tuple[tuple[int, int], ...]
ANY_PORT: PortRanges = ((1, 65535),)
_LABEL = r"[A-Za-z0-9]([A-Za-z0-9-]{0,61}[A-Za-z0-9])?"
_HOSTNAME = re.compile(rf"^(?=.{{1,253}}$){_LABEL}(\.{_LABEL})*$")


# --------------------------------------------------------------------------- kv_transfer_params


class RemotePrefill(msgspec.Struct, frozen=True, omit_defaults=True):
    """What D needs to find and claim P's blocks for one request."""

    remote_engine_id: str
    remote_request_id: str  # P's internal request id (vLLM suffixes ids, so P's and D's differ)
    remote_host: str
    remote_port: int  # side-channel port of P's (dp, tp 0); rank r listens on remote_port + r
    # One list per KV-cache group (vLLM's order of transfer groups), each cut to what a decoder needs and ending
    # with the block of the prompt's last token (vllm_kvp2p/kv_groups.py). One list for a model without HMA.
    remote_block_ids: list[list[int]]
    remote_hold_id: str  # fences a claim to exactly this hold of these blocks
    remote_num_tokens: int  # tokens P computed (and whose KV the blocks hold)
    remote_block_size: int
    tp_size: int = 1
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    # P's incarnation (drawn at each start): D's cached registration of this P must be of the same one.
    remote_incarnation: str = ""
    expires_ms: int = 0  # with a shared secret: P's wall clock after which D refuses these params
    mac: str = ""  # with a shared secret: HMAC-SHA256 over every other field (vllm_kvp2p/auth.py)

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemotePrefill | None:
        """Parse the request's ``kv_transfer_params``; None when they do not describe a remote prefill."""
        try:
            return msgspec.convert(params, cls, strict=False)
        except msgspec.ValidationError:
            return None

    def address_problem(self, port_ranges: PortRanges = ANY_PORT) -> str:
        """What makes P's side channel unaddressable ("" if nothing): then D contacts no one, not even to release.
        Otherwise D only ever contacts ``remote_host`` at ``remote_port + rank`` for ranks below ``tp_size``, all
        inside one of ``port_ranges`` (inclusive; the ``peer_ports`` setting)."""
        if not 1 <= self.tp_size <= MAX_TP_SIZE:
            return f"tp_size {self.tp_size} outside 1..{MAX_TP_SIZE}"
        last = self.remote_port + self.tp_size - 1
        if not any(lo <= self.remote_port and last <= hi for lo, hi in port_ranges):
            allowed = ", ".join(f"{lo}..{hi}" for lo, hi in port_ranges)
            return (f"remote_port {self.remote_port} with tp_size {self.tp_size}: ports {self.remote_port}..{last} "
                    f"not inside the allowed side-channel ports ({allowed}; the peer_ports setting)")
        if not _valid_host(self.remote_host):
            return f"remote_host {self.remote_host[:80]!r} is not an IP address or host name"
        return ""

    def problem(self, num_prompt_tokens: int, port_ranges: PortRanges = ANY_PORT) -> str:
        """What makes these params unusable for a ``num_prompt_tokens`` prompt ("" if nothing): checked before D
        plans anything, since any client can send them. Names the field."""
        address = self.address_problem(port_ranges)
        if address:
            return address
        for name in ("remote_engine_id", "remote_request_id", "remote_hold_id"):
            value = getattr(self, name)
            if not 0 < len(value) <= MAX_ID_LENGTH:
                return f"{name} must have 1..{MAX_ID_LENGTH} characters, has {len(value)}"
        for name in ("remote_incarnation", "mac"):
            if len(getattr(self, name)) > MAX_ID_LENGTH:
                return f"{name} must have at most {MAX_ID_LENGTH} characters"
        if not 1 <= self.remote_block_size <= MAX_BLOCK_SIZE:
            return f"remote_block_size {self.remote_block_size} outside 1..{MAX_BLOCK_SIZE}"
        if not 1 <= self.remote_num_tokens <= num_prompt_tokens:
            return f"remote_num_tokens {self.remote_num_tokens} outside 1..{num_prompt_tokens} (the prompt)"
        if not 1 <= len(self.remote_block_ids) <= MAX_KV_GROUPS:
            return f"remote_block_ids has {len(self.remote_block_ids)} groups, not 1..{MAX_KV_GROUPS}"
        most = prompt_blocks(self.remote_num_tokens, self.remote_block_size)
        for i, ids in enumerate(self.remote_block_ids):
            if len(ids) > most:
                return (f"remote_block_ids[{i}] has {len(ids)} blocks; {self.remote_num_tokens} tokens fill at most "
                        f"{most}")
            if any(b < 0 for b in ids) or len(set(ids)) != len(ids):
                return f"remote_block_ids[{i}] holds a negative or repeated block id"
        return ""

    def to_params(self) -> dict[str, Any]:
        out = msgspec.to_builtins(self)
        # omit_defaults would drop these; every reader expects both flags explicitly.
        out["do_remote_prefill"] = self.do_remote_prefill
        out["do_remote_decode"] = self.do_remote_decode
        return out


def _valid_host(host: str) -> bool:
    return len(host) <= 253 and _valid_short_host(host)  # no name or address is longer; nothing long is cached


@functools.lru_cache(maxsize=1024)  # a fleet has few P hosts; parsing one costs ~7 us, twice per admission
def _valid_short_host(host: str) -> bool:
    try:
        ipaddress.ip_address(host)
        return True
    except ValueError:
        return bool(_HOSTNAME.match(host))


# --------------------------------------------------------------------------- registration


class RankRegistration(msgspec.Struct, frozen=True):
    """One worker's KV memory as its peers must address it."""

    engine_id: str
    tp_rank: int
    tp_size: int
    segment: str  # Mooncake target name, "host:rpc_port"
    planes: list[PlaneGeometry]  # in layer order, then K/V order where they are separate
    block_shapes: list[BlockShape]  # the inside of one block of each plane
    layer_names: list[str]
    block_size: int  # tokens per block
    num_blocks: int  # this rank's own count (ranks of one engine may differ)
    dtype: str
    num_kv_heads: int  # KV heads held by this rank
    total_num_kv_heads: int  # KV heads of the model
    head_size: int
    use_mla: bool = False
    protocol_version: int = PROTOCOL_VERSION
    groups: list[KVGroup] = msgspec.field(default_factory=list)  # empty: one full-attention group
    plane_groups: list[int] = msgspec.field(default_factory=list)  # group index of each plane; empty: all 0
    incarnation: str = ""  # drawn at each start of P (the params carry it too)
    model_fingerprint: str = ""  # what must match between P and D beyond the KV geometry (the model)

    def kv_groups(self) -> tuple[KVGroup, ...]:
        return tuple(self.groups) or single_full_group(self.block_size)

    def group_of_planes(self) -> tuple[int, ...]:
        return tuple(self.plane_groups) or (0,) * len(self.planes)


# --------------------------------------------------------------------------- side-channel messages


class GetRegistration(msgspec.Struct, frozen=True, tag="get_registration"):
    tp_rank: int


class Claim(msgspec.Struct, frozen=True, tag="claim"):
    """D asks P to pin a hold's blocks while it reads them (a lease)."""

    request_id: str
    hold_id: str
    reader: str  # "<D engine id>:<D tp rank>"
    expected_readers: int  # how many D readers will claim this hold on this P rank
    # Random per pull, known only to D and P: a claim resent after a lost reply (same id) gets the same lease
    # back; anyone else naming this reader does not.
    claim_id: str = ""
    # D has no registration of this rank yet: send it with the reply (one round trip instead of two for a new P;
    # a P of an older release ignores the field and D fetches it after the claim).
    with_registration: bool = False
    # D's wall clock (ms since the epoch) after which D no longer reads for this pull; 0: not given (an older D).
    # P refuses a claim that arrives clock_skew or more after it, and no lease runs past it + clock_skew.
    deadline_ms: int = 0


class Renew(msgspec.Struct, frozen=True, tag="renew"):
    request_id: str
    hold_id: str
    reader: str
    lease_token: str = ""  # from the claim's ClaimReply: without it P refuses


class Release(msgspec.Struct, frozen=True, tag="release"):
    """D is done with the hold (read, failed, or had nothing to read): P may free it."""

    request_id: str
    hold_id: str
    reader: str
    expected_readers: int = 1
    pulled: bool = False
    lease_token: str = ""  # from the claim's ClaimReply; "" from a reader with no lease (it only notifies)


class ClaimStatus(str, Enum):
    GRANTED = "granted"
    REFUSED = "refused"  # P no longer holds (expired/released) or never held these blocks: recompute
    UNKNOWN = "unknown"  # P has not heard of the hold yet (it learns one engine step late): retry shortly


class Registration(msgspec.Struct, frozen=True, tag="registration"):
    registration: RankRegistration


class ClaimReply(msgspec.Struct, frozen=True, tag="claim_reply"):
    status: ClaimStatus
    lease: float = 0.0  # seconds the claim stays valid without renewal
    reason: str = ""
    lease_token: str = ""  # GRANTED: what renewals and the release of this lease must carry
    registration: RankRegistration | None = None  # this rank's, when the claim asked for it


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    pass


class Released(msgspec.Struct, frozen=True, tag="released"):
    """P's answer to a release: whether the reader's lease held from its claim to this release. A read counts as
    good only when it did (otherwise the blocks may have been freed and reused under it)."""

    lease_held: bool


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    message: str


Request = Union[GetRegistration, Claim, Renew, Release]
Reply = Union[Registration, ClaimReply, Ack, Released, ErrorReply]

_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def encode(message: Request | Reply) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> Request:
    return _request_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)
