"""Every message a peer sends is bounded by what a real one can be (issue 37, item 3).

D decodes P's replies on a pull thread of the worker process that holds the model; P decodes D's requests on its
side-channel thread. Each bound of protocol.py's types is shown to matter: the message one over it, which the same
types without their bounds (what was decoded before) accept, is refused while it is decoded, naming the field;
the message at the bound, and every real-sized one, still decodes. The frame bound (side_channel.MAX_REPLY_BYTES)
is shown over a real ZMQ socket: a reply of MAX_REPLY_BYTES arrives, one byte more fails the request at once,
saying why, with no frame buffered."""

from __future__ import annotations

import re
import threading
import time
import tracemalloc
import typing
from collections.abc import Callable, Iterator
from typing import Annotated, Any, Union

import msgspec
import pytest
import zmq

from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import (
    MAX_DIGEST_UNITS,
    MAX_ENGINE_RANKS,
    MAX_HOST_LENGTH,
    MAX_ID_LENGTH,
    MAX_KV_GROUPS,
    MAX_KV_LAYERS,
    MAX_LAYER_NAME_LENGTH,
    MAX_PLANES,
    MAX_READER_LENGTH,
    MAX_REASON_LENGTH,
    Claim,
    ClaimReply,
    ClaimStatus,
    GetRegistration,
    RankEndpoint,
    RankRegistration,
    RankTable,
    Registration,
    Release,
    Released,
    Renew,
    UnitSums,
)
from vllm_kvp2p.contract.side_channel import MAX_REPLY_BYTES, SideChannelClient, SideChannelError
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.interior import MAX_LAYOUT_DIGEST_LENGTH, PartLayout
from vllm_kvp2p.transfer.kv_groups import FULL, SLIDING, STATE, KVGroup
from vllm_kvp2p.transfer.slicing import MAX_PARTS, BlockShape

# --------------------------------------------------------------------------- the types without their bounds

_stripped: dict[type, type] = {}
#: The modules whose structs peers send (protocol.py's, and the registration's parts defined elsewhere).
_PEER_TYPE_MODULES = {protocol.__name__, "vllm_kvp2p.transfer.slicing", "vllm_kvp2p.transfer.interior",
                      "vllm_kvp2p.transfer.kv_groups"}


def unbounded(tp: Any) -> Any:
    """``tp`` with every msgspec.Meta bound removed, protocol.py's structs rebuilt alike: what D and P decoded with
    before this change wherever a bound is new."""
    origin = typing.get_origin(tp)
    if origin is Annotated:
        return unbounded(typing.get_args(tp)[0])
    if origin is list:
        return list[unbounded(typing.get_args(tp)[0])]  # type: ignore[misc]
    if origin is tuple and typing.get_args(tp)[1:] == (Ellipsis,):
        return tuple[unbounded(typing.get_args(tp)[0]), ...]  # type: ignore[misc]
    if origin is Union or str(origin) == "<class 'types.UnionType'>":
        return Union[tuple(unbounded(a) for a in typing.get_args(tp))]  # type: ignore[return-value]
    if isinstance(tp, type) and issubclass(tp, msgspec.Struct) and tp.__module__ in _PEER_TYPE_MODULES:
        if tp not in _stripped:
            config = tp.__struct_config__
            fields = [(f.name, unbounded(f.type), f.default if f.default is not msgspec.NODEFAULT else
                       msgspec.field(default_factory=f.default_factory))
                      if (f.default is not msgspec.NODEFAULT or f.default_factory is not msgspec.NODEFAULT)
                      else (f.name, unbounded(f.type)) for f in msgspec.structs.fields(tp)]
            _stripped[tp] = msgspec.defstruct(f"Unbounded{tp.__name__}", fields, tag=config.tag,
                                              array_like=config.array_like, frozen=True)
        return _stripped[tp]
    return tp


_old_replies = msgspec.msgpack.Decoder(unbounded(protocol.Reply))
_old_requests = msgspec.msgpack.Decoder(unbounded(protocol.Request))


# --------------------------------------------------------------------------- real registrations

CPU_LAYOUTS = (PartLayout(1, 16, 2, "16x8:0123456789abcdef"), PartLayout())
#: Every part's layout at its bounds (both parts, the longest order name).
BOUND_LAYOUTS = (PartLayout(1 << 20, 1 << 20, 64, "o" * MAX_LAYOUT_DIGEST_LENGTH),) * MAX_PARTS


