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

import hashlib
from array import array
from collections.abc import Sequence
from enum import Enum
from typing import Annotated, Any, Union

import msgspec

from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.kv_groups import KVGroup, single_full_group
from vllm_kvp2p.transfer.slicing import BlockShape

# 2: block ids per KV-cache group; 3: incarnation, model fingerprint, signed params; 4: block interiors with parts
# (vLLM CPU's K and V halves), params bound to their prompt, claims with D's deadline; 5: rank tables (ranks of one
# engine on several nodes); 6: pipeline stages (ranks of an engine numbered stage * tp_size + tp rank, a
# registration names the layers of its stage)
PROTOCOL_VERSION = 6

# Bounds on what a client may put in kv_transfer_params (vLLM's OpenAI server accepts them from anyone): part of
# the type, so converting a client's dict refuses anything outside them (naming the field) before any check runs.
MAX_TP_SIZE = 1024
MAX_PP_SIZE = 64
MAX_ENGINE_RANKS = 1024  # pp_size * tp_size: the ranks of one engine D may contact
MAX_KV_GROUPS = 64
MAX_BLOCK_SIZE = 1 << 20  # tokens
MAX_ID_LENGTH = 256
MAX_TOKENS = 1 << 40
MAX_BLOCK_ID = (1 << 62) - 1  # below every signed 64-bit bound (msgpack, C++)
MAX_BLOCKS_PER_GROUP = 1 << 22
MAX_HOST_LENGTH = 253  # no address or host name is longer
MAX_SEGMENT_LENGTH = MAX_HOST_LENGTH + 8  # a Mooncake segment, "host:port" ("[v6]:port")
MAX_READER_LENGTH = MAX_ID_LENGTH + 8  # "<D engine id>:<D tp rank>" (the ledger's bound, lifecycle/producer.py)
PortRanges = tuple[tuple[int, int], ...]
ANY_PORT: PortRanges = ((1, 65535),)

Id = Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_ID_LENGTH)]
OptionalId = Annotated[str, msgspec.Meta(max_length=MAX_ID_LENGTH)]
Reader = Annotated[str, msgspec.Meta(max_length=MAX_READER_LENGTH)]
BlockId = Annotated[int, msgspec.Meta(ge=0, le=MAX_BLOCK_ID)]
GroupBlockIds = Annotated[list[BlockId], msgspec.Meta(max_length=MAX_BLOCKS_PER_GROUP)]


# --------------------------------------------------------------------------- kv_transfer_params


