"""What D asks P about a pull's bytes and how it judges the answer (vllm_kvp2p/lifecycle/integrity.py), and P's
bounds on a question a peer sends: every value gets a bounded, clear outcome."""

from __future__ import annotations

import msgspec
import pytest

from vllm_kvp2p.contract.protocol import (
    MAX_DIGEST_QUESTION_BYTES,
    MAX_DIGEST_RANGES,
    MAX_DIGEST_UNITS,
    DigestQuery,
    Release,
    UnitRanges,
    UnitSums,
    decode_request,
    encode,
)
from vllm_kvp2p.lifecycle import integrity
from vllm_kvp2p.lifecycle.hold import HeldUnits
from vllm_kvp2p.lifecycle.integrity import (
    IntegrityMode,
    Verdict,
    judge,
    pull_mode,
    query_problem,
    verification_for,
)
from vllm_kvp2p.transfer.descriptors import Descriptors, PlaneGeometry, build_descriptors_py

P_PLANES = [PlaneGeometry(0x10000, 1024, 1024, 16), PlaneGeometry(0x80000, 2048, 1024, 16)]  # dense, strided
D_PLANES = [PlaneGeometry(0x200000, 1024, 1024, 8), PlaneGeometry(0x300000, 1024, 1024, 8)]


def test_whole_blocks_merged_runs_are_cut_per_unit_and_name_p_blocks() -> None:
    d = build_descriptors_py(D_PLANES, P_PLANES, [0, 1, 2], [4, 5, 6])  # dense plane 0: one merged run of 3
    v = verification_for(d, P_PLANES, IntegrityMode.FULL, seed=1)
    assert v is not None
    assert [(u.plane, u.block, u.ranges) for u in v.query.units] == [
        (0, 4, [0, 1024]), (0, 5, [0, 1024]), (0, 6, [0, 1024]),
        (1, 4, [0, 1024]), (1, 5, [0, 1024]), (1, 6, [0, 1024])]
    by_unit = {r.unit: r for r in v.local_runs}
    assert by_unit[1].addr == 0x200000 + 1024 and by_unit[3].addr == 0x300000  # where D wrote each unit


def test_pieces_of_a_unit_merge_in_p_order_whatever_d_order() -> None:
    # a P block read in three pieces, listed out of order and landing in two D places
    d = Descriptors([0x200100, 0x200000, 0x300000], [0x10000 + 3 * 1024 + 512, 0x10000 + 3 * 1024,
                                                      0x10000 + 3 * 1024 + 256], [256, 256, 100])
    v = verification_for(d, P_PLANES, IntegrityMode.FULL, seed=1)
    assert v is not None and [u.ranges for u in v.query.units] == [[0, 356, 512, 256]]


def test_sampled_mode_keeps_the_last_unit_and_a_few_others_deterministically() -> None:
    d = build_descriptors_py(D_PLANES, P_PLANES, list(range(8)), list(range(8, 16)))
    first = verification_for(d, P_PLANES, IntegrityMode.SAMPLED, seed=7, sampled_units=3)
    again = verification_for(d, P_PLANES, IntegrityMode.SAMPLED, seed=7, sampled_units=3)
    assert first is not None and first == again and len(first.query.units) == 4
    assert (first.query.units[-1].plane, first.query.units[-1].block) == (1, 15)
    assert verification_for(d, P_PLANES, IntegrityMode.OFF, seed=7) is None
    assert verification_for(Descriptors([], [], []), P_PLANES, IntegrityMode.FULL, seed=7) is None


def test_a_descriptor_outside_p_planes_is_a_bug_not_silence() -> None:
    with pytest.raises(ValueError, match="below every plane"):
        verification_for(Descriptors([0], [0x100], [4]), P_PLANES, IntegrityMode.FULL, 1)
    with pytest.raises(ValueError, match="outside plane 1"):  # the gap between two strided blocks
        verification_for(Descriptors([0], [0x80000 + 1024 + 8], [4]), P_PLANES, IntegrityMode.FULL, 1)


EVERY_BLOCK = HeldUnits.of((tuple(range(16)),), (0, 0), P_PLANES)  # a hold of all 16 blocks of both planes


