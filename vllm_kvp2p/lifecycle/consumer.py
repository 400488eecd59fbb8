"""D side, scheduler half: what a request whose prompt KV lives on P needs pulled. Pure: no sockets, threads,
clocks or torch.

:class:`ConsumerSchedule` (in vLLM's scheduler process) turns vLLM's admission calls into at most one
:class:`PullPlan` per request. ``matched_tokens`` is pure (vLLM may ask many times); ``on_alloc`` and
``on_finished`` are the only places a plan is made, and each request gets exactly one, whatever the order and
number of calls. The worker half, :mod:`vllm_kvp2p.lifecycle.pull`, carries a plan out.

The completion rule lives in one place, :attr:`PullPlan.awaiting`: vLLM parked the request in
``WAITING_FOR_REMOTE_KVS`` only when it asked for external tokens, and only then may the worker report the
receive finished (reporting it for a RUNNING request kills vLLM's scheduler). P is released in every outcome.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

from vllm_kvp2p.kv_groups import FULL, KVGroup, has_state, single_full_group
from vllm_kvp2p.protocol import ANY_PORT, PortRanges, RemotePrefill

BlockIds = tuple[tuple[int, ...], ...]  # one tuple of block ids per KV-cache group


class Failure(str, Enum):
    """Why a pull failed, in words a metric can count (the reason text says the rest)."""

    INVALID_PARAMS = "invalid_params"  # kv_transfer_params fail a check (any client can send them)
    UNAUTHENTICATED = "unauthenticated"  # with a shared secret: params not signed by P, changed or expired
    INCOMPATIBLE = "incompatible"  # P and D cannot pair (model, layout, block sizes, protocol, P restarted)
    UNREACHABLE = "unreachable"  # P's side channel did not answer
    REFUSED = "refused"  # P no longer holds (or never held) the blocks
    TIMEOUT = "timeout"  # the pull ran past pull_timeout
    READ_FAILED = "read_failed"  # a Mooncake read failed
    INTERNAL = "internal"  # a bug: the pull crashed
    LEASE_LOST = "lease_lost"  # P could not confirm the lease held through the read: it does not count
    SHUTDOWN = "shutdown"  # the engine is stopping: what was not read yet is not read

# --------------------------------------------------------------------------- scheduler half

# Test-only key of kv_transfer_params, see KVP2PConfig.test_hooks.
TEST_CORRUPT_KEY = "kvp2p_test_corrupt"

# Params checks kept for one scheduler pass (more waiting requests than this are simply checked twice).
MAX_CHECKED = 4096


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
    remote_token_offset: int = 0  # first token to pull, within remote_block_ids[0] (P blocks larger than D's)
    contact_p: bool = True  # False: P's address in the params is invalid; the plan fails with no network call
    failure: Failure = Failure.INCOMPATIBLE  # what kind of failure ``error`` is

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
        self.peer_ports = peer_ports
        self._authenticate = authenticate
        # A recurrent state cannot be rewound: D loads all but the last prompt token and computes that one itself
        # (P prefills as many, see vllm_kvp2p/kv_groups.py).
        self._holdback = 1 if has_state(self.groups) else 0
        self._planned: set[str] = set()
        self._pending: list[PullPlan] = []
        # matched_tokens' checks of a request's params, for on_alloc in the same scheduler pass (vLLM calls the
        # two back to back): with a secret the check is an HMAC, the largest share of an admission. Cleared by
        # take_plans, once per step; keyed to the params object and prompt length it was made for.
        self._checked: dict[str, tuple[dict[str, Any], int, RemotePrefill, tuple[str, bool, Failure]]] = {}

    def matched_tokens(
        self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int, num_local_computed: int
    ) -> tuple[int, bool]:
        """Tokens D can load from P beyond its local prefix-cache hit. No side effect but keeping the params check
        for :meth:`on_alloc` in this scheduler pass. Params that parse but are invalid
        (:meth:`RemotePrefill.problem`) still ask for the prompt, so that the failed plan made for them ends the
        request the way vLLM's ``kv_load_failure_policy`` says (recompute, or an error)."""
        if request_id in self._planned or not params or not params.get("do_remote_prefill"):
            return 0, False
        remote = RemotePrefill.from_params(params)
        if remote is None:
            return 0, False
        checked = self._problem(remote, num_prompt_tokens)
        if len(self._checked) < MAX_CHECKED:
            self._checked[request_id] = (params, num_prompt_tokens, remote, checked)
        if checked[0]:
            count = num_prompt_tokens - 1 - num_local_computed
            return (count, True) if count > 0 else (0, False)
        count = self.prompt_end(remote.remote_num_tokens, num_prompt_tokens) - num_local_computed
        if count <= 0:
            return 0, False
        if num_local_computed > 0 and count < self.block_size:
            # D already caches all full blocks: computing the short tail is cheaper than a round trip to P.
            return 0, False
        return count, True

    def prompt_end(self, remote_num_tokens: int, num_prompt_tokens: int) -> int:
        """Where what D loads from P ends: P's tokens, short of the prompt's last token for a model with a state."""
        return min(remote_num_tokens, num_prompt_tokens - self._holdback)

    def on_alloc(
        self,
        request_id: str,
        params: dict[str, Any] | None,
        num_external_tokens: int,
        unhashed_block_ids: Sequence[Sequence[int]],
        num_local_computed: int,
        num_prompt_tokens: int | None = None,
    ) -> PullPlan | None:
        """vLLM allocated blocks for the request: plan the pull (or the release) exactly once.

        ``unhashed_block_ids``: per KV-cache group, D's blocks past its local prefix-cache hit, in token order and
        ending with the block of the last token D loads (vLLM's ``get_unhashed_block_ids_all_groups``)."""
        if request_id in self._planned or not params or not params.get("do_remote_prefill"):
            return None
        cached = self._checked.pop(request_id, None)
        if cached is not None and cached[0] is params and cached[1] == num_prompt_tokens:
            remote, (problem, contact_p, failure) = cached[2], cached[3]
        else:
            parsed = RemotePrefill.from_params(params)
            if parsed is None:
                return None
            remote = parsed
            problem, contact_p, failure = self._problem(
                remote, num_prompt_tokens if num_prompt_tokens is not None else remote.remote_num_tokens
            )
        self._planned.add(request_id)
        if problem:
            # Nothing is read; P is still released if its side channel is addressable (it may hold the blocks).
            plan = PullPlan(request_id, remote, tuple(tuple(g) for g in unhashed_block_ids), (),
                            awaiting=num_external_tokens > 0, error=problem, contact_p=contact_p, failure=failure)
        elif num_external_tokens <= 0:
            plan = PullPlan(request_id, remote, (), (), awaiting=False)
        else:
            local = tuple(tuple(g) for g in unhashed_block_ids)
            if len(self.groups) == 1 and self.groups[0].kind == FULL:
                plan = self._pull_plan(request_id, remote, local, num_local_computed)
            else:
                plan = self._hybrid_pull_plan(request_id, remote, local, num_local_computed + num_external_tokens)
            if params.get(TEST_CORRUPT_KEY):
                plan = dataclasses.replace(plan, test_corrupt=True)
        self._pending.append(plan)
        return plan

    def on_finished(
        self, request_id: str, params: dict[str, Any] | None, num_prompt_tokens: int | None = None
    ) -> PullPlan | None:
        """vLLM is done with the request. One that never got blocks (rejected, aborted while waiting for
        admission) still releases P now instead of at P's hold timeout."""
        if request_id in self._planned:
            self._planned.discard(request_id)
            return None
        if not params or not params.get("do_remote_prefill"):
            return None
        remote = RemotePrefill.from_params(params)
        if remote is None:
            return None
        if not self._problem(remote, num_prompt_tokens or remote.remote_num_tokens)[1]:
            return None  # no side channel to release (or none proven to be P's): contact no one
        plan = PullPlan(request_id, remote, (), (), awaiting=False)
        self._pending.append(plan)
        return plan

    def _problem(self, remote: RemotePrefill, num_prompt_tokens: int) -> tuple[str, bool, Failure]:
        """Why the params cannot be used ("" if they can), whether P may still be contacted to release, and the
        kind of failure."""
        if self._authenticate is not None:
            refused = self._authenticate(remote)
            if refused:
                return f"unauthenticated kv_transfer_params: {refused}", False, Failure.UNAUTHENTICATED
        problem = remote.problem(num_prompt_tokens, self.peer_ports)
        if problem:
            return (f"invalid kv_transfer_params: {problem}", not remote.address_problem(self.peer_ports),
                    Failure.INVALID_PARAMS)
        return "", True, Failure.INVALID_PARAMS

    def is_planned(self, request_id: str) -> bool:
        return request_id in self._planned

    def take_plans(self) -> list[PullPlan]:
        """The plans made since the last call; once per scheduler step (it also ends the step's params checks)."""
        plans, self._pending = self._pending, []
        self._checked.clear()
        return plans

    def _pull_plan(
        self, request_id: str, remote: RemotePrefill, local: BlockIds, num_local_computed: int
    ) -> PullPlan:
        """One full-attention group (no HMA): P's and D's block sizes may differ."""
        p_bs, d_bs = remote.remote_block_size, self.block_size
        if len(remote.remote_block_ids) != 1 or len(local) != 1:
            return PullPlan(request_id, remote, local, (), awaiting=True, error=self._groups_differ(remote))
        if p_bs <= 0 or (p_bs % d_bs and d_bs % p_bs):
            return PullPlan(
                request_id, remote, local, (), awaiting=True,
                error=f"block sizes incompatible: P uses {p_bs}, D uses {d_bs}; one must divide the other",
            )
        (local_ids,), (offered,) = local, remote.remote_block_ids
        first, offset = divmod(num_local_computed, p_bs)
        remote_ids = tuple(offered[first:])
        if p_bs == d_bs:
            remote_ids = remote_ids[: len(local_ids)]
        needed = min(remote.remote_num_tokens, len(offered) * p_bs) - num_local_computed
        available = len(remote_ids) * p_bs - offset
        if not local_ids or available < needed or len(local_ids) * d_bs < needed:
            return PullPlan(
                request_id, remote, local, (remote_ids,), awaiting=True,
                error=f"P offers {len(offered)} blocks of {p_bs} tokens from token "
                f"{num_local_computed}, D needs {needed} tokens in {len(local_ids)} blocks of {d_bs}",
            )
        return PullPlan(request_id, remote, local, (remote_ids,), awaiting=True, remote_token_offset=offset)

    def _groups_differ(self, remote: RemotePrefill) -> str:
        return (f"KV-cache groups differ: P sent {len(remote.remote_block_ids)}, D has {len(self.groups)} "
                "(P and D must serve the same model with the same hybrid-allocator setting)")

    def _hybrid_pull_plan(self, request_id: str, remote: RemotePrefill, local: BlockIds, num_tokens: int) -> PullPlan:
        """Several KV-cache groups (HMA): per group, D's needed tail pairs with the tail of P's list (both lists
        end at the prompt's last block, see vllm_kvp2p/kv_groups.py); block sizes must match."""
        def failed(error: str) -> PullPlan:
            return PullPlan(request_id, remote, local, (), awaiting=True, error=error)

        if len(remote.remote_block_ids) != len(self.groups) or len(local) != len(self.groups):
            return failed(self._groups_differ(remote))
        if remote.remote_block_size != self.block_size:
            return failed(f"hybrid models need one block size: P uses {remote.remote_block_size}, D {self.block_size}")
        if remote.remote_num_tokens != num_tokens:
            return failed(f"P computed {remote.remote_num_tokens} tokens, D loads {num_tokens}: hybrid models pull "
                          "whole prompts")
        local_out, remote_out = [], []
        for i, (group, mine, offered) in enumerate(zip(self.groups, local, remote.remote_block_ids)):
            limit = group.max_blocks
            needed = mine[-limit:] if limit is not None else mine
            if len(needed) > len(offered):
                return failed(f"group {i} ({group.describe()}): P offers {len(offered)} blocks, D needs "
                              f"{len(needed)}")
            local_out.append(tuple(needed))
            remote_out.append(tuple(offered[len(offered) - len(needed):]))
        if not any(local_out):
            return failed(f"D has no blocks to fill for {num_tokens} tokens")
        return PullPlan(request_id, remote, tuple(local_out), tuple(remote_out), awaiting=True)