class RemotePrefill(msgspec.Struct, frozen=True, omit_defaults=True):
    """What D needs to find and claim P's blocks for one request. Every check of these against D's request is
    made in one place, :func:`vllm_kvp2p.lifecycle.admission.judge`."""

    remote_engine_id: Id
    remote_request_id: Id  # P's internal request id (vLLM suffixes ids, so P's and D's differ)
    remote_host: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_LENGTH)]  # an IP address
    remote_port: Annotated[int, msgspec.Meta(ge=1, le=65535)]  # side-channel port of P's rank 0 (of its DP rank)
    # One list per KV-cache group (vLLM's order of transfer groups), each cut to what a decoder needs and ending
    # with the block of the prompt's last token (vllm_kvp2p/transfer/kv_groups.py). One list for a model without HMA.
    remote_block_ids: Annotated[list[GroupBlockIds], msgspec.Meta(min_length=1, max_length=MAX_KV_GROUPS)]
    remote_hold_id: Id  # fences a claim to exactly this hold of these blocks
    remote_num_tokens: Annotated[int, msgspec.Meta(ge=1, le=MAX_TOKENS)]  # tokens P computed (the blocks' KV)
    remote_block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)] = 1
    do_remote_prefill: bool = True
    do_remote_decode: bool = False
    # P's incarnation (drawn at each start): D's cached registration of this P must be of the same one.
    remote_incarnation: OptionalId = ""
    # prompt_digest() of the remote_num_tokens tokens whose KV the blocks hold: D compares it with its own request.
    remote_prompt_digest: OptionalId = ""
    # With a shared secret: P's wall clock after which D refuses these params, and HMAC-SHA256 over every other
    # field (vllm_kvp2p/contract/auth.py).
    expires_ms: Annotated[int, msgspec.Meta(ge=0, le=1 << 62)] = 0
    mac: OptionalId = ""
    # P's pipeline stages: P's ranks are numbered stage * tp_size + tp rank (vllm_kvp2p/lifecycle/rank_table.py).
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_PP_SIZE)] = 1

    @property
    def num_ranks(self) -> int:
        """P's ranks of this engine (one DP rank): every pipeline stage's tensor-parallel ranks."""
        return self.tp_size * self.pp_size

    @classmethod
    def from_params(cls, params: Any) -> RemotePrefill | None:
        """The request's ``kv_transfer_params`` converted (strictly, within the bounds above); None when they do
        not convert (:func:`vllm_kvp2p.lifecycle.admission.judge` says why)."""
        try:
            return msgspec.convert(params, cls, strict=True)
        except (msgspec.ValidationError, TypeError, ValueError):
            return None

    def to_params(self) -> dict[str, Any]:
        out = msgspec.to_builtins(self)
        # omit_defaults would drop these; every reader expects both flags explicitly.
        out["do_remote_prefill"] = self.do_remote_prefill
        out["do_remote_decode"] = self.do_remote_decode
        return out


#: Where D's answer to a request with params reports its pull (``kv_transfer_params[PULL_REPORT_KEY]``: ok, blocks,
#: bytes, seconds, ...; vllm_kvp2p/connector/scheduler.py fills it, the proxy reads whether it is ok).
PULL_REPORT_KEY = "kvp2p_pull"


def prompt_digest(token_ids: Sequence[int], extras: Sequence[str] = ()) -> str:
    """What binds params to a prompt: SHA-256 (first 128 bits, hex) of the token ids and whatever else decides the
    KV of those tokens (``extras``: the LoRA adapter, multimodal inputs and their positions, prompt embeddings;
    see vllm_kvp2p/connector/scheduler.py).
    The same on P (over the tokens it offers) and on D (over as many of its own)."""
    h = hashlib.sha256(b"vllm-kvp2p/prompt/v1\0")
    h.update(len(token_ids).to_bytes(8, "little"))
    h.update(array("q", token_ids).tobytes())
    for extra in extras:
        h.update(b"\0" + extra.encode("utf-8", "surrogatepass"))
    return h.hexdigest()[:32]


# --------------------------------------------------------------------------- registration

# What the largest real registration holds. D decodes P's on a pull thread of the process that holds the model,
# so a registration of any more is refused while it is decoded, before anything is built of its elements (msgspec
# checks a list's length before its items). One rank registers the layers of its own pipeline stage, whatever
# its TP; each layer belongs to one KV-cache group, so groups do not multiply planes. Per rank at PP 1:
#   Llama-3.1-405B      126 layers x 2 (K, V)                  = 252 planes (the deepest model vLLM serves)
#   Qwen3-235B-A22B      94 layers x 2                         = 188
#   DeepSeek-V3/R1       61 + 1 MTP layers x 1 (MLA latent)    =  62 (124 on vllm-ascend: nope and rope apart;
#                                                                    3 a layer with V3.2's indexer: 186)
#   Nemotron-H-56B      118 layers x 2 (K/V, or Mamba's conv and SSM state)   = 236
#   Qwen3-Next-80B       48 layers x 2, in 4 KV-cache groups (3 linear-attention, 1 full)  = 96
#   Gemma-3-27B          62 layers x 2, 2 groups (sliding window, full)   = 124
# So: 126 layers (+ a draft model's few: EAGLE, MTP), at most 3 planes a layer, 252 planes. The bounds are 4x
# that in layers and 8x in planes; benchmarks/bench_peer_messages.py encodes each of these.
MAX_KV_LAYERS = 512
MAX_PLANES_PER_LAYER = 4
MAX_PLANES = MAX_KV_LAYERS * MAX_PLANES_PER_LAYER  # 2048
MAX_LAYER_NAME_LENGTH = 256  # vLLM's are ~30-60 characters ("language_model.model.layers.93.self_attn.attn")
MAX_DTYPE_LENGTH = 64  # "bfloat16", "float8_e4m3fn"
MAX_KV_HEADS = 1 << 16  # real ones: 1 (MLA) .. 128; only compared, never allocated by
MAX_HEAD_SIZE = 1 << 16  # real ones: 64 .. 576 (MLA's latent + rope)