@pytest.mark.parametrize(("query", "why"), [
    (DigestQuery([UnitRanges(2, 0, [0, 4])]), "no such plane"),
    (DigestQuery([UnitRanges(-1, 0, [0, 4])]), "no such plane"),
    (DigestQuery([UnitRanges(0, 0, [0])]), "not in pairs"),
    (DigestQuery([UnitRanges(0, 16, [0, 4])]), "no such block"),
    (DigestQuery([UnitRanges(0, -3, [0, 4])]), "no such block"),
    (DigestQuery([UnitRanges(0, 1, [1000, 100])]), "outside its 1024 B"),
    (DigestQuery([UnitRanges(0, 1, [-5, 10])]), "outside"),
    (DigestQuery([UnitRanges(0, 1, [0, 0])]), "outside"),
    (DigestQuery([UnitRanges(0, 1, [0, 1 << 62])]), "outside"),
    (DigestQuery([UnitRanges(0, 1, [0, 4])] * (MAX_DIGEST_UNITS + 1)), "over"),
])
def test_p_answers_no_question_outside_what_it_has(query: DigestQuery, why: str) -> None:
    assert why in query_problem(query, P_PLANES, EVERY_BLOCK)


def test_only_units_of_the_readers_hold_are_answered_a_plane_holding_its_groups_blocks() -> None:
    held = HeldUnits.of(((3, 4), (9,)), (0, 1), P_PLANES)  # plane 0 in group 0 (blocks 3, 4), plane 1 in group 1 (9)
    assert held.bytes == 3 * 1024 and (0, 3) in held and (1, 9) in held and (1, 3) not in held and (0, 9) not in held
    assert (5, 3) not in held and (-1, 3) not in held  # no such plane
    assert query_problem(DigestQuery([UnitRanges(0, 3, [0, 1024]), UnitRanges(1, 9, [0, 1024])]), P_PLANES,
                         held) == ""
    for plane, block in ((0, 5), (1, 3), (0, 9)):
        problem = query_problem(DigestQuery([UnitRanges(plane, block, [0, 1])]), P_PLANES, held)
        assert "not a block of this hold" in problem, (plane, block)
    nothing = HeldUnits.of((), (0, 0), P_PLANES)
    assert "not a block" in query_problem(DigestQuery([UnitRanges(0, 3, [0, 1])]), P_PLANES, nothing)


def test_planes_of_two_groups_over_one_memory_are_answered_by_bytes() -> None:
    """vLLM's hybrid allocator gives layers of two groups one tensor: plane 1 (group 1) lies over plane 0's memory
    (group 0), and D names a unit by the plane its address falls in, so a block of group 1 may come as plane 0's. P
    answers by bytes held: block 5 of either plane is held (group 1 offered it), block 6 of neither."""
    planes = [PlaneGeometry(0x10000, 1024, 1024, 16), PlaneGeometry(0x10000, 1024, 1024, 16)]
    held = HeldUnits.of(((3,), (5,)), (0, 1), planes)
    assert held.bytes == 2 * 1024  # what a pull moves: each plane its group's offered block
    assert query_problem(DigestQuery([UnitRanges(0, 5, [0, 1024])]), planes, held) == ""
    assert query_problem(DigestQuery([UnitRanges(1, 3, [0, 1024])]), planes, held) == ""
    assert "not a block" in query_problem(DigestQuery([UnitRanges(0, 6, [0, 1])]), planes, held)
    # A plane of another stride over the same memory (a state page of 2 attention blocks): half of it held.
    paged = [planes[0], PlaneGeometry(0x10000, 2048, 2048, 8)]
    half = HeldUnits.of(((4,), ()), (0, 1), paged)  # attention block 4: the first half of page 2
    assert query_problem(DigestQuery([UnitRanges(1, 2, [0, 1024])]), paged, half) == ""
    assert "not a block" in query_problem(DigestQuery([UnitRanges(1, 2, [0, 1025])]), paged, half)


@pytest.mark.parametrize(("ranges", "why"), [
    ([0, 16, 8, 16], "overlaps"),  # overlapping
    ([0, 16, 0, 16], "overlaps"),  # the same range twice
    ([32, 16, 0, 16], "overlaps or precedes"),  # out of order
])
def test_ranges_of_a_unit_must_be_sorted_and_disjoint(ranges: list[int], why: str) -> None:
    assert why in query_problem(DigestQuery([UnitRanges(0, 1, ranges)]), P_PLANES, EVERY_BLOCK)


