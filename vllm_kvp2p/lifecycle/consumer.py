"""D side, scheduler half: what a request whose prompt KV lives on P needs pulled. Pure: no sockets, threads,
clocks or torch.

:class:`ConsumerSchedule` (in vLLM's scheduler process) turns vLLM's admission calls into at most one
:class:`PullPlan` per request. What it decides for a request is kept in one record, :class:`Admission`, made at the
first call about the request and forgotten at its end: the verdict on its params (whether they can be used at all,
by :func:`vllm_kvp2p.lifecycle.admission.judge`, once) and its part in the hold they name. vLLM asks about a waiting
request at every step, again after a preemption or a failed load, and the clock moves on meanwhile (signed params
expire); none of that changes what was decided. This module only maps an admitted request's tokens onto the blocks
vLLM allocated. ``matched_tokens`` only reads the record once made (vLLM may ask many times); ``on_alloc`` and
``on_finished`` are the only places a plan is made, and each request gets exactly one, whatever the order and
number of calls. The worker half, :mod:`vllm_kvp2p.lifecycle.pull`, carries a plan out.

Requests that name one hold (vLLM's ``n > 1`` children) share what its one pull brings: which of them reads it and
which follow is :mod:`vllm_kvp2p.lifecycle.shared_holds`'s, asked once per request here.

The completion rule lives in one place, :attr:`PullPlan.awaiting`: vLLM parked the request in
``WAITING_FOR_REMOTE_KVS`` only when it asked for external tokens, and only then may the worker report the
receive finished (reporting it for a RUNNING request kills vLLM's scheduler). P is released in every outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_kvp2p.contract.protocol import ANY_PORT, PortRanges, RemotePrefill
from vllm_kvp2p.lifecycle.admission import UNPARSED, Admitted, Decoder, Prompt, Refused, Verdict, judge
from vllm_kvp2p.lifecycle.failure import Failure
from vllm_kvp2p.lifecycle.shared_holds import HoldUse, Role, SharedHolds
from vllm_kvp2p.transfer.kv_groups import KVGroup, single_full_group

__all__ = ["Admission", "ConsumerSchedule", "Failure", "PullPlan", "TEST_CORRUPT_KEY"]

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of block ids per KV-cache group

# Test-only key of kv_transfer_params, see KVP2PConfig.test_hooks.
TEST_CORRUPT_KEY = "kvp2p_test_corrupt"

#: Requests recorded at once: one per request vLLM asked about and has not finished, so vLLM's own queues bound it
#: (this bounds a bug). Past it a new request is none of the connector's business: vLLM computes its prompt and no
#: P is contacted until its end (which then decides as an admission would: a reader releases P, a follower not).
MAX_REQUESTS = 1 << 17
#: hold_timeout + clock_skew at their defaults (the adapter passes the settings).
HOLD_LIFETIME = 150.0


@dataclass(frozen=True)
class PullPlan:
    """What one D request needs from P; sent from D's scheduler to its workers."""

    request_id: str  # D's own request id
    remote: RemotePrefill
    local_block_ids: BlockIds  # per KV-cache group: D blocks to fill, in token order; empty: nothing to pull
    remote_block_ids: BlockIds  # per group: P blocks holding the same tokens (one to one when block sizes match)
    awaiting: bool  # vLLM waits for a finished receive (it asked for > 0 external tokens)
    error: str = ""  # the plan is already known to fail (the worker still releases P)
    test_corrupt: bool = False  # test hook (honoured only with the test_hooks setting): corrupt what was pulled
    test_corrupt_in_flight: bool = False  # ... one byte of it, before the integrity check (as a faulty link would)
    test_corrupt_layer: str = ""  # ... only this layer's blocks (e.g. a speculative-decoding draft layer)
    remote_token_offset: int = 0  # first token to pull, within remote_block_ids[0] (P blocks larger than D's)
    contact_p: bool = True  # False: P's address in the params is invalid; the plan fails with no network call
    failure: Failure = Failure.INCOMPATIBLE  # what kind of failure ``error`` is
    # Where each P rank listens, from P's accepted rank table (vllm_kvp2p/lifecycle/rank_table.py); set by D's
    # worker before the pull starts. Empty (no table fetched): rank r at remote_host:remote_port + r.
    p_endpoints: tuple[tuple[str, int], ...] = ()

    def p_endpoint(self, p_rank: int) -> tuple[str, int]:
        """Where P rank ``p_rank``'s side channel listens for this plan."""
        if p_rank < len(self.p_endpoints):
            return self.p_endpoints[p_rank]
        return self.remote.remote_host, self.remote.remote_port + p_rank

    @property
    def num_blocks(self) -> int:
        return sum(len(g) for g in self.local_block_ids)

    @property
    def all_local_block_ids(self) -> tuple[int, ...]:
        return tuple(b for g in self.local_block_ids for b in g)


