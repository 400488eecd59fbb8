"""D's tables keyed by what the params name (P instances, P rank endpoints) keep only the most recent entries:
a client that sends params for thousands of made-up P instances cannot grow them. Real ZMQ sockets."""

from __future__ import annotations

from collections import OrderedDict

import pytest

from tests.support.ports import free_port
from vllm_kvp2p.contract import side_channel
from vllm_kvp2p.contract.protocol import ErrorReply, GetRegistration
from vllm_kvp2p.contract.side_channel import SideChannelClient, SideChannelServer
from vllm_kvp2p.decode import pull_lanes, pull_suspects
from vllm_kvp2p.decode.pull_loop import PullLoop
from vllm_kvp2p.decode.pull_suspects import put_recent


def _loop() -> PullLoop:
    # Lane assignment and the tables never touch the engine or the local KV.
    return PullLoop(None, reader="d:0", tp_size=1, tp_rank=0, local=None,  # type: ignore[arg-type]
                    side_channel_timeout=1.0, claim_wait=1.0, max_batch_entries=4, max_threads=2)


def _assign(loop: PullLoop, instance: tuple[str, int]) -> object:
    return loop.lanes.peer(instance)


def test_lane_assignments_keep_the_most_recent_instances(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull_lanes, "MAX_PEERS", 8)
    loop = _loop()
    try:
        kept = _assign(loop, ("10.0.0.1", 20000))
        for port in range(30000, 30100):  # 100 made-up P instances
            _assign(loop, ("10.9.9.9", port))
            _assign(loop, ("10.0.0.1", 20000))  # the real P, used all along, stays
        sizes = loop.table_sizes()
        assert sizes["instances"] == 8, sizes
        assert _assign(loop, ("10.0.0.1", 20000)) is kept
        assert sum(lane.instances for lane in loop.lanes.lanes) == 8  # evicted ones no longer count on their lane
    finally:
        assert loop.close(read_timeout=1.0)


def test_without_the_bound_the_table_grows_with_every_instance_named(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull_lanes, "MAX_PEERS", 10**9)
    loop = _loop()
    try:
        for port in range(30000, 30100):
            _assign(loop, ("10.9.9.9", port))
        assert loop.table_sizes()["instances"] == 100
    finally:
        assert loop.close(read_timeout=1.0)


def test_put_recent_refreshes_and_forgets_the_oldest(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pull_suspects, "MAX_PEERS", 3)
    table: OrderedDict[str, int] = OrderedDict()
    for key in "abc":
        put_recent(table, key, 1)
    put_recent(table, "a", 2)  # refreshed: now the most recent
    put_recent(table, "d", 1)
    assert list(table) == ["c", "a", "d"] and table["a"] == 2


def test_idle_loop_reports_empty_tables() -> None:
    loop = _loop()
    try:
        assert loop.table_sizes() == {"queued_plans": 0, "instances": 0, "suspects": 0, "registrations": 0,
                                      "rank_tables": 0, "sockets": 0, "results": 0}
    finally:
        assert loop.close(read_timeout=1.0)


@pytest.fixture()
def servers():
    started = [SideChannelServer("127.0.0.1", free_port(), lambda m: ErrorReply("no"), setting="test")
               for _ in range(5)]
    yield started
    for s in started:
        s.close()


def _ports(servers: list[SideChannelServer]) -> list[int]:
    return [int(s.address.rsplit(":", 1)[1]) for s in servers]


def test_client_keeps_at_most_max_sockets_open(servers: list[SideChannelServer],
                                               monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(side_channel, "MAX_SOCKETS", 3)
    client = SideChannelClient(2.0)
    try:
        for port in _ports(servers):
            with pytest.raises(side_channel.SideChannelError, match="answered with an error"):
                client.request("127.0.0.1", port, GetRegistration(0))
            assert client.open_sockets <= 3
        assert client.open_sockets == 3
    finally:
        client.close()


def test_without_the_cap_every_endpoint_keeps_a_socket(servers: list[SideChannelServer],
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(side_channel, "MAX_SOCKETS", 10**9)
    client = SideChannelClient(2.0)
    try:
        for port in _ports(servers):
            with pytest.raises(side_channel.SideChannelError):
                client.request("127.0.0.1", port, GetRegistration(0))
        assert client.open_sockets == 5
    finally:
        client.close()