Count = Annotated[int, msgspec.Meta(ge=0, le=1 << 62)]
LayerName = Annotated[str, msgspec.Meta(max_length=MAX_LAYER_NAME_LENGTH)]


class RankRegistration(msgspec.Struct, frozen=True):
    """One worker's KV memory as its peers must address it. With pipeline stages, a rank registers the layers
    of its stage only; its rank within the engine is ``pp_rank * tp_size + tp_rank`` (:attr:`rank`). Every list
    and text is bounded by what a real one holds (above): a peer's bigger one does not decode."""

    engine_id: Id
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_TP_SIZE)]  # within its pipeline stage
    tp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_TP_SIZE)]
    segment: Annotated[str, msgspec.Meta(max_length=MAX_SEGMENT_LENGTH)]  # Mooncake target name, "host:rpc_port"
    # in layer order, then K/V order where they are separate
    planes: Annotated[list[PlaneGeometry], msgspec.Meta(max_length=MAX_PLANES)]
    # the inside of one block of each plane
    block_shapes: Annotated[list[BlockShape], msgspec.Meta(max_length=MAX_PLANES)]
    layer_names: Annotated[list[LayerName], msgspec.Meta(max_length=MAX_KV_LAYERS)]
    block_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_BLOCK_SIZE)]  # tokens per block
    num_blocks: Count  # this rank's own count (ranks of one engine may differ)
    dtype: Annotated[str, msgspec.Meta(max_length=MAX_DTYPE_LENGTH)]
    num_kv_heads: Annotated[int, msgspec.Meta(ge=0, le=MAX_KV_HEADS)]  # KV heads held by this rank
    total_num_kv_heads: Annotated[int, msgspec.Meta(ge=0, le=MAX_KV_HEADS)]  # KV heads of the model
    head_size: Annotated[int, msgspec.Meta(ge=0, le=MAX_HEAD_SIZE)]
    use_mla: bool = False
    protocol_version: Count = PROTOCOL_VERSION
    # empty: one full-attention group
    groups: Annotated[list[KVGroup], msgspec.Meta(max_length=MAX_KV_GROUPS)] = msgspec.field(default_factory=list)
    # group index of each plane; empty: all 0
    plane_groups: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_KV_GROUPS)]],
                            msgspec.Meta(max_length=MAX_PLANES)] = msgspec.field(default_factory=list)
    incarnation: OptionalId = ""  # drawn at each start of P (the params carry it too)
    model_fingerprint: OptionalId = ""  # what must match between P and D beyond the KV geometry (the model)
    pp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_PP_SIZE)] = 0
    pp_size: Annotated[int, msgspec.Meta(ge=1, le=MAX_PP_SIZE)] = 1
    # layer index of each plane; empty: as many per layer
    plane_layers: Annotated[list[Annotated[int, msgspec.Meta(ge=0, lt=MAX_KV_LAYERS)]],
                            msgspec.Meta(max_length=MAX_PLANES)] = msgspec.field(default_factory=list)

    @property
    def rank(self) -> int:
        """This rank within its engine: every stage's TP ranks, stage by stage."""
        return self.pp_rank * self.tp_size + self.tp_rank

    def kv_groups(self) -> tuple[KVGroup, ...]:
        return tuple(self.groups) or single_full_group(self.block_size)

    def group_of_planes(self) -> tuple[int, ...]:
        return tuple(self.plane_groups) or (0,) * len(self.planes)

    def layer_of_planes(self) -> tuple[int, ...]:
        return tuple(self.plane_layers) or layers_of_planes(len(self.planes), len(self.layer_names))

    def plane_name(self, plane: int) -> str:
        """A plane as an operator knows it: its layer, and K or V where they are separate planes (NPU)."""
        of_plane = self.layer_of_planes()
        if not self.layer_names or plane >= len(of_plane):
            return f"plane {plane}"
        layer = of_plane[plane]
        same = [i for i, x in enumerate(of_plane) if x == layer]
        if len(same) == 2:
            return f"layer {self.layer_names[layer]} {'KV'[same.index(plane)]}"
        name = self.layer_names[layer]
        return f"layer {name}" if len(same) == 1 else f"layer {name} plane {plane}"


