"""Hostile frames against a live P side channel (a real :class:`HoldService` on 127.0.0.1), sent with a raw REQ
socket: random bytes, truncated messages, wrong-typed fields, valid messages with absurd values. After each
example a genuine D peer still gets correct answers, a live lease is never dropped by what the attacker sent, and
every table of P's ledger stays within its bound."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import msgspec
import pytest
import zmq
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import (
    MAX_TP_SIZE,
    Abandon,
    Claim,
    ClaimReply,
    ClaimStatus,
    GetRegistration,
    RankRegistration,
    Registration,
    Release,
    Released,
    Renew,
)
from vllm_kvp2p.contract.side_channel import SideChannelClient
from vllm_kvp2p.lifecycle.producer import HoldState
from vllm_kvp2p.prefill.hold_service import HoldService
from vllm_kvp2p.testing.server import free_port
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape

HOST = "127.0.0.1"
READER = "d:0"  # the genuine D peer
MAX_EARLY = 64  # small, so the fuzzer reaches it
RECV_MS = 150  # a dropped frame costs this much: localhost answers take well under a millisecond

REG = RankRegistration("P", 0, 1, "127.0.0.1:15000", [PlaneGeometry(1 << 30, 512, 512, 100)],
                       [BlockShape(True, 2, 16, 16)], ["l0"], 16, 100, "float32", 2, 2, 8)


class RawPeer:
    """A raw REQ socket; replaced by a fresh one whenever a reply does not come (a REQ cannot be reused then)."""

    def __init__(self, ctx: zmq.Context, port: int) -> None:
        self._ctx, self._endpoint = ctx, f"tcp://{HOST}:{port}"
        self._sock: zmq.Socket | None = None

    def ask(self, frames: list[bytes]) -> bytes | None:
        if self._sock is None:
            self._sock = self._ctx.socket(zmq.REQ)
            self._sock.setsockopt(zmq.LINGER, 0)
            self._sock.connect(self._endpoint)
        self._sock.send_multipart(frames)
        if self._sock.poll(RECV_MS, zmq.POLLIN):
            return self._sock.recv()
        self.close()  # dropped (too big for the server) or lost: throw the socket away
        return None

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None


@pytest.fixture(scope="module")
def service() -> Iterator[HoldService]:
    svc = HoldService(REG, HOST, free_port(HOST), hold_timeout=30.0, lease_timeout=10.0,
                      max_early_releases=MAX_EARLY)
    yield svc
    svc.close()


@pytest.fixture(scope="module")
def port(service: HoldService) -> int:
    return int(service._server.address.rsplit(":", 1)[1])


@pytest.fixture(scope="module")
def raw(port: int) -> Iterator[RawPeer]:
    ctx = zmq.Context()
    peer = RawPeer(ctx, port)
    yield peer
    peer.close()
    ctx.term()


@pytest.fixture(scope="module")
def client() -> Iterator[SideChannelClient]:
    c = SideChannelClient(timeout=3.0)
    yield c
    c.close()


# --------------------------------------------------------------------------- what the attacker sends

INT64 = st.integers(-(2**63), 2**63 - 1)
ABSURD_INTS = st.one_of(INT64, st.sampled_from([0, -1, 1, MAX_TP_SIZE, MAX_TP_SIZE + 1, 10**9, 2**63 - 1, -(2**63)]))
HUGE_IDS = st.sampled_from(["", "x" * 257, "y" * 20_000])  # 10^6 characters: the explicit example below
TAGS = ["get_registration", "claim", "renew", "release", "abandon", "registration", "claim_reply", "ack", "error",
        "nope"]
FIELDS = ["tp_rank", "request_id", "hold_id", "reader", "expected_readers", "pulled", "lease_token", "status", "mac"]
ANYTHING = st.recursive(
    st.none() | st.booleans() | st.floats() | INT64 | st.text(max_size=20) | st.binary(max_size=20),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
    max_leaves=6,
)


def valid_messages(victim: str, victim_hold: str) -> st.SearchStrategy:
    """Well-formed requests with absurd or hostile values, some naming the live victim hold and its reader."""
    rid = st.one_of(st.just(victim), st.text(max_size=24), HUGE_IDS)
    hid = st.one_of(st.just(victim_hold), st.text(max_size=24), HUGE_IDS)
    reader = st.one_of(st.just(READER), st.text(max_size=24), HUGE_IDS)
    token = st.one_of(st.just(""), st.text(max_size=40))
    return st.one_of(
        st.builds(GetRegistration, ABSURD_INTS),
        st.builds(Claim, rid, hid, reader, ABSURD_INTS),
        st.builds(Renew, rid, hid, reader, token),
        st.builds(Release, rid, hid, reader, ABSURD_INTS, st.booleans(), token),
        st.builds(Abandon, rid, hid, token),
    )


def frames(victim: str, victim_hold: str) -> st.SearchStrategy[list[bytes]]:
    valid = valid_messages(victim, victim_hold)
    wrong_typed = st.builds(
        lambda tag, fields: msgspec.msgpack.encode({"type": tag, **fields}),
        st.sampled_from(TAGS), st.dictionaries(st.sampled_from(FIELDS), ANYTHING, max_size=6),
    )
    truncated = st.tuples(valid.map(protocol.encode), st.floats(0, 1, exclude_max=True)).map(
        lambda t: t[0][: int(len(t[0]) * t[1])]
    )
    one = st.one_of(st.binary(max_size=512), truncated, wrong_typed, valid.map(protocol.encode))
    # Mostly one frame (what a REQ peer sends); sometimes several (the server reads the last).
    return st.one_of(one.map(lambda f: [f]), st.lists(one, min_size=2, max_size=3))


# --------------------------------------------------------------------------- what must still hold


def genuine_claim(service: HoldService, client: SideChannelClient, port: int, rid: str, hid: str) -> str:
    service.hold(rid, hid)
    reply = client.request(HOST, port, Claim(rid, hid, READER, 1))
    assert isinstance(reply, ClaimReply) and reply.status is ClaimStatus.GRANTED, reply
    assert reply.lease_token
    return reply.lease_token


def check_service(service: HoldService, client: SideChannelClient, port: int, victim: str, victim_hold: str,
                  victim_token: str) -> None:
    reply = client.request(HOST, port, GetRegistration(0))
    assert isinstance(reply, Registration) and reply.registration == REG

    # Nothing the attacker sent dropped the victim's live lease (P would free blocks D is still reading).
    assert victim not in service.take_freed()
    with service._lock:
        hold = service.ledger._holds[(victim, victim_hold)]
        assert hold.state is HoldState.CLAIMED and READER in hold.leases

    # The genuine release frees it, unless the attacker joined as another reader (then that reader's lease or
    # hold_timeout decides; it never frees while a lease is live).
    assert isinstance(client.request(HOST, port, Release(victim, victim_hold, READER, 1, True, victim_token)), Released)
    freed = service.take_freed()
    with service._lock:
        hold = service.ledger._holds.get((victim, victim_hold))
        assert victim in freed or (
            hold is not None and READER not in hold.leases and (hold.leases or
                                                                len(hold.released_by) < hold.expected_readers)
        )

    # A hold the attacker cannot name: claim granted, release frees it, exactly once.
    rid, hid = f"fresh-{uuid.uuid4().hex}", uuid.uuid4().hex
    token = genuine_claim(service, client, port, rid, hid)
    assert client.request(HOST, port, Release(rid, hid, READER, 1, True, token)) == Released(lease_held=True)
    assert rid in service.take_freed()
    assert rid not in service.take_freed()

    sizes = service.table_sizes()
    assert sizes["early_releases"] <= MAX_EARLY
    assert sizes["readers_per_hold"] <= MAX_TP_SIZE
    assert sizes["tombstones"] <= 65536
    assert sizes["holds"] <= 400  # only vLLM creates holds: at most this test's victims (attackers join them)


@settings(max_examples=150, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(data=st.data())
@example(data=None)  # the 4 MiB frame, deterministically
def test_hostile_frames_leave_p_serving_and_bounded(service: HoldService, client: SideChannelClient, port: int,
                                                    raw: RawPeer, data: st.DataObject | None) -> None:
    victim, victim_hold = f"victim-{uuid.uuid4().hex}", uuid.uuid4().hex
    token = genuine_claim(service, client, port, victim, victim_hold)
    if data is None:
        big = "z" * 10**6  # over the server's frame cap (if any): dropped, or refused by the ledger
        batch = [[b"\x00" * (4 << 20)], [protocol.encode(Claim("r", "h", "x", 1))[:-1] + b"\xff" * (4 << 20)],
                 [protocol.encode(Release(big, victim_hold, READER, 1))], [protocol.encode(Claim(victim, big, big, 1))]]
    else:
        batch = data.draw(st.lists(frames(victim, victim_hold), min_size=1, max_size=8), label="frames")
    for message in batch:
        raw.ask(message)  # any answer (or none: dropped as too big) is fine; what matters is what follows
    check_service(service, client, port, victim, victim_hold, token)


def test_flood_of_early_releases_over_the_wire_stays_bounded(service: HoldService, port: int, raw: RawPeer) -> None:
    before = service.counters().get("early_release_table_full", 0)
    for i in range(3 * MAX_EARLY):
        assert raw.ask([protocol.encode(Release(f"flood-{uuid.uuid4().hex}-{i}", "h", "x:0", 1))]) is not None
    assert service.table_sizes()["early_releases"] == MAX_EARLY
    assert service.counters()["early_release_table_full"] >= before + 2 * MAX_EARLY


def test_forged_release_and_renew_over_the_wire_keep_the_lease(service: HoldService, client: SideChannelClient,
                                                               port: int, raw: RawPeer) -> None:
    rid, hid = f"live-{uuid.uuid4().hex}", uuid.uuid4().hex
    token = genuine_claim(service, client, port, rid, hid)
    for forged in (Release(rid, hid, READER, 1, True), Release(rid, hid, READER, 1, True, "0" * 32),
                   Claim(rid, hid, READER, 1)):
        raw.ask([protocol.encode(forged)])
    renew = protocol.decode_reply(raw.ask([protocol.encode(Renew(rid, hid, READER, "guess"))]) or b"")
    assert isinstance(renew, ClaimReply) and renew.status is ClaimStatus.REFUSED
    assert rid not in service.take_freed()
    renewed = client.request(HOST, port, Renew(rid, hid, READER, token))
    assert isinstance(renewed, ClaimReply) and renewed.status is ClaimStatus.GRANTED
    assert isinstance(client.request(HOST, port, Release(rid, hid, READER, 1, True, token)), Released)
    assert rid in service.take_freed()
    counters = service.counters()
    assert counters["release_without_token"] >= 2 and counters["renew_refused"] >= 1
    assert counters["claim_refused_live_lease"] >= 1


# --------------------------------------------------------------------------- with the shared secret

SECRET = b"fuzz-shared-secret-0123456789"


@pytest.fixture(scope="module")
def secured() -> Iterator[tuple[HoldService, SideChannelClient, int]]:
    auth = Authenticator(SECRET, 30)
    port = free_port(HOST)
    svc = HoldService(REG, HOST, port, hold_timeout=30.0, lease_timeout=10.0, max_early_releases=MAX_EARLY,
                      auth=auth)
    c = SideChannelClient(timeout=3.0, auth=Authenticator(SECRET, 30))
    yield svc, c, port
    c.close()
    svc.close()


@settings(max_examples=60, deadline=None, database=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture, HealthCheck.data_too_large])
@given(data=st.data())
def test_with_the_secret_no_hostile_frame_reaches_the_ledger(secured: tuple[HoldService, SideChannelClient, int],
                                                              data: st.DataObject) -> None:
    """The same frames, now at a P with the secret, from a peer without it: every one but an unsealed Abandon is
    dropped before the ledger (its counters and tables do not move), an Abandon without the params' mac frees
    nothing and one of a hold P does not hold is not remembered (no table grows), and a peer with the secret is
    served as before."""
    service, sealed_client, port = secured
    victim, victim_hold = f"victim-{uuid.uuid4().hex}", uuid.uuid4().hex
    service.hold(victim, victim_hold, mac="a" * 64)  # a P with the secret signs every hold's params
    token = sealed_client.request(HOST, port, Claim(victim, victim_hold, READER, 1, "cid")).lease_token
    before_counters, before_sizes = dict(service.counters()), service.table_sizes()
    ctx = zmq.Context()
    raw = RawPeer(ctx, port)
    try:
        for message in data.draw(st.lists(frames(victim, victim_hold), min_size=1, max_size=6), label="frames"):
            answer = raw.ask(message)
            if answer is not None:
                reply = protocol.decode_reply(answer)
                assert (isinstance(reply, protocol.ErrorReply) and reply.message.startswith("unauthenticated")) or (
                    isinstance(reply, protocol.Abandoned) and reply.outcome is not protocol.AbandonOutcome.RELEASED)
    finally:
        raw.close()
        ctx.term()
    abandons = ("abandon_refused", "id_too_long")  # what an unsealed Abandon may count (it frees nothing here)
    assert {k: v for k, v in service.counters().items() if k not in abandons} == {
        k: v for k, v in before_counters.items() if k not in abandons}
    assert service.table_sizes() == before_sizes  # an unsealed Abandon of an unknown hold is not remembered
    assert victim not in service.take_freed()
    assert isinstance(sealed_client.request(HOST, port, GetRegistration(0)), Registration)
    assert isinstance(sealed_client.request(HOST, port, Release(victim, victim_hold, READER, 1, True, token)), Released)
    assert victim in service.take_freed()
