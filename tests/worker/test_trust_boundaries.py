"""Worker level, real Mooncake engines over TCP and real ZMQ side channels on 127.0.0.0/8: what a peer without
the shared secret can do to a live P, and why a client's params cannot change what later genuine pulls read."""

from __future__ import annotations

import time

import msgspec
import pytest
import torch
import zmq

from tests.support.ports import free_port
from tests.worker.test_pull_two_engines import BLOCK, P_BLOCKS, Pair, _kv, _planes
from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.auth import Authenticator
from vllm_kvp2p.contract.protocol import Claim, ErrorReply, GetRegistration, Registration, Release, RemotePrefill
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.failure import Failure
from vllm_kvp2p.lifecycle.pull import Outcome
from vllm_kvp2p.lifecycle.rank_table import table_of
from vllm_kvp2p.prefill.hold_service import HoldService
from vllm_kvp2p.transfer.engine import MooncakeEngine

SECRET = b"worker-level-test-secret-0123456789"


def raw_request(port: int, frame: bytes, host: str = "127.0.0.1", timeout_ms: int = 2000) -> bytes:
    """One frame over a plain REQ socket, as any program that reaches P's port can send."""
    ctx = zmq.Context()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.RCVTIMEO, timeout_ms)
    sock.connect(f"tcp://{host}:{port}")
    try:
        sock.send(frame)
        return sock.recv()
    finally:
        sock.close()
        ctx.term()


@pytest.fixture(scope="module")
def secured():
    p = Pair(auth=Authenticator(SECRET, 30))
    yield p
    p.close()


def test_with_the_secret_pulls_copy_exactly(secured: Pair) -> None:
    secured.holds.hold("s-1", "h1")
    secured.pulls.submit(secured.plan("s-1", [3, 4, 5], [7, 8, 9]))
    result = secured.wait_result()
    assert result.outcome is Outcome.PULLED, result.reason
    for name in secured.d_kv:
        assert torch.equal(secured.d_kv[name][[7, 8, 9]], secured.p_kv[name][[3, 4, 5]])
    assert secured.wait_freed() == {"s-1"}


def test_a_peer_without_the_secret_gets_nothing_and_changes_nothing(secured: Pair) -> None:
    secured.holds.hold("s-2", "h1")
    before = dict(secured.holds._server.dropped)
    for message in (GetRegistration(0), Claim("s-2", "h1", "d:0", 1), Release("s-2", "h1", "d:0", 1)):
        reply = protocol.decode_reply(raw_request(secured.port, protocol.encode(message)))
        assert isinstance(reply, ErrorReply) and reply.message.startswith("unauthenticated request"), reply
    assert secured.holds._server.dropped["unauthenticated"] == before.get("unauthenticated", 0) + 3
    assert secured.holds.active >= 1 and not secured.holds.take_freed()  # the release did nothing
    secured.pulls.submit(secured.plan("s-2", [10], [11]))  # and D's pull of that hold still succeeds
    assert secured.wait_result().outcome is Outcome.PULLED
    assert secured.wait_freed() == {"s-2"}


