"""D's pull as the tests of D's lifecycle (tests/unit/test_consumer_*.py) drive it: P's params, one P rank's
registration and D's local KV (2 planes of 512-byte blocks), a pull of one P rank or of P at TP 2 (D at TP 1 reading
a head from each rank), and :func:`run_against_p`, which drives a pull on a simulated clock against each P rank's
real ledger."""

from __future__ import annotations

from tests.support.prompts import remote
from vllm_kvp2p.contract.protocol import ClaimReply, ClaimStatus, RankRegistration, RemotePrefill
from vllm_kvp2p.lifecycle.consumer import PullPlan
from vllm_kvp2p.lifecycle.producer import ProducerLedger
from vllm_kvp2p.lifecycle.pull import (
    ConsumerPull,
    FetchRegistration,
    Finish,
    LocalKV,
    PullResult,
    ReadBatch,
    SendClaim,
    SendRenew,
    Source,
    Wait,
)
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.slicing import BlockShape
from vllm_kvp2p.transfer.tp_mapping import HeadSlice, Layout, rank_plan

BS = 16


def params(n_blocks: int = 4, num_tokens: int = 60) -> dict:
    return remote([list(range(10, 10 + n_blocks))], num_tokens, BS).to_params()


SHAPE = BlockShape(True, 2, BS, 16)  # 2 heads x 16 tokens x 16 B = 512 B blocks


def planes(base: int, n: int = 2) -> list[PlaneGeometry]:
    return [PlaneGeometry(base + i * 1_000_000, 512, 512, 100) for i in range(n)]


def registration(engine: str = "P", n_planes: int = 2) -> RankRegistration:
    return RankRegistration(engine, 0, 1, "127.0.0.1:15000", planes(1 << 30, n_planes), [SHAPE] * n_planes,
                            ["l0", "l1"], BS, 100, "float32", 2, 2, 8)


SRC = Source(0, 1, (HeadSlice(0, 0, 0, 2),))
LOCAL = LocalKV(tuple(planes(1 << 20)), (SHAPE, SHAPE), BS, ("l0", "l1"), "float32", 2)


def pull(plan: PullPlan, **kw) -> ConsumerPull:
    source = Source(0, 1, (HeadSlice(0, 0, 0, 2),))
    return ConsumerPull(plan, [source], "d:0", LOCAL, claim_wait=1.0,
                        max_batch_entries=kw.get("max_batch_entries", 1024), now=0.0)


def awaiting_plan() -> PullPlan:
    return PullPlan("d1", RemotePrefill.from_params(params()), ((3, 4, 9),), ((10, 11, 12),), awaiting=True)


P_SHAPE = BlockShape(True, 1, BS, 16)  # a P rank at TP 2 holds one of the 2 heads


def tp2_registration(rank: int) -> RankRegistration:
    return RankRegistration("P", rank, 2, "127.0.0.1:15000",
                            [PlaneGeometry((1 << 30) + rank * (1 << 28) + i * 1_000_000, 256, 256, 100)
                             for i in range(2)], [P_SHAPE] * 2, ["l0", "l1"], BS, 100, "float32", 1, 2, 8)


def tp2_sources() -> list[Source]:
    """D at TP 1 reading P at TP 2: one head from each P rank."""
    mapping = rank_plan(Layout(2, 2), Layout(1, 2), 0)
    return [Source(q, mapping.expected_readers[q], tuple(s for s in mapping.reads if s.p_rank == q))
            for q in mapping.p_ranks]


def tp2_pull(*, max_batch_entries: int = 1024, **kw: object) -> ConsumerPull:
    remote = RemotePrefill.from_params({**params(), "tp_size": 2})
    plan = PullPlan("d1", remote, ((3, 4, 9),), ((10, 11, 12),), awaiting=True)
    return ConsumerPull(plan, tp2_sources(), "d:0", LOCAL, claim_wait=60.0, max_batch_entries=max_batch_entries,
                        now=0.0, **kw)


def claim_and_read_rank_0(job: ConsumerPull, lease: float = 3.0, token: str = "t0") -> None:
    """Rank 0 claimed at t=0 (renewal due at lease/3) and all read by t=0.1."""
    rank0 = tp2_sources()[0]
    assert isinstance(job.next_action(0.0), FetchRegistration)
    assert job.on_registration(rank0, tp2_registration(0))
    assert isinstance(job.next_action(0.0), SendClaim)
    job.on_claim_reply(rank0, ClaimReply(ClaimStatus.GRANTED, lease=lease, lease_token=token), now=0.0)
    while isinstance(action := job.next_action(0.1), ReadBatch) and action.source == rank0:
        job.on_batch_done(rank0, True)


def run_against_p(job: ConsumerPull, ledgers: dict[int, ProducerLedger], *, read_seconds: dict[int, float],
                  renew_reaches_p: float = 0.0, read_from: float = 0.0,
                  renewals_lost: tuple[int, ...] = ()) -> PullResult:
    """Drive ``job`` on a simulated clock against each P rank's real ledger (their hold "hold" of "p-req"). A read
    from rank r takes ``read_seconds[r]``; the first starts no earlier than ``read_from`` (its read slot was busy);
    a renewal reaches P ``renew_reaches_p`` after it is sent. Renewals of ``renewals_lost`` ranks never reach P
    (the adapter feeds back a grant: what D's state machine did when it renewed only the rank being read)."""
    now = 0.0
    for _ in range(100_000):
        for ledger in ledgers.values():
            ledger.expire(now)
        action = job.next_action(now)
        if isinstance(action, Finish):
            return action.result
        if isinstance(action, Wait):
            now = action.until
            continue
        source = action.source
        ledger = ledgers[source.p_rank]
        if isinstance(action, FetchRegistration):
            job.on_registration(source, tp2_registration(source.p_rank))
        elif isinstance(action, SendClaim):
            m = action.message
            job.on_claim_reply(source, ledger.claim(m.request_id, m.hold_id, m.reader, m.expected_readers, now,
                                                    m.claim_id), now)
        elif isinstance(action, SendRenew):
            m = action.message
            if source.p_rank in renewals_lost:
                job.on_renewed(source, ClaimReply(ClaimStatus.GRANTED, ledger.lease_timeout, "", m.lease_token), now)
                continue
            now += renew_reaches_p
            ledger.expire(now)
            job.on_renewed(source, ledger.renew(m.request_id, m.hold_id, m.reader, now, m.lease_token), now)
        elif isinstance(action, ReadBatch):
            now = max(now, read_from) + read_seconds[source.p_rank]
            job.on_batch_done(source, True)
        else:
            m = action.message
            job.on_release_sent(source, ledger.release(m.request_id, m.hold_id, m.reader, m.expected_readers, now,
                                                       m.lease_token, m.pulled))
    raise AssertionError("the pull did not finish")


def held_ledgers(lease_timeout: float, ranks: int = 2) -> dict[int, ProducerLedger]:
    ledgers = {r: ProducerLedger(hold_timeout=600.0, lease_timeout=lease_timeout) for r in range(ranks)}
    for ledger in ledgers.values():
        ledger.hold("p-req", "hold", 0.0, 3)
    return ledgers