def test_adjacent_ranges_and_a_whole_block_are_answered() -> None:
    assert query_problem(DigestQuery([UnitRanges(0, 1, [0, 16, 16, 16, 1000, 24])]), P_PLANES, EVERY_BLOCK) == ""
    assert query_problem(DigestQuery([UnitRanges(0, 1, [0, 1024])]), P_PLANES, EVERY_BLOCK) == ""


def test_a_unit_named_twice_is_refused() -> None:
    query = DigestQuery([UnitRanges(0, 1, [0, 8]), UnitRanges(1, 1, [0, 8]), UnitRanges(0, 1, [8, 8])])
    assert "named twice" in query_problem(query, P_PLANES, EVERY_BLOCK)


def test_the_byte_bound_alone_refuses_what_overlaps_and_repeats_would_multiply(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The byte bound follows from the rules before it; on its own (those dropped) it still refuses a question
    over the hold's bytes, and without any of the three P would sum 16,000 times one block's bytes."""
    held = HeldUnits.of(((1, 2),), (0, 0), P_PLANES)  # 2 blocks x 2 planes x 1024 B = 4096 B
    query = DigestQuery([UnitRanges(0, 1, [0, 1024] * 16_000)])
    assert "overlaps" in query_problem(query, P_PLANES, held)
    rules = integrity.QUESTION_RULES
    monkeypatch.setattr(integrity, "QUESTION_RULES", tuple(
        r for r in rules if r not in (integrity._ranges_sorted_and_disjoint, integrity._units_distinct)))
    assert "16384000 bytes asked, more than the hold's 4096" in query_problem(query, P_PLANES, held)
    within = DigestQuery([UnitRanges(0, 1, [0, 1024] * 4)])  # 4096 B: within the bound, not a set of bytes
    assert query_problem(within, P_PLANES, held) == ""
    monkeypatch.setattr(integrity, "QUESTION_RULES", tuple(
        r for r in integrity.QUESTION_RULES if r is not integrity._bytes_within_the_hold))
    assert query_problem(query, P_PLANES, held) == ""  # the attack, once no rule bounds the bytes


def test_the_wire_bounds_a_question_before_any_check() -> None:
    huge = {"type": "release", "request_id": "r", "hold_id": "h", "reader": "d",
            "verify": [[[0, 0, [0, 1] * (MAX_DIGEST_RANGES + 1)]]]}
    with pytest.raises(msgspec.ValidationError, match="length"):
        decode_request(msgspec.msgpack.encode(huge))
    ok = Release("r", "h", "d", verify=DigestQuery([UnitRanges(0, 1, [0, 8])]))
    assert decode_request(encode(ok)) == ok
    assert decode_request(encode(Release("r", "h", "d"))).verify is None  # an older D asks nothing


def test_the_verdict() -> None:
    q = DigestQuery([UnitRanges(0, 1, [0, 8]), UnitRanges(1, 1, [0, 8])])
    assert judge(q, [(1, 2), (3, 4)], [UnitSums(1, 2), UnitSums(3, 4)]).verdict is Verdict.MATCHED
    bad = judge(q, [(1, 2), (3, 4)], [UnitSums(1, 2), UnitSums(3, 5)])
    assert bad.verdict is Verdict.MISMATCHED and bad.first_bad == q.units[1]
    assert judge(q, [(1, 2), (3, 4)], None).verdict is Verdict.UNVERIFIED  # an older P
    assert judge(q, [(1, 2), (3, 4)], [UnitSums(1, 2)]).verdict is Verdict.UNVERIFIED  # a short answer
    assert judge(q, (), [UnitSums(1, 2), UnitSums(3, 4)]).verdict is Verdict.UNVERIFIED  # D could not sum


def test_a_full_question_stays_within_what_p_side_channel_takes() -> None:
    """A big pull in full mode (64 layers x 1024 blocks) and a sliced one (4-byte runs): D asks about as many units
    as fit in MAX_DIGEST_QUESTION_BYTES, in order, and the release carrying the question stays under the 64 KiB P's
    side channel accepts (a bigger frame gets the connection dropped and the release lost)."""
    from vllm_kvp2p.contract.side_channel import MAX_REQUEST_BYTES

    planes = [PlaneGeometry(0x100000000 + i * 0x10000000, 8192, 8192, 4096) for i in range(64)]
    whole = Descriptors([0x900000000 + i * 8192 * 1024 for i in range(64)], [p.base_addr for p in planes],
                        [8192 * 1024] * 64)
    sliced = Descriptors(list(range(0, 400_000, 4)), [planes[0].base_addr + 8 * i for i in range(100_000)],
                         [4] * 100_000)
    for descriptors in (whole, sliced):
        v = verification_for(descriptors, planes, IntegrityMode.FULL, seed=1)
        assert v is not None and 0 < len(v.query.units) <= MAX_DIGEST_UNITS
        release = Release("r" * 256, "h" * 256, "d" * 256, 1, True, "t" * 64, v.query)
        assert len(encode(release)) <= MAX_DIGEST_QUESTION_BYTES + 1024 <= MAX_REQUEST_BYTES // 2 + 1024
        assert {r.unit for r in v.local_runs} == set(range(len(v.query.units)))  # D sums exactly what it asks
    assert len(verification_for(whole, planes, IntegrityMode.FULL, seed=1).query.units) > 2000


def test_sampled_mode_verifies_a_share_of_pulls_the_same_on_every_rank() -> None:
    ids = [f"cmpl-{i}-0" for i in range(20_000)]
    chosen = [pull_mode(IntegrityMode.SAMPLED, rid, 0.25) for rid in ids]
    share = chosen.count(IntegrityMode.SAMPLED) / len(ids)
    assert 0.23 < share < 0.27 and set(chosen) == {IntegrityMode.SAMPLED, IntegrityMode.OFF}
    assert chosen == [pull_mode(IntegrityMode.SAMPLED, rid, 0.25) for rid in ids]  # a function of the id alone
    assert all(pull_mode(IntegrityMode.SAMPLED, rid, 1.0) is IntegrityMode.SAMPLED for rid in ids[:100])
    for mode in (IntegrityMode.FULL, IntegrityMode.OFF):  # the share concerns sampled mode only
        assert {pull_mode(mode, rid, 0.25) for rid in ids[:100]} == {mode}
    assert pull_mode(IntegrityMode.SAMPLED, "\udcff lone surrogate", 0.5) in (IntegrityMode.SAMPLED, IntegrityMode.OFF)


def test_a_question_is_checked_in_o_its_units_and_the_holds_units_are_made_once(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Finding 6 of issue 45: a sampled question (5 units) of an 80-layer model's hold cost P a Python pass over
    the whole hold (a span per plane and block, built for every question: 160 x 1,000 for a 128k-token hold, 0.55 s
    of CPU). Now the hold's units are made once per hold (each group's block ids, sorted) and each unit is looked
    up by bisection: three questions about a 10-block hold and about a 100,000-block one look at the same pieces,
    one per unit, and each hold's block ids are sorted once."""
    from vllm_kvp2p.lifecycle import hold
    from vllm_kvp2p.lifecycle.producer import ProducerLedger

    planes = [PlaneGeometry(0x100000000 + i * 0x100000000, 8192, 8192, 200_000) for i in range(160)]
    groups = (0,) * len(planes)
    built, looked_at = [], []
    sort_blocks, pieces = hold.held_block_ids, HeldUnits.pieces
    monkeypatch.setattr(hold, "held_block_ids", lambda blocks: built.append(1) or sort_blocks(blocks))
    monkeypatch.setattr(HeldUnits, "pieces", lambda self, a, e: looked_at.append(len(got := pieces(self, a, e))) or got)
    ledger = ProducerLedger(60, 60)
    seen = {}
    for n in (10, 100_000):
        ledger.hold(f"r{n}", "h", 0, n, (tuple(range(n)),))
        token = ledger.claim(f"r{n}", "h", "d:0", 1, 0).lease_token
        query = DigestQuery([UnitRanges(p, b, [0, 8192]) for p, b in ((0, 1), (7, 3), (80, 5), (159, 2), (3, n - 1))])
        looked_at.clear()
        for _ in range(3):
            units = ledger.verifiable_units(f"r{n}", "h", "d:0", 1, token, planes, groups)
            assert units is not None and query_problem(query, planes, units) == ""
        seen[n] = list(looked_at)
        assert units.bytes == 160 * n * 8192
    assert len(built) == 2  # once per hold, not per question
    assert seen[10] == seen[100_000] == [1] * 15  # one piece per unit, whatever the hold's size