def test_a_captured_sealed_frame_cannot_be_replayed(secured: Pair) -> None:
    auth = Authenticator(SECRET, 30)
    secured.holds.hold("s-3", "h1")
    frame, nonce = auth.seal_request(protocol.encode(Release("s-3", "h1", "d:9", 2)), time.time_ns() // 10**6)
    first = auth.open_reply(raw_request(secured.port, frame), nonce, time.time_ns() // 10**6)
    assert isinstance(protocol.decode_reply(first), protocol.Released)
    again = protocol.decode_reply(raw_request(secured.port, frame))
    assert isinstance(again, ErrorReply) and "replayed nonce" in again.message


def test_d_with_another_secret_fails_the_pull_fast_and_reads_nothing() -> None:
    p = Pair(auth=Authenticator(SECRET, 30), d_auth=Authenticator(b"some-other-secret-0123456789", 30))
    try:
        p.holds.hold("o-1", "h1")
        before = p.d_kv["model.layers.0.self_attn"][[2]].clone()
        p.pulls.submit(p.plan("o-1", [1], [2]))
        result = p.wait_result(timeout=10)
        assert result.outcome is Outcome.FAILED and "unauthenticated" in result.reason, result.reason
        assert torch.equal(p.d_kv["model.layers.0.self_attn"][[2]], before)
    finally:
        p.close()


def test_without_the_secret_anyone_gets_the_registration() -> None:
    """What the secret prevents: P's segment and every plane's address, enough to read all KV through Mooncake."""
    p = Pair()
    try:
        reply = protocol.decode_reply(raw_request(p.port, protocol.encode(GetRegistration(0))))
        assert isinstance(reply, Registration) and reply.registration.segment == p.p_engine.segment
    finally:
        p.close()


def test_params_naming_a_real_p_with_another_host_cannot_change_later_genuine_pulls() -> None:
    """The poisoning sequence: a client sends D params with the real P's engine id (and incarnation), but its own
    side channel on another host, which serves a registration with P's identity and the attacker's memory. That
    request reads the attacker's bytes (the registration was accepted: the attack is real); a genuine pull from
    P afterwards still reads P's bytes, because registrations are cached by endpoint."""
    p = Pair()
    attacker_kv = _kv(P_BLOCKS, 666)
    planes, shapes, regions = _planes(attacker_kv, P_BLOCKS)
    engine = MooncakeEngine("127.0.0.2", "tcp", transfer_timeout=5)
    engine.register(regions)
    real = p.holds.registration
    fake = msgspec.structs.replace(real, segment=engine.segment, planes=planes, block_shapes=shapes)
    port = free_port()
    attacker = HoldService(fake, "127.0.0.2", port, hold_timeout=30, lease_timeout=30)
    try:
        attacker.hold("evil", "h-evil")
        remote = RemotePrefill(real.engine_id, "evil", "127.0.0.2", port, [[5, 6]], "h-evil", 2 * BLOCK, BLOCK)
        p.pulls.submit(PullPlan("d-evil", remote, ((20, 21),), ((5, 6),), True))
        assert p.wait_result().outcome is Outcome.PULLED
        for name in p.d_kv:
            assert torch.equal(p.d_kv[name][[20, 21]], attacker_kv[name][[5, 6]])

        p.holds.hold("genuine", "h1")
        p.pulls.submit(p.plan("genuine", [5, 6], [22, 23]))
        assert p.wait_result().outcome is Outcome.PULLED
        for name in p.d_kv:
            assert torch.equal(p.d_kv[name][[22, 23]], p.p_kv[name][[5, 6]])
            assert not torch.equal(p.d_kv[name][[22, 23]], attacker_kv[name][[5, 6]])
    finally:
        attacker.close()
        engine.close()
        p.close()


def test_a_registration_whose_segment_is_on_another_host_is_refused() -> None:
    """The attacker's side channel names the real P's segment (on another host than the params'): refused before
    any read, and not cached."""
    p = Pair()
    port = free_port()
    attacker = HoldService(p.holds.registration, "127.0.0.2", port, hold_timeout=30, lease_timeout=30)
    try:
        attacker.hold("evil2", "h")
        remote = RemotePrefill(p.engine_id, "evil2", "127.0.0.2", port, [[5]], "h", BLOCK, BLOCK)
        p.pulls.submit(PullPlan("d-evil2", remote, ((20,),), ((5,),), True))
        result = p.wait_result()
        assert result.outcome is Outcome.FAILED
        assert "is not on the host of P rank 0's side channel ('127.0.0.2')" in result.reason
        assert ("127.0.0.2", port) not in p.pulls._registrations
    finally:
        attacker.close()
        p.close()


def test_the_side_channel_speaks_ipv6() -> None:
    """remote_host may be an IPv6 address (the params check accepts one): P binds it, D reaches it in brackets."""
    from vllm_kvp2p.contract.side_channel import SideChannelClient, endpoint

    assert endpoint("::1", 14600) == "tcp://[::1]:14600" and endpoint("10.0.0.7", 1) == "tcp://10.0.0.7:1"
    port = free_port()
    reg = _registration_on("::1")
    service = HoldService(reg, "::1", port, hold_timeout=30, lease_timeout=30, auth=Authenticator(SECRET, 30))
    client = SideChannelClient(3.0, auth=Authenticator(SECRET, 30))
    try:
        reply = client.request("::1", port, GetRegistration(0))
        assert isinstance(reply, Registration) and reply.registration.segment == "::1:16001"
    finally:
        client.close()
        service.close()


def _registration_on(host: str):
    planes, shapes, _ = _planes(_kv(2, 1), 2)
    return protocol.RankRegistration("p6", 0, 1, f"{host}:16001", planes, shapes, ["l"] * len(planes), BLOCK, 2,
                                     "float32", 2, 2, 32)


def _forged_table_pull(d: Pair, request: str) -> tuple:
    """A peer without the secret on 127.0.0.2 serves a rank table putting P's rank 1 on 127.0.0.3; D is sent
    params (tp_size 2) naming that peer as P's entry point. The result, and the table D holds for that entry."""
    port, rank1_port = free_port(), free_port()
    forger = HoldService(d.holds.registration, "127.0.0.2", port, hold_timeout=30, lease_timeout=30)
    forger.rank_table = table_of(d.engine_id, "", {0: ("127.0.0.2", port), 1: ("127.0.0.3", rank1_port)})
    try:
        remote = RemotePrefill(d.engine_id, request, "127.0.0.2", port, [[5]], "h", BLOCK, BLOCK, tp_size=2)
        d.pulls.submit(PullPlan("d-" + request, remote, ((20,),), ((5,),), True))
        result = d.wait_result()
        return result, d.pulls.rank_tables._tables.get(("127.0.0.2", port))
    finally:
        forger.close()


def test_a_forged_rank_table_from_a_peer_without_the_secret_is_refused(secured: Pair) -> None:
    result, table = _forged_table_pull(secured, "forged-table")
    assert result.outcome is Outcome.FAILED and result.failure is Failure.UNAUTHENTICATED, result
    assert "did not authenticate its rank table" in result.reason
    assert table is None


def test_without_the_secret_the_forged_rank_table_would_be_taken() -> None:
    """The control: D without the secret takes the same table and would contact the host it names for rank 1."""
    from vllm_kvp2p.contract.side_channel import SideChannelClient
    from vllm_kvp2p.decode.rank_tables import RankTables

    port = free_port()
    forger = HoldService(_registration_on("127.0.0.2"), "127.0.0.2", port, hold_timeout=30, lease_timeout=30)
    forger.rank_table = table_of("p6", "", {0: ("127.0.0.2", port), 1: ("127.0.0.3", port + 1)})
    client = SideChannelClient(3.0)
    try:
        remote = RemotePrefill("p6", "r", "127.0.0.2", port, [[5]], "h", BLOCK, BLOCK, tp_size=2)
        plan = RankTables(protocol.ANY_PORT).resolve(PullPlan("d", remote, ((20,),), ((5,),), True), client, 3.0)
        assert not plan.error and plan.p_endpoint(1) == ("127.0.0.3", port + 1)
    finally:
        client.close()
        forger.close()
