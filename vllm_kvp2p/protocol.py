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

from enum import Enum
from typing import Any, Union

import msgspec

from vllm_kvp2p.kv_groups import KVGroup
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape

PROTOCOL_VERSION = 2  # 2: block ids per KV-cache group


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

    @classmethod
    def from_params(cls, params: dict[str, Any]) -> RemotePrefill | None:
        """Parse the request's ``kv_transfer_params``; None when they do not describe a remote prefill."""
        try:
            return msgspec.convert(params, cls, strict=False)
        except msgspec.ValidationError:
            return None

    def to_params(self) -> dict[str, Any]:
        out = msgspec.to_builtins(self)
        # omit_defaults would drop these; every reader expects both flags explicitly.
        out["do_remote_prefill"] = self.do_remote_prefill
        out["do_remote_decode"] = self.do_remote_decode
        return out


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

    def kv_groups(self) -> tuple[KVGroup, ...]:
        return tuple(self.groups) or (KVGroup("full", self.block_size),)

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


class Renew(msgspec.Struct, frozen=True, tag="renew"):
    request_id: str
    hold_id: str
    reader: str


class Release(msgspec.Struct, frozen=True, tag="release"):
    """D is done with the hold (read, failed, or had nothing to read): P may free it."""

    request_id: str
    hold_id: str
    reader: str
    expected_readers: int = 1
    pulled: bool = False


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


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    pass


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    message: str


Request = Union[GetRegistration, Claim, Renew, Release]
Reply = Union[Registration, ClaimReply, Ack, ErrorReply]

_request_decoder = msgspec.msgpack.Decoder(Request)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def encode(message: Request | Reply) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> Request:
    return _request_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)