def layers_of_planes(num_planes: int, num_layers: int) -> tuple[int, ...]:
    """The layer of each plane when every layer has as many planes (a registration that does not say)."""
    per_layer = num_planes // num_layers if num_layers and num_planes % num_layers == 0 else 0
    return tuple(i // per_layer for i in range(num_planes)) if per_layer else (0,) * num_planes


# --------------------------------------------------------------------------- side-channel messages


class GetRegistration(msgspec.Struct, frozen=True, tag="get_registration"):
    # the rank within the engine (RankRegistration.rank; the TP rank when P has one stage)
    tp_rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_ENGINE_RANKS)]


class GetRankTable(msgspec.Struct, frozen=True, tag="get_rank_table"):
    """D asks P's entry point (the params' ``remote_host:remote_port``) where each rank of that engine listens."""


class RankEndpoint(msgspec.Struct, frozen=True, array_like=True):
    """Where one P rank's side channel listens, as that rank advertises it (its own node's address)."""

    rank: Annotated[int, msgspec.Meta(ge=0, lt=MAX_ENGINE_RANKS)]  # within the engine (RankRegistration.rank)
    host: Annotated[str, msgspec.Meta(min_length=1, max_length=MAX_HOST_LENGTH)]
    port: Annotated[int, msgspec.Meta(ge=1, le=65535)]


class Claim(msgspec.Struct, frozen=True, tag="claim"):
    """D asks P to pin a hold's blocks while it reads them (a lease)."""

    request_id: OptionalId
    hold_id: OptionalId
    reader: Reader  # "<D engine id>:<D tp rank>"
    expected_readers: int  # how many D readers will claim this hold on this P rank
    # Random per pull, known only to D and P: a claim resent after a lost reply (same id) gets the same lease
    # back; anyone else naming this reader does not.
    claim_id: OptionalId = ""
    # D has no registration of this rank yet: send it with the reply (one round trip instead of two for a new P;
    # a P of an older release ignores the field and D fetches it after the claim).
    with_registration: bool = False
    # D's wall clock (ms since the epoch) after which D no longer reads for this pull; 0: not given (an older D).
    # P refuses a claim that arrives clock_skew or more after it, and no lease runs past it + clock_skew.
    deadline_ms: int = 0


class Renew(msgspec.Struct, frozen=True, tag="renew"):
    request_id: OptionalId
    hold_id: OptionalId
    reader: Reader
    lease_token: OptionalId = ""  # from the claim's ClaimReply: without it P refuses