@dataclass(eq=False, slots=True)
class Admission:
    """One D request whose params ask for a remote prefill, the one record of what the connector decided for it:
    the verdict on its params and its part in their hold, decided when vLLM first asks about it (or at its end if
    vLLM never did) and kept until it ends, whatever the calls and the clock do meanwhile."""

    verdict: Verdict
    role: Role | None = None  # Admitted: reader, follower or local (lifecycle/shared_holds.py); Refused: None
    hold: HoldUse | None = None  # the hold it reads or follows
    planned: bool = False  # its one plan was made (a pull, a release, or a failed plan)


class ConsumerSchedule:
    """Per-request pull decisions on D's scheduler."""

    def __init__(
        self,
        block_size: int,
        groups: tuple[KVGroup, ...] | None = None,
        *,
        peer_ports: PortRanges = ANY_PORT,
        authenticate: Callable[[RemotePrefill], str] | None = None,
        hold_lifetime: float = HOLD_LIFETIME,
    ) -> None:
        """``peer_ports``: the side-channel ports params may name. ``authenticate``: with a shared secret, why
        params are not P's ("" when they are; vllm_kvp2p/contract/auth.py): such params make D contact no one.
        ``hold_lifetime``: seconds params can be used after P issued them (``hold_timeout`` + ``clock_skew``): how
        long a hold an n > 1 child read is remembered after that child ended, for its late siblings."""
        self.block_size = block_size
        self.groups = groups or single_full_group(block_size)
        self.decoder = Decoder(block_size, self.groups, peer_ports)
        self._authenticate = authenticate
        self._requests: dict[str, Admission] = {}
        self._pending: list[PullPlan] = []
        # Which request reads each hold (vLLM's n > 1 children share one), and the ended holds late children name.
        self.shared = SharedHolds(hold_lifetime)

    @property
    def holdback(self) -> int:
        return self.decoder.holdback

    def verdict(self, request_id: str, params: Any, prompt: Prompt) -> Verdict | None:
        """The verdict on the request's params (None: not a remote prefill): its record's, else judged now."""
        admission = self._requests.get(request_id)
        if admission is not None:
            return admission.verdict
        return judge(params, prompt, self.decoder, self._authenticate)

    def fail(self, request_id: str, reason: str) -> None:
        """The connector failed on this request (an exception in a hook): it gets a failed plan that contacts no
        one, so vLLM's kv_load_failure_policy ends it. (Recorded past MAX_REQUESTS too: vLLM may be waiting for
        the load; one per request vLLM holds.)"""
        refused = Refused(UNPARSED, reason, Failure.INTERNAL, False)
        admission = self._requests.get(request_id)
        if admission is None:
            self._requests[request_id] = Admission(refused)
        else:
            admission.verdict = refused  # a reader keeps its role: its end still lets its followers go

    def matched_tokens(
        self, request_id: str, params: Any, prompt: Prompt, num_local_computed: int, *, now: float = 0.0
    ) -> tuple[int | None, bool]:
        """Tokens D can load from P beyond its local prefix-cache hit; ``None``: not yet (a follower of a hold
        whose pull is in flight; vLLM asks again next step). The first call decides (the request's record); the
        others only read it. Refused params still ask for the prompt, so that the failed plan made for them ends
        the request the way vLLM's ``kv_load_failure_policy`` says (recompute, or an error). ``now``: seconds on
        the adapter's monotonic clock."""
        admission = self._admission(request_id, params, prompt, now)
        if admission is None or admission.planned or not prompt.loads_kv:
            # Not a remote prefill, planned already (asked again after a failed load or a preemption), or vLLM
            # computes the whole prompt (on_alloc releases P).
            return 0, False
        verdict = admission.verdict
        if isinstance(verdict, Refused):
            count = prompt.num_tokens - 1 - num_local_computed
            return (count, True) if count > 0 else (0, False)
        if admission.role is Role.FOLLOWER:
            # Not admitted while the reader's pull is in flight; then the reader's blocks are in D's prefix cache (or
            # the reader ended): vLLM computes what that lacks.
            assert admission.hold is not None
            return (0, False) if admission.hold.landed else (None, False)
        if admission.role is Role.LOCAL:
            return 0, False
        count = verdict.load_end - num_local_computed
        if count <= 0:
            return 0, False
        if num_local_computed > 0 and count < self.block_size:
            # D already caches all full blocks: computing the short tail is cheaper than a round trip to P.
            return 0, False
        return count, True

    def on_alloc(
        self,
        request_id: str,
        params: Any,
        num_external_tokens: int,
        unhashed_block_ids: Sequence[Sequence[int]],
        num_local_computed: int,
        prompt: Prompt,
        *,
        now: float = 0.0,
    ) -> PullPlan | None:
        """vLLM allocated blocks for the request: plan the pull (or the release) exactly once.

        ``unhashed_block_ids``: per KV-cache group, D's blocks past its local prefix-cache hit, in token order and
        ending with the block of the last token D loads (vLLM's ``get_unhashed_block_ids_all_groups``)."""
        admission = self._admission(request_id, params, prompt, now)
        if admission is None or admission.planned:
            return None
        verdict = admission.verdict
        if isinstance(verdict, Admitted) and admission.role is not Role.READER:
            return None  # no plan: the hold is another request's to read (or, LOCAL, nobody's here)
        local = tuple(tuple(g) for g in unhashed_block_ids)
        if isinstance(verdict, Refused):
            # Nothing is read; P is still released if that is safe (it may hold the blocks).
            plan = PullPlan(request_id, verdict.remote, local, (), awaiting=num_external_tokens > 0,
                            error=verdict.reason, contact_p=verdict.contact_p, failure=verdict.failure)
        elif num_external_tokens <= 0:
            plan = PullPlan(request_id, verdict.remote, (), (), awaiting=False)
        else:
            plan = self._plan(request_id, verdict, local, num_local_computed, num_local_computed + num_external_tokens)
            corrupt = params.get(TEST_CORRUPT_KEY) if isinstance(params, dict) else None
            if corrupt:  # true: after the pull; "in_flight": before the integrity check; "layer:NAME": one layer
                layer = corrupt[len("layer:"):] if isinstance(corrupt, str) and corrupt.startswith("layer:") else ""
                plan = dataclasses.replace(plan, test_corrupt=True, test_corrupt_in_flight=corrupt == "in_flight",
                                           test_corrupt_layer=layer)
        # Only now: if making the plan raised, the hook's guard asks again and gets the failed plan.
        admission.planned = True
        self._pending.append(plan)
        return plan

    def on_finished(self, request_id: str, params: Any, prompt: Prompt, *, now: float = 0.0) -> PullPlan | None:
        """vLLM is done with the request: its record is forgotten, whatever its verdict would be now. One that never
        got its plan (rejected, aborted while waiting for admission) still releases P now instead of at P's hold
        timeout, when that is safe and it is no follower."""
        admission = self._requests.pop(request_id, None)
        if admission is None:  # never asked about (or past MAX_REQUESTS then): decided now, as at an admission
            admission = self._decide(request_id, params, prompt, now)
            if admission is None:
                return None
        if admission.role is Role.READER:
            assert admission.hold is not None
            self.shared.on_reader_finished(admission.hold, now)
        verdict = admission.verdict
        if admission.planned or admission.role in (Role.FOLLOWER, Role.LOCAL):
            return None  # its plan released P, or the hold is another request's to release
        if isinstance(verdict, Refused) and not verdict.contact_p:
            return None  # no side channel to release (or none proven to be P's): contact no one
        plan = PullPlan(request_id, verdict.remote, (), (), awaiting=False)
        self._pending.append(plan)
        return plan

    def is_planned(self, request_id: str) -> bool:
        admission = self._requests.get(request_id)
        return admission is not None and admission.planned

    def on_scheduled(self, request_ids: Iterable[str]) -> None:
        """vLLM scheduled these requests for the first time: a reader among them has its pulled blocks in D's
        prefix cache now, so the requests that follow it may be admitted."""
        if len(self.shared):
            for request_id in request_ids:
                admission = self._requests.get(request_id)
                if admission is not None and admission.role is Role.READER and admission.hold is not None:
                    self.shared.on_landed(admission.hold)

    def take_plans(self) -> list[PullPlan]:
        """The plans made since the last call; once per scheduler step."""
        plans, self._pending = self._pending, []
        return plans

    def __len__(self) -> int:
        """Requests recorded (asked about by vLLM and not finished)."""
        return len(self._requests)

    def _admission(self, request_id: str, params: Any, prompt: Prompt, now: float) -> Admission | None:
        """The request's record, made at the first call; None: not a remote prefill (or no room to record it)."""
        admission = self._requests.get(request_id)
        if admission is None and len(self._requests) < MAX_REQUESTS:
            admission = self._decide(request_id, params, prompt, now)
            if admission is not None:
                self._requests[request_id] = admission
        return admission

    def _decide(self, request_id: str, params: Any, prompt: Prompt, now: float) -> Admission | None:
        """THE verdict on the params (lifecycle/admission.py) and, when admitted, the part in their hold."""
        verdict = judge(params, prompt, self.decoder, self._authenticate)
        if verdict is None or isinstance(verdict, Refused):
            return None if verdict is None else Admission(verdict)
        role, hold = self.shared.join(request_id, verdict.remote, now)
        return Admission(verdict, role, hold)

    def _plan(self, request_id: str, admitted: Admitted, local: BlockIds, num_local_computed: int,
              load_end: int) -> PullPlan:
        """Map the admitted tokens [num_local_computed, load_end) onto the blocks vLLM allocated. The params were
        checked to cover exactly what vLLM allocates; a mismatch here is D's own (vLLM gave other blocks than
        expected) and fails the plan as internal."""
        remote = admitted.remote
        if self.decoder.single_full_group:
            p_bs, d_bs = remote.remote_block_size, self.block_size
            (local_ids,), (offered,) = local, remote.remote_block_ids
            first, offset = divmod(num_local_computed, p_bs)
            remote_ids = tuple(offered[first:])
            if p_bs == d_bs:
                remote_ids = remote_ids[: len(local_ids)]
            needed = load_end - num_local_computed
            if len(local_ids) * d_bs < needed or len(remote_ids) * p_bs - offset < needed:
                return self._internal(request_id, remote, local, f"D allocated {len(local_ids)} blocks of {d_bs} "
                                      f"from token {num_local_computed} for {needed} tokens; P offers {len(offered)} "
                                      f"of {p_bs}")
            return PullPlan(request_id, remote, local, (remote_ids,), awaiting=True, remote_token_offset=offset)
        # Several KV-cache groups (HMA), one block size: per group, D's needed tail pairs with the tail of P's list
        # (both lists end at the prompt's last block, see vllm_kvp2p/transfer/kv_groups.py).
        if load_end != remote.remote_num_tokens:
            return self._internal(request_id, remote, local, f"vLLM loads {load_end} tokens, P computed "
                                  f"{remote.remote_num_tokens}")
        local_out, remote_out = [], []
        for i, (group, mine, offered) in enumerate(zip(self.groups, local, remote.remote_block_ids)):
            limit = group.max_blocks
            needed = mine[-limit:] if limit is not None else mine
            if len(needed) > len(offered):
                return self._internal(request_id, remote, local, f"group {i} ({group.describe()}): D allocated "
                                      f"{len(needed)} blocks to fill, P offers {len(offered)}")
            local_out.append(tuple(needed))
            remote_out.append(tuple(offered[len(offered) - len(needed):]))
        # Nothing to fill is possible (sliding windows of one token ending on a block boundary): the load is then
        # complete with no read, and P is released.
        return PullPlan(request_id, remote, tuple(local_out), tuple(remote_out), awaiting=True)

    @staticmethod
    def _internal(request_id: str, remote: RemotePrefill, local: BlockIds, why: str) -> PullPlan:
        return PullPlan(request_id, remote, local, (), awaiting=True, error=f"internal: {why}",
                        failure=Failure.INTERNAL)
