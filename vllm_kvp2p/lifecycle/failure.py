"""Why a pull failed: one kind per failure, in words a metric can count (the reason text says the rest). Decided
by the admission verdict (vllm_kvp2p/lifecycle/admission.py) or the pull state machine (lifecycle/pull.py)."""

from __future__ import annotations

from enum import Enum


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
    CORRUPTED = "corrupted"  # the bytes D read differ from P's (the integrity digest, lifecycle/integrity.py)