#: Bounds on one integrity question (vllm_kvp2p/lifecycle/integrity.py); a bigger one is not answered.
MAX_DIGEST_UNITS = 4096
MAX_DIGEST_RANGES = 65536
#: What D lets one question weigh, encoded: half of the largest request P's side channel takes (64 KiB,
#: vllm_kvp2p/side_channel.MAX_REQUEST_BYTES; a bigger frame gets the connection dropped, and the release lost).
MAX_DIGEST_QUESTION_BYTES = 32 << 10


class UnitRanges(msgspec.Struct, frozen=True, array_like=True):
    """Bytes of one unit (plane ``plane`` of P, block ``block``) D read: ``ranges`` is ``[offset, length, ...]``."""

    plane: int
    block: int
    ranges: Annotated[list[int], msgspec.Meta(max_length=2 * MAX_DIGEST_RANGES)]


class DigestQuery(msgspec.Struct, frozen=True, array_like=True):
    """Which bytes of the held blocks P is asked to sum (vllm_kvp2p/transfer/digest.py), in D's order."""

    units: Annotated[list[UnitRanges], msgspec.Meta(max_length=MAX_DIGEST_UNITS)]


class UnitSums(msgspec.Struct, frozen=True, array_like=True):
    """P's digest of one queried unit: the exact byte sums of vllm_kvp2p/transfer/digest.py. Their values are not
    bounded here: any integer only compares unequal to D's own (an absurd answer fails the pull as corrupted)."""

    total: int
    weighted: int


MAX_ANSWER_WITHIN_MS = 1 << 31  # a release's answer_within_ms: any real budget; refuses absurd values


class Release(msgspec.Struct, frozen=True, tag="release"):
    """D is done with the hold (read, failed, or had nothing to read): P may free it."""

    request_id: OptionalId
    hold_id: OptionalId
    reader: Reader
    expected_readers: int = 1
    pulled: bool = False
    lease_token: OptionalId = ""  # from the claim's ClaimReply; "" from a reader with no lease (it only notifies)
    # The integrity question for what this reader read (None: none asked); P answers it before it frees anything.
    verify: DigestQuery | None = None
    # How long D waits for the answer, from sending it (ms; 0: not said, an older D): P answers a question whose sums
    # would end later at once without them (vllm_kvp2p/lifecycle/question_queue.py). A duration, not D's wall clock.
    answer_within_ms: Annotated[int, msgspec.Meta(ge=0, le=MAX_ANSWER_WITHIN_MS)] = 0


#: A peer's text meant for logs (a refusal's reason, an error): real ones are under 600 characters.
MAX_REASON_LENGTH = 4096
Reason = Annotated[str, msgspec.Meta(max_length=MAX_REASON_LENGTH)]
#: Seconds a lease may last: far beyond any hold_timeout + lease_timeout; refuses inf and NaN.
MAX_LEASE_S = float(1 << 31)


class ClaimStatus(str, Enum):
    GRANTED = "granted"
    REFUSED = "refused"  # P no longer holds (expired/released) or never held these blocks: recompute
    UNKNOWN = "unknown"  # P has not heard of the hold yet (it learns one engine step late): retry shortly


class Registration(msgspec.Struct, frozen=True, tag="registration"):
    registration: RankRegistration


class ClaimReply(msgspec.Struct, frozen=True, tag="claim_reply"):
    status: ClaimStatus
    lease: Annotated[float, msgspec.Meta(ge=0, le=MAX_LEASE_S)] = 0.0  # seconds the claim stays valid unrenewed
    reason: Reason = ""
    lease_token: OptionalId = ""  # GRANTED: what renewals and the release of this lease must carry
    registration: RankRegistration | None = None  # this rank's, when the claim asked for it


class RankTable(msgspec.Struct, frozen=True, tag="rank_table"):
    """Every rank of one P engine (one incarnation), gathered over vLLM's process groups at registration: the ranks
    of an engine that spans nodes listen on their own nodes' addresses (vllm_kvp2p/lifecycle/rank_table.py)."""

    engine_id: Id
    incarnation: OptionalId
    ranks: Annotated[list[RankEndpoint], msgspec.Meta(max_length=MAX_ENGINE_RANKS)]