def real(layers: int, planes_per_layer: int, groups: list[KVGroup], *, mla: bool = False,
         prefix: str = "language_model.model.layers") -> RankRegistration:
    """A registration shaped as the model's at PP 1: its layers, vLLM's names, 48-bit addresses, 2 M blocks."""
    n = layers * planes_per_layer
    planes = [PlaneGeometry(0x7F3A_0000_0000 + i * (1 << 36), 1 << 17, 1 << 17, 2_000_000) for i in range(n)]
    shape = BlockShape(False, 1, 128, 1152) if mla else BlockShape(True, 8, 128, 256, 2, CPU_LAYOUTS)
    return RankRegistration(
        "prefill-0123456789abcdef", 7, 8, "fd12:3456:789a:1::1234:16001", planes, [shape] * n,
        [f"{prefix}.{i}.self_attn.attn" for i in range(layers)], 128, 2_000_000, "bfloat16", 1 if mla else 8,
        1 if mla else 64, 576 if mla else 128, use_mla=mla, groups=groups,
        plane_groups=[(i // planes_per_layer) % len(groups) for i in range(n)],
        incarnation="0123456789abcdef0123456789abcdef", model_fingerprint="fedcba9876543210",
        plane_layers=[i // planes_per_layer for i in range(n)],
    )


REAL = {
    "Llama-3.1-405B + EAGLE draft": lambda: real(127, 2, [KVGroup(FULL, 128)]),
    "Qwen3-235B-A22B": lambda: real(94, 2, [KVGroup(FULL, 128)]),
    "DeepSeek-V3/R1 + MTP (MLA)": lambda: real(62, 1, [KVGroup(FULL, 128)], mla=True),
    "DeepSeek-V3.2 on vllm-ascend": lambda: real(62, 3, [KVGroup(FULL, 128)], mla=True),
    "Nemotron-H-56B": lambda: real(118, 2, [KVGroup(STATE, 128)] * 9 + [KVGroup(FULL, 128)]),
    "Qwen3-Next-80B": lambda: real(48, 2, [KVGroup(STATE, 128)] * 3 + [KVGroup(FULL, 128)]),
    "Gemma-3-27B": lambda: real(62, 2, [KVGroup(SLIDING, 128, 1024), KVGroup(FULL, 128)]),
}
AUTH = Authenticator(b"bounds-test-secret-0123456789abcdef", 30)


@pytest.mark.parametrize("model", list(REAL))
def test_every_real_registration_decodes_far_within_the_frame(model: str) -> None:
    reg = REAL[model]()
    for reply in (Registration(reg), ClaimReply(ClaimStatus.GRANTED, 30.0, lease_token="t" * 32, registration=reg)):
        data = protocol.encode(reply)
        assert protocol.decode_reply(data) == reply
        # 23.8 KB for the largest (Llama-3.1-405B with a draft model): the frame bound is 20x that.
        assert len(AUTH.seal_reply(data, b"n" * 16, 0)) * 20 < MAX_REPLY_BYTES


def at_every_bound() -> RankRegistration:
    big = 1 << 62
    return RankRegistration(
        "e" * MAX_ID_LENGTH, 1023, 1024, "h" * protocol.MAX_SEGMENT_LENGTH, [PlaneGeometry(big, big, big, big)] *
        MAX_PLANES, [BlockShape(True, 1 << 16, 1 << 20, 1 << 40, MAX_PARTS, BOUND_LAYOUTS)] * MAX_PLANES,
        ["n" * MAX_LAYER_NAME_LENGTH] * MAX_KV_LAYERS, 1 << 20, big, "d" * protocol.MAX_DTYPE_LENGTH, 1 << 16,
        1 << 16, 1 << 16, protocol_version=big, groups=[KVGroup(SLIDING, 1 << 20, 1 << 40)] * MAX_KV_GROUPS,
        plane_groups=[MAX_KV_GROUPS - 1] * MAX_PLANES, incarnation="i" * MAX_ID_LENGTH,
        model_fingerprint="f" * MAX_ID_LENGTH, pp_rank=63, pp_size=64, plane_layers=[MAX_KV_LAYERS - 1] * MAX_PLANES,
    )


def test_whatever_the_types_accept_fits_the_frame() -> None:
    """The frame bound never refuses what the types let through (the biggest of each reply, sealed)."""
    rank_table = RankTable("e" * MAX_ID_LENGTH, "i" * MAX_ID_LENGTH,
                           [RankEndpoint(r, "h" * MAX_HOST_LENGTH, 65535) for r in range(MAX_ENGINE_RANKS)])
    sums = Released(True, [UnitSums((1 << 63) - 1, (1 << 63) - 1)] * MAX_DIGEST_UNITS)
    claim = ClaimReply(ClaimStatus.GRANTED, 1e9, "r" * MAX_REASON_LENGTH, "t" * MAX_ID_LENGTH, at_every_bound())
    for reply in (Registration(at_every_bound()), claim, rank_table, sums):
        data = protocol.encode(reply)
        assert protocol.decode_reply(data) == reply
        assert len(AUTH.seal_reply(data, b"n" * 16, 0)) <= MAX_REPLY_BYTES, type(reply).__name__


# --------------------------------------------------------------------------- one over each bound

def registration_with(**changes: object) -> bytes:
    """A real registration reply (DeepSeek-V3's) with fields replaced, encoded as a peer would send it."""
    reg = msgspec.to_builtins(REAL["DeepSeek-V3/R1 + MTP (MLA)"]())
    reg.update(changes)
    return msgspec.msgpack.encode({"type": "registration", "registration": reg})


PLANE = [1 << 40, 4096, 4096, 10]
SHAPE = [False, 1, 128, 1152, 1, []]
REGISTRATION_BOUNDS: dict[str, tuple[dict[str, object], dict[str, object]]] = {
    # field: (at the bound: decodes, one over: refused)
    "planes": ({"planes": [PLANE] * MAX_PLANES}, {"planes": [PLANE] * (MAX_PLANES + 1)}),
    "block_shapes": ({"block_shapes": [SHAPE] * MAX_PLANES}, {"block_shapes": [SHAPE] * (MAX_PLANES + 1)}),
    "layer_names": ({"layer_names": ["l"] * MAX_KV_LAYERS}, {"layer_names": ["l"] * (MAX_KV_LAYERS + 1)}),
    "block_shapes[0][5]": (  # part layouts
        {"block_shapes": [[False, 1, 128, 1152, 2, [[0, 1, 0, ""]] * MAX_PARTS]]},
        {"block_shapes": [[False, 1, 128, 1152, 2, [[0, 1, 0, ""]] * (MAX_PARTS + 1)]]}),
    "block_shapes[0][5][0][3]": (  # a layout's order name
        {"block_shapes": [[False, 1, 128, 1152, 1, [[0, 1, 0, "o" * MAX_LAYOUT_DIGEST_LENGTH]]]]},
        {"block_shapes": [[False, 1, 128, 1152, 1, [[0, 1, 0, "o" * (MAX_LAYOUT_DIGEST_LENGTH + 1)]]]]}),
    "block_shapes[0][4]": (  # parts
        {"block_shapes": [[False, 1, 128, 1152, MAX_PARTS, []]]},
        {"block_shapes": [[False, 1, 128, 1152, MAX_PARTS + 1, []]]}),
    "groups[0].kind": ({"groups": [{"kind": "k" * 16, "block_size": 16}]},
                       {"groups": [{"kind": "k" * 17, "block_size": 16}]}),
    "layer_names[0]": ({"layer_names": ["n" * MAX_LAYER_NAME_LENGTH]},
                       {"layer_names": ["n" * (MAX_LAYER_NAME_LENGTH + 1)]}),
    "plane_groups": ({"plane_groups": [0] * MAX_PLANES}, {"plane_groups": [0] * (MAX_PLANES + 1)}),
    "plane_groups[0]": ({"plane_groups": [MAX_KV_GROUPS - 1]}, {"plane_groups": [MAX_KV_GROUPS]}),
    "plane_layers": ({"plane_layers": [0] * MAX_PLANES}, {"plane_layers": [0] * (MAX_PLANES + 1)}),
    "plane_layers[0]": ({"plane_layers": [MAX_KV_LAYERS - 1]}, {"plane_layers": [MAX_KV_LAYERS]}),
    "groups": ({"groups": [{"kind": FULL, "block_size": 16}] * MAX_KV_GROUPS},
               {"groups": [{"kind": FULL, "block_size": 16}] * (MAX_KV_GROUPS + 1)}),
    "engine_id": ({"engine_id": "e" * MAX_ID_LENGTH}, {"engine_id": "e" * (MAX_ID_LENGTH + 1)}),
    "segment": ({"segment": "s" * protocol.MAX_SEGMENT_LENGTH}, {"segment": "s" * (protocol.MAX_SEGMENT_LENGTH + 1)}),
    "dtype": ({"dtype": "d" * protocol.MAX_DTYPE_LENGTH}, {"dtype": "d" * (protocol.MAX_DTYPE_LENGTH + 1)}),
    "incarnation": ({"incarnation": "i" * MAX_ID_LENGTH}, {"incarnation": "i" * (MAX_ID_LENGTH + 1)}),
    "model_fingerprint": ({"model_fingerprint": "f" * MAX_ID_LENGTH},
                          {"model_fingerprint": "f" * (MAX_ID_LENGTH + 1)}),
    "tp_rank": ({"tp_rank": protocol.MAX_TP_SIZE - 1}, {"tp_rank": protocol.MAX_TP_SIZE}),
    "tp_size": ({"tp_size": protocol.MAX_TP_SIZE}, {"tp_size": protocol.MAX_TP_SIZE + 1}),
    "pp_rank": ({"pp_rank": protocol.MAX_PP_SIZE - 1}, {"pp_rank": protocol.MAX_PP_SIZE}),
    "pp_size": ({"pp_size": protocol.MAX_PP_SIZE}, {"pp_size": protocol.MAX_PP_SIZE + 1}),
    "block_size": ({"block_size": protocol.MAX_BLOCK_SIZE}, {"block_size": 0}),
    "num_blocks": ({"num_blocks": 1 << 62}, {"num_blocks": -1}),
    "num_kv_heads": ({"num_kv_heads": protocol.MAX_KV_HEADS}, {"num_kv_heads": protocol.MAX_KV_HEADS + 1}),
    "total_num_kv_heads": ({"total_num_kv_heads": protocol.MAX_KV_HEADS},
                           {"total_num_kv_heads": protocol.MAX_KV_HEADS + 1}),
    "head_size": ({"head_size": protocol.MAX_HEAD_SIZE}, {"head_size": protocol.MAX_HEAD_SIZE + 1}),
}


@pytest.mark.parametrize("field", list(REGISTRATION_BOUNDS))
def test_each_registration_bound_refuses_one_over_and_keeps_the_bound(field: str) -> None:
    at, over = (registration_with(**changes) for changes in REGISTRATION_BOUNDS[field])
    assert isinstance(protocol.decode_reply(at), Registration)
    assert _old_replies.decode(over) is not None  # before: decoded, for D's checks to look at afterwards
    path = re.escape(f"$.registration.{field}")
    with pytest.raises(msgspec.ValidationError, match=f"at `{path}`"):
        protocol.decode_reply(over)


def reply(**fields: object) -> bytes:
    return msgspec.msgpack.encode(fields)


OTHER_REPLY_BOUNDS: dict[str, tuple[bytes, bytes, str]] = {
    # (at the bound, one over, the path refused)
    "rank table: ranks": (
        reply(type="rank_table", engine_id="e", incarnation="", ranks=[[0, "10.0.0.1", 1]] * MAX_ENGINE_RANKS),
        reply(type="rank_table", engine_id="e", incarnation="", ranks=[[0, "10.0.0.1", 1]] * (MAX_ENGINE_RANKS + 1)),
        r"\$\.ranks"),
    "rank table: host": (
        reply(type="rank_table", engine_id="e", incarnation="", ranks=[[0, "h" * MAX_HOST_LENGTH, 1]]),
        reply(type="rank_table", engine_id="e", incarnation="", ranks=[[0, "h" * (MAX_HOST_LENGTH + 1), 1]]),
        r"\$\.ranks\[0\]\[1\]"),
    "rank table: engine id": (
        reply(type="rank_table", engine_id="e" * MAX_ID_LENGTH, incarnation="", ranks=[]),
        reply(type="rank_table", engine_id="e" * (MAX_ID_LENGTH + 1), incarnation="", ranks=[]),
        r"\$\.engine_id"),
    "integrity sums: how many": (
        reply(type="released", lease_held=True, sums=[[1, 2]] * MAX_DIGEST_UNITS),
        reply(type="released", lease_held=True, sums=[[1, 2]] * (MAX_DIGEST_UNITS + 1)),
        r"\$\.sums"),
    "claim reply: reason": (
        reply(type="claim_reply", status="refused", reason="r" * MAX_REASON_LENGTH),
        reply(type="claim_reply", status="refused", reason="r" * (MAX_REASON_LENGTH + 1)),
        r"\$\.reason"),
    "claim reply: lease token": (
        reply(type="claim_reply", status="granted", lease_token="t" * MAX_ID_LENGTH),
        reply(type="claim_reply", status="granted", lease_token="t" * (MAX_ID_LENGTH + 1)),
        r"\$\.lease_token"),
    "claim reply: lease (inf)": (
        reply(type="claim_reply", status="granted", lease=protocol.MAX_LEASE_S),
        reply(type="claim_reply", status="granted", lease=float("inf")),
        r"\$\.lease"),
    "claim reply: lease (NaN)": (
        reply(type="claim_reply", status="granted", lease=0.0),
        reply(type="claim_reply", status="granted", lease=float("nan")),
        r"\$\.lease"),
    "error: message": (
        reply(type="error", message="m" * MAX_REASON_LENGTH),
        reply(type="error", message="m" * (MAX_REASON_LENGTH + 1)),
        r"\$\.message"),
}


@pytest.mark.parametrize("case", list(OTHER_REPLY_BOUNDS))
def test_each_other_reply_bound(case: str) -> None:
    at, over, path = OTHER_REPLY_BOUNDS[case]
    protocol.decode_reply(at)
    if not case.startswith("rank table"):  # a rank table was bounded before too
        _old_replies.decode(over)
    with pytest.raises(msgspec.ValidationError, match=f"at `{path}`"):
        protocol.decode_reply(over)


REQUEST_BOUNDS: dict[str, tuple[protocol.Request, bytes, str]] = {
    # P decodes these from any peer: (a real one at the bound, one over, the path refused)
    "claim: request id": (Claim("r" * MAX_ID_LENGTH, "h", "d:0", 1),
                          reply(type="claim", request_id="r" * (MAX_ID_LENGTH + 1), hold_id="h", reader="d:0",
                                expected_readers=1), r"\$\.request_id"),
    "claim: reader": (Claim("r", "h", "d" * MAX_READER_LENGTH, 1),
                      reply(type="claim", request_id="r", hold_id="h", reader="d" * (MAX_READER_LENGTH + 1),
                            expected_readers=1), r"\$\.reader"),
    "claim: claim id": (Claim("r", "h", "d:0", 1, "c" * MAX_ID_LENGTH),
                        reply(type="claim", request_id="r", hold_id="h", reader="d:0", expected_readers=1,
                              claim_id="c" * (MAX_ID_LENGTH + 1)), r"\$\.claim_id"),
    "renew: lease token": (Renew("r", "h", "d:0", "t" * MAX_ID_LENGTH),
                           reply(type="renew", request_id="r", hold_id="h", reader="d:0",
                                 lease_token="t" * (MAX_ID_LENGTH + 1)), r"\$\.lease_token"),
    "release: hold id": (Release("r", "h" * MAX_ID_LENGTH, "d:0"),
                         reply(type="release", request_id="r", hold_id="h" * (MAX_ID_LENGTH + 1), reader="d:0"),
                         r"\$\.hold_id"),
    "get registration: rank": (GetRegistration(MAX_ENGINE_RANKS - 1),
                               reply(type="get_registration", tp_rank=MAX_ENGINE_RANKS), r"\$\.tp_rank"),
}


@pytest.mark.parametrize("case", list(REQUEST_BOUNDS))
def test_each_request_bound(case: str) -> None:
    at, over, path = REQUEST_BOUNDS[case]
    assert protocol.decode_request(protocol.encode(at)) == at
    _old_requests.decode(over)
    with pytest.raises(msgspec.ValidationError, match=f"at `{path}`"):
        protocol.decode_request(over)


# --------------------------------------------------------------------------- what a flood costs


def peak_mib(fn: Callable[[], object]) -> tuple[float, float]:
    """(tracemalloc's peak in MiB, seconds) of ``fn``; a refusal counts as done."""
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        fn()
    except msgspec.ValidationError:
        pass
    took = time.perf_counter() - t0
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak / (1 << 20), took


def test_a_flood_of_planes_and_names_is_refused_before_any_is_built() -> None:
    """The issue's finding, scaled down (300,000 planes and names, 2.1 MB, 23 MiB decoded; the finding was 1.7 M
    planes and 4.2 M names in 25.6 MiB: +313 MiB, 0.59 s): the same types without their bounds build it all; now the
    reply is refused at the planes' length, before one plane is built."""
    data = registration_with(planes=[[0, 0, 0, 0]] * 300_000, layer_names=["l"] * 300_000)
    before, _ = peak_mib(lambda: _old_replies.decode(data))
    now, took = peak_mib(lambda: protocol.decode_reply(data))
    assert before > 15, before  # 23 MiB of planes (and names)
    assert now < 0.1 and took < 0.05, (now, took)


# --------------------------------------------------------------------------- the frame, over a real socket


class RawP:
    """A ROUTER on 127.0.0.1 answering every request with the same pre-encoded frame (what a hostile or broken P
    sends), and counting the requests."""

    def __init__(self, frame: bytes) -> None:
        self.frame, self.requests = frame, 0
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        self.port = self._sock.bind_to_random_port("tcp://127.0.0.1")
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._stop.is_set():
            if self._sock.poll(50):
                identity, *_ = self._sock.recv_multipart()
                self.requests += 1
                self._sock.send_multipart([identity, b"", self.frame])

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        self._sock.close()
        self._ctx.term()


@pytest.fixture
def client() -> Iterator[SideChannelClient]:
    c = SideChannelClient(timeout=5.0)
    yield c
    c.close()


def padded_registration(size: int) -> bytes:
    """A registration reply of exactly ``size`` bytes: a real one whose first block shape carries more part layouts
    than the types allow (every list is bounded, so no valid reply is this big), then a layer name's length to the
    byte: a frame that arrives is refused by the decoder, naming the field."""
    base = msgspec.to_builtins(REAL["DeepSeek-V3/R1 + MTP (MLA)"]())
    shape = list(base["block_shapes"][0])
    base["block_shapes"] = [shape] + base["block_shapes"][1:]
    encoded = lambda: msgspec.msgpack.encode({"type": "registration", "registration": base})  # noqa: E731
    shape[5] = [[0, 1, 0, ""]] * ((size - len(encoded())) // 5 - 4)
    name = base["layer_names"][0]
    while len(encoded()) < size:
        base["layer_names"][0] += "x"
    assert len(encoded()) == size and len(base["layer_names"][0]) - len(name) < 40
    return encoded()


def test_the_frame_bound_to_the_byte_over_a_real_socket(client: SideChannelClient) -> None:
    """A reply of MAX_REPLY_BYTES arrives (and its decoder refuses it, naming the list over its bound); one byte
    more fails the request within a few ms per attempt (it waited out the whole 5 s budget before: nothing told
    the client its reply had been dropped), saying why. The biggest valid reply through the same socket decodes."""
    p = RawP(protocol.encode(Registration(at_every_bound())))
    try:
        assert client.request("127.0.0.1", p.port, GetRegistration(0)) == Registration(at_every_bound())
    finally:
        p.close()
    for size, ok in ((MAX_REPLY_BYTES, True), (MAX_REPLY_BYTES + 1, False)):
        p = RawP(padded_registration(size))
        try:
            t0 = time.monotonic()
            if ok:
                with pytest.raises(SideChannelError, match=r"undecodable reply .*block_shapes\[0\]\[5\]"):
                    client.request("127.0.0.1", p.port, GetRegistration(0))
            else:
                with pytest.raises(SideChannelError, match=f"{MAX_REPLY_BYTES >> 10} KiB bound") as err:
                    client.request("127.0.0.1", p.port, GetRegistration(0))
                assert "closed the connection before its reply arrived" in str(err.value)
                assert p.requests == client.attempts  # each attempt asked, each reply dropped
            assert time.monotonic() - t0 < 1.0
        finally:
            p.close()


def test_a_servers_own_error_is_cut_to_what_a_client_decodes(client: SideChannelClient) -> None:
    """A handler's exception of 100,000 characters: the client gets P's error as such (cut to MAX_REASON_LENGTH),
    not an undecodable reply."""
    from vllm_kvp2p.contract.side_channel import SideChannelServer
    from vllm_kvp2p.testing.server import free_port

    def handler(message: protocol.Request) -> protocol.Reply:
        raise ValueError("x" * 100_000)

    port = free_port("127.0.0.1")
    server = SideChannelServer("127.0.0.1", port, handler)
    try:
        with pytest.raises(SideChannelError, match="answered with an error: ValueError: xxx") as err:
            client.request("127.0.0.1", port, GetRegistration(0))
        assert "undecodable" not in str(err.value)
    finally:
        server.close()


# --------------------------------------------------------------------------- rank tables D keeps


class TablesFromAnyone:
    """A side-channel client whose every entry point answers a valid table of ``ranks`` ranks (what P engines of
    that size, or a client's own side channels named by unsigned params, answer)."""

    def __init__(self, ranks: int) -> None:
        self.ranks, self.asked = ranks, 0

    def request(self, host: str, port: int, message: object, timeout: float | None = None) -> RankTable:
        self.asked += 1
        return RankTable("p", "", [RankEndpoint(r, host if r == 0 else f"fd00::{r:x}", port if r == 0 else 20000 + r)
                                   for r in range(self.ranks)])


def resolve_many(tables: object, client: TablesFromAnyone, entries: int) -> None:
    from vllm_kvp2p.contract.protocol import RemotePrefill
    from vllm_kvp2p.lifecycle.consumer import PullPlan

    for i in range(entries):
        remote = RemotePrefill("p", "r", "10.0.0.1", 1 + i, [[1]], "h", 16, 16, tp_size=client.ranks)
        plan = tables.resolve(PullPlan("d", remote, ((2,),), ((1,),), True), client, 1.0)  # type: ignore[attr-defined]
        assert not plan.error and len(plan.p_endpoints) == client.ranks, plan.error


def test_the_rank_tables_d_keeps_are_bounded_by_their_ranks() -> None:
    """100 entry points each answering a valid table of 1024 ranks: D keeps the 64 most recent (65,536 ranks,
    ~26 MiB at the longest hosts), not all 100 (MAX_PEERS = 1024 such tables: ~0.4 GiB). Paired: the same with no
    bound on ranks keeps every table. Real-sized engines (8 ranks) are all kept, up to MAX_PEERS."""
    from vllm_kvp2p.decode.rank_tables import MAX_CACHED_RANKS, RankTables

    bounded, unbounded_tables = RankTables(protocol.ANY_PORT), RankTables(protocol.ANY_PORT, max_ranks=1 << 40)
    for tables in (bounded, unbounded_tables):
        resolve_many(tables, TablesFromAnyone(MAX_ENGINE_RANKS), 100)
    assert len(bounded) == MAX_CACHED_RANKS // MAX_ENGINE_RANKS == 64 and bounded.cached_ranks == MAX_CACHED_RANKS
    assert len(unbounded_tables) == 100 and unbounded_tables.cached_ranks == 100 * MAX_ENGINE_RANKS
    # the most recent are the ones kept: asking the last entry point again costs no round trip
    client = TablesFromAnyone(MAX_ENGINE_RANKS)
    remote = protocol.RemotePrefill("p", "r", "10.0.0.1", 100, [[1]], "h", 16, 16, tp_size=MAX_ENGINE_RANKS)
    from vllm_kvp2p.lifecycle.consumer import PullPlan
    bounded.resolve(PullPlan("d", remote, ((2,),), ((1,),), True), client, 1.0)  # type: ignore[arg-type]
    assert client.asked == 0

    real_sized = RankTables(protocol.ANY_PORT)
    resolve_many(real_sized, TablesFromAnyone(8), 300)
    assert len(real_sized) == 300 and real_sized.cached_ranks == 2400
    for entry in [(h, p) for h, p in list(real_sized._tables)]:
        real_sized.forget(entry)
    assert real_sized.cached_ranks == 0


def test_a_rank_tables_ipv6_zone_is_an_interface_name() -> None:
    """Python takes any text after '%' as an IPv6 zone: a 200-character one was a valid host of a rank table."""
    from vllm_kvp2p.lifecycle.rank_table import MAX_ZONE_LENGTH, host_problem

    assert host_problem("fe80::1%eth0") == "" and host_problem("fe80::1%" + "z" * MAX_ZONE_LENGTH) == ""
    assert "zone" in host_problem("fe80::1%" + "z" * (MAX_ZONE_LENGTH + 1))
    assert "zone" in host_problem("fe80::1%" + "z" * 200)
