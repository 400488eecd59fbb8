"""The one check of a P engine's rank table (vllm_kvp2p/lifecycle/rank_table.py), and its bounds on the wire."""

from __future__ import annotations

import msgspec
import pytest

from vllm_kvp2p.contract.protocol import (
    ANY_PORT,
    MAX_TP_SIZE,
    RankEndpoint,
    RankTable,
    RemotePrefill,
    decode_reply,
    encode,
)
from vllm_kvp2p.lifecycle.rank_table import endpoints_of, entry_only, host_problem, table_of, table_problem

ENTRY = ("10.0.0.1", 20000)


def remote(tp_size: int = 2, **over) -> RemotePrefill:
    fields = dict(remote_engine_id="P", remote_request_id="r", remote_host=ENTRY[0], remote_port=ENTRY[1],
                  remote_block_ids=[[1]], remote_hold_id="h", remote_num_tokens=4, remote_block_size=16,
                  tp_size=tp_size, remote_incarnation="inc")
    fields.update(over)
    return RemotePrefill(**fields)


def good(tp: int = 2) -> RankTable:
    return table_of("P", "inc", {r: (ENTRY[0] if r == 0 else f"10.0.0.{1 + r}", ENTRY[1] + r) for r in range(tp)})


def test_a_table_of_ranks_on_several_hosts_is_used_as_p_states_it() -> None:
    assert table_problem(good(4), remote(4), ANY_PORT) == ""
    assert endpoints_of(good(4)) == (ENTRY, ("10.0.0.2", 20001), ("10.0.0.3", 20002), ("10.0.0.4", 20003))
    # In any order on the wire, in rank order after.
    shuffled = RankTable("P", "inc", list(reversed(good(3).ranks)))
    assert table_problem(shuffled, remote(3), ANY_PORT) == ""
    assert endpoints_of(shuffled) == endpoints_of(good(3))


def test_one_rank_needs_no_table() -> None:
    assert entry_only(remote(1)) == (ENTRY,)
    assert entry_only(remote(2)) is None


@pytest.mark.parametrize(("table", "message"), [
    (RankTable("Q", "inc", good().ranks), "the rank table is of engine 'Q'"),
    (RankTable("P", "other", good().ranks), "P restarted"),
    (RankTable("P", "inc", good().ranks[:1]), "lists ranks [0], the params name 2 (tp_size 2 x pp_size 1)"),
    (RankTable("P", "inc", good().ranks + [RankEndpoint(1, "10.0.0.9", 1)]), "lists ranks [0, 1, 1]"),
    (RankTable("P", "inc", [RankEndpoint(0, "10.0.0.1", 20000), RankEndpoint(2, "10.0.0.3", 1)]), "ranks [0, 2]"),
    # Rank 0 must be the entry point D was sent to: a table cannot move the engine elsewhere.
    (table_of("P", "inc", {0: ("10.6.6.6", 20000), 1: ("10.0.0.2", 20001)}), "puts rank 0 at '10.6.6.6':20000"),
    (table_of("P", "inc", {0: ENTRY, 1: ("evil.example", 20001)}), "'evil.example' is not an IP address"),
    (table_of("P", "inc", {0: ENTRY, 1: ("0.0.0.0", 20001)}), "not an address of one host"),
    (table_of("P", "inc", {0: ENTRY, 1: ("224.0.0.1", 20001)}), "not an address of one host"),
])
def test_a_table_that_does_not_fit_the_params_is_refused(table: RankTable, message: str) -> None:
    assert message in table_problem(table, remote(), ANY_PORT)


def test_ports_outside_peer_ports_are_refused() -> None:
    problem = table_problem(table_of("P", "inc", {0: ENTRY, 1: ("10.0.0.2", 22)}), remote(), ((20000, 20100),))
    assert "rank 1 listens on port 22, not inside the allowed side-channel ports (the peer_ports setting)" in problem
    assert table_problem(good(), remote(), ((20000, 20100),)) == ""


def test_ipv6_hosts_compare_as_addresses() -> None:
    table = table_of("P", "inc", {0: ("[::1]", 20000), 1: ("::2", 20001)})
    assert table_problem(table, remote(remote_host="0:0::1"), ANY_PORT) == ""


def test_hostile_values_get_bounded_messages() -> None:
    long = "x" * 100_000
    for table in (RankTable(long, "inc", good().ranks), RankTable("P", long, good().ranks),
                  table_of("P", "inc", {0: ENTRY, 1: (long[:253], 20001)})):
        problem = table_problem(table, remote(), ANY_PORT)
        assert problem and len(problem) < 400
    many = RankTable("P", "inc", [RankEndpoint(r, "10.0.0.1", 1 + r) for r in range(MAX_TP_SIZE)])
    problem = table_problem(many, remote(), ANY_PORT)
    assert "lists ranks [0, 1, 2, 3, 4, 5, 6, 7, ...]" in problem and len(problem) < 200
    assert host_problem("\x00\u00e9") and len(host_problem("y" * 10_000)) < 200


@pytest.mark.parametrize("ranks", [
    [[0, "10.0.0.1", 0]], [[0, "10.0.0.1", 70000]], [[-1, "10.0.0.1", 1]], [[MAX_TP_SIZE, "10.0.0.1", 1]],
    [[0, "", 1]], [[0, "h" * 254, 1]], [[0, "10.0.0.1", 1]] * (MAX_TP_SIZE + 1), [["0", "10.0.0.1", 1]],
])
def test_the_wire_refuses_out_of_bound_tables_before_any_check(ranks: list) -> None:
    raw = msgspec.msgpack.encode({"type": "rank_table", "engine_id": "P", "incarnation": "", "ranks": ranks})
    with pytest.raises(msgspec.ValidationError):
        decode_reply(raw)


def test_a_table_round_trips() -> None:
    assert decode_reply(encode(good(3))) == good(3)