class Ack(msgspec.Struct, frozen=True, tag="ack"):
    pass


class Released(msgspec.Struct, frozen=True, tag="released"):
    """P's answer to a release: whether the reader's lease held from its claim to this release. A read counts as
    good only when it did (otherwise the blocks may have been freed and reused under it)."""

    lease_held: bool
    # the answer to the release's question, in its order (None: not answered): one per unit asked, at most
    sums: Annotated[list[UnitSums], msgspec.Meta(max_length=MAX_DIGEST_UNITS)] | None = None
    # No sums because this is a release P answered before and their answer is no longer kept (a resent release: D
    # counts the pull "sums_lost", not "unverified"); an older P never sets it.
    sums_lost: bool = False
    # Why a release that asked a question got no sums ("": it got them, or an older P): one of
    # lifecycle/integrity.NoSums' values, e.g. "busy" (its sums would end after D's budget). Text, not an enum, so
    # that a newer P's reason never makes the reply undecodable.
    no_sums: Annotated[str, msgspec.Meta(max_length=64)] = ""


class ErrorReply(msgspec.Struct, frozen=True, tag="error"):
    message: Reason  # a server cuts its own to this (vllm_kvp2p/contract/side_channel.py)


class Abandon(msgspec.Struct, frozen=True, tag="abandon"):
    """Whoever holds a hold's params will not deliver them to a decoder (the proxy: D refused the request before
    its engine, D was unreachable, the client left): P may free the hold now instead of at ``hold_timeout``. P
    frees it only if no reader has claimed or released it yet (a reader that did is D's engine at work, and its own
    release ends the hold); otherwise the abandon changes nothing. Authorised by the params themselves: their hold
    id (random per hold) and, when P signed them, their ``mac``, which P compares with the one it issued. So it
    may come unsealed from a sender without the shared secret (vllm_kvp2p/contract/side_channel.py): only who holds the
    params can abandon their hold, and abandoning the same hold twice changes nothing."""

    request_id: OptionalId
    hold_id: OptionalId
    mac: OptionalId = ""  # the params' mac ("" for params P did not sign)


class AbandonOutcome(str, Enum):
    RELEASED = "released"  # P freed the hold
    REMEMBERED = "remembered"  # P has not heard of the hold yet (it learns one an engine step late): freed on arrival
    UNKNOWN = "unknown"  # P has not heard of the hold yet and does not remember an unsealed abandon: send it again
    IN_USE = "in_use"  # a reader claimed or released it: D's engine has the request, its release ends the hold
    ENDED = "ended"  # already released or expired
    REFUSED = "refused"  # the params do not match the hold (another hold id, a wrong mac), or a bound was hit


class Abandoned(msgspec.Struct, frozen=True, tag="abandoned"):
    """P's answer to an :class:`Abandon`."""

    outcome: AbandonOutcome
    reason: Reason = ""


Request = Union[GetRegistration, GetRankTable, Claim, Renew, Release, Abandon]
Reply = Union[Registration, RankTable, ClaimReply, Ack, Released, ErrorReply, Abandoned]

_request_decoder = msgspec.msgpack.Decoder(Request)
_abandon_decoder = msgspec.msgpack.Decoder(Abandon)
_reply_decoder = msgspec.msgpack.Decoder(Reply)
_encoder = msgspec.msgpack.Encoder()


def encode(message: Request | Reply) -> bytes:
    return _encoder.encode(message)


def decode_request(data: bytes) -> Request:
    return _request_decoder.decode(data)


def decode_abandon(data: bytes) -> Abandon:
    """An :class:`Abandon` and nothing else: the one request P takes unsealed when it has a shared secret."""
    return _abandon_decoder.decode(data)


def decode_reply(data: bytes) -> Reply:
    return _reply_decoder.decode(data)
