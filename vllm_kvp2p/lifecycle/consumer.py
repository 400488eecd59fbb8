"""D side, scheduler half: what a request whose prompt KV lives on P needs pulled. Pure: no sockets, threads,
clocks or torch.

:class:`ConsumerSchedule` (in vLLM's scheduler process) turns vLLM's admission calls into at most one
:class:`PullPlan` per request. Whether the request's params can be used at all is decided once, by
:func:`vllm_kvp2p.lifecycle.admission.judge`; this module only maps an admitted request's tokens onto the blocks
vLLM allocated. ``matched_tokens`` is pure (vLLM may ask many times); ``on_alloc`` and ``on_finished`` are the
only places a plan is made, and each request gets exactly one, whatever the order and number of calls. The worker
half, :mod:`vllm_kvp2p.lifecycle.pull`, carries a plan out.

Requests that name one hold (vLLM's ``n > 1`` children) share what its one pull brings: which of them reads it and
which wait is :mod:`vllm_kvp2p.lifecycle.shared_holds`'s, asked here.

The completion rule lives in one place, :attr:`PullPlan.awaiting`: vLLM parked the request in
``WAITING_FOR_REMOTE_KVS`` only when it asked for external tokens, and only then may the worker report the
receive finished (reporting it for a RUNNING request kills vLLM's scheduler). P is released in every outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from vllm_kvp2p.kv_groups import KVGroup, single_full_group
from vllm_kvp2p.lifecycle.admission import UNPARSED, Admitted, Decoder, Prompt, Refused, Verdict, judge
from vllm_kvp2p.lifecycle.failure import Failure
from vllm_kvp2p.lifecycle.shared_holds import Role, SharedHolds
from vllm_kvp2p.protocol import ANY_PORT, PortRanges, RemotePrefill

__all__ = ["ConsumerSchedule", "Failure", "PullPlan", "TEST_CORRUPT_KEY"]

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of block ids per KV-cache group

# Test-only key of kv_transfer_params, see KVP2PConfig.test_hooks.
TEST_CORRUPT_KEY = "kvp2p_test_corrupt"

# Verdicts kept for one scheduler pass (more waiting requests than this are simply judged twice).
MAX_CHECKED = 4096
# Requests a hook failed on, kept until vLLM plans or finishes them (bounded: the oldest are forgotten).
MAX_FAILED = 4096


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


class ConsumerSchedule:
    """Per-request pull decisions on D's scheduler."""

    def __init__(
        self,
        block_size: int,
        groups: tuple[KVGroup, ...] | None = None,
        *,
        peer_ports: PortRanges = ANY_PORT,
        authenticate: Callable[[RemotePrefill], str] | None = None,
    ) -> None:
        """``peer_ports``: the side-channel ports params may name. ``authenticate``: with a shared secret, why
        params are not P's ("" when they are; vllm_kvp2p/auth.py): such params make D contact no one."""
        self.block_size = block_size
        self.groups = groups or single_full_group(block_size)
        self.decoder = Decoder(block_size, self.groups, peer_ports)
        self._authenticate = authenticate
        self._planned: set[str] = set()
        self._pending: list[PullPlan] = []
        # matched_tokens' verdicts, for on_alloc in the same scheduler pass (vLLM calls the two back to back): the
        # HMAC and the prompt digest are the largest share of an admission. Cleared by take_plans, once per step;
        # keyed to the params object and prompt length they were made for.
        self._checked: dict[str, tuple[Any, int, Verdict]] = {}
        # Requests whose admission failed inside the connector (a bug): their plan fails, P is not contacted.
        self._failed: dict[str, Refused] = {}
        # Which request reads each hold and which wait for it (vLLM's n > 1 children share one hold).
        self.shared = SharedHolds()

    @property
    def holdback(self) -> int:
        return self.decoder.holdback

    def verdict(self, request_id: str, params: Any, prompt: Prompt) -> Verdict | None:
        """The admission verdict on the request's params (None: not a remote prefill), from this pass's cache."""
        failed = self._failed.get(request_id)
        if failed is not None:
            return failed
        cached = self._checked.get(request_id)
        if cached is not None and cached[0] is params and cached[1] == prompt.num_tokens:
            return cached[2]
        verdict = judge(params, prompt, self.decoder, self._authenticate)
        if verdict is not None and len(self._checked) < MAX_CHECKED:
            self._checked[request_id] = (params, prompt.num_tokens, verdict)
        return verdict

    def fail(self, request_id: str, reason: str) -> None:
        """The connector failed on this request (an exception in a hook): it gets a failed plan that contacts no
        one, so vLLM's kv_load_failure_policy ends it."""
        self._failed.pop(request_id, None)
        self._failed[request_id] = Refused(UNPARSED, reason, Failure.INTERNAL, False)
        while len(self._failed) > MAX_FAILED:
            self._failed.pop(next(iter(self._failed)))

    def matched_tokens(
        self, request_id: str, params: Any, prompt: Prompt, num_local_computed: int
    ) -> tuple[int | None, bool]:
        """Tokens D can load from P beyond its local prefix-cache hit; ``None``: not yet (a follower of a hold
        whose pull is in flight; vLLM asks again next step). No side effect but keeping the verdict for
        :meth:`on_alloc` in this scheduler pass and noting a follower (idempotent). Refused params still ask for
        the prompt, so that the failed plan made for them ends the request the way vLLM's
        ``kv_load_failure_policy`` says (recompute, or an error)."""
        if request_id in self._planned:
            return 0, False
        verdict = self.verdict(request_id, params, prompt)
        if verdict is None or not prompt.loads_kv:
            return 0, False  # not a remote prefill, or vLLM computes the whole prompt (on_alloc releases P)
        if isinstance(verdict, Refused):
            count = prompt.num_tokens - 1 - num_local_computed
            return (count, True) if count > 0 else (0, False)
        role = self.shared.role(request_id, verdict.remote)
        if role is not Role.READER:
            self.shared.on_followed(request_id, verdict.remote)  # its end must not release the reader's hold
            # WAIT: not admitted this step; FOLLOW: the reader's blocks are in D's prefix cache, vLLM computes the
            # rest.
            return (None, False) if role is Role.WAIT else (0, False)
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
    ) -> PullPlan | None:
        """vLLM allocated blocks for the request: plan the pull (or the release) exactly once.

        ``unhashed_block_ids``: per KV-cache group, D's blocks past its local prefix-cache hit, in token order and
        ending with the block of the last token D loads (vLLM's ``get_unhashed_block_ids_all_groups``)."""
        if request_id in self._planned:
            return None
        verdict = self.verdict(request_id, params, prompt)
        if verdict is None:
            return None
        self._checked.pop(request_id, None)
        self._failed.pop(request_id, None)
        local = tuple(tuple(g) for g in unhashed_block_ids)
        if isinstance(verdict, Admitted) and self.shared.role(request_id, verdict.remote) is not Role.READER:
            self.shared.on_followed(request_id, verdict.remote)  # no plan: the hold is another request's to read
            return None
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
        self._planned.add(request_id)
        self._pending.append(plan)
        if isinstance(verdict, Admitted):
            self.shared.on_planned(request_id, verdict.remote)
        return plan

    def on_finished(self, request_id: str, params: Any, prompt: Prompt) -> PullPlan | None:
        """vLLM is done with the request. One that never got blocks (rejected, aborted while waiting for
        admission) still releases P now instead of at P's hold timeout, when that is safe."""
        if request_id in self._planned:
            self._planned.discard(request_id)
            self.shared.on_finished(request_id, None)
            return None
        verdict = self.verdict(request_id, params, prompt)
        self._checked.pop(request_id, None)
        self._failed.pop(request_id, None)
        if verdict is None or (isinstance(verdict, Refused) and not verdict.contact_p):
            return None  # no side channel to release (or none proven to be P's): contact no one
        if isinstance(verdict, Admitted) and self.shared.is_follower(request_id, verdict.remote):
            self.shared.on_finished(request_id, verdict.remote)
            return None  # the hold is the reader's: its pull releases P
        plan = PullPlan(request_id, verdict.remote, (), (), awaiting=False)
        self._pending.append(plan)
        return plan

    def is_planned(self, request_id: str) -> bool:
        return request_id in self._planned

    def on_scheduled(self, request_ids: Iterable[str]) -> None:
        """vLLM scheduled these requests for the first time: a reader among them has its pulled blocks in D's
        prefix cache now, so the requests that follow it may be admitted."""
        if len(self.shared):
            for request_id in request_ids:
                self.shared.on_scheduled(request_id)

    def take_plans(self) -> list[PullPlan]:
        """The plans made since the last call; once per scheduler step (it also ends the step's verdicts)."""
        plans, self._pending = self._pending, []
        self._checked.clear()
        return plans

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
        # (both lists end at the prompt's last block, see vllm_kvp2p/kv_groups.py).
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
