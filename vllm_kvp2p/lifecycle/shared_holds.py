"""D side, scheduler half: one P hold, several D requests. Pure: no sockets, threads, clocks or torch (time comes
in as an argument, seconds on the adapter's monotonic clock).

vLLM fans a request with ``n > 1`` out into n child requests that carry the same ``kv_transfer_params``, so n
requests name one hold. A hold has one reader: P grants one lease per reader, and every request of one D rank
claims as the same reader, so a second pull of the same hold is refused (or, after the first released it, finds
it gone). The children therefore share what one pull brings. Each request's part is decided once, when vLLM first
asks about it (:meth:`SharedHolds.join`), and kept in the request's own record (lifecycle/consumer.py) until it
ends:

* the first request to name a hold D does not know is its *reader*: it pulls (or, with everything cached on D,
  only releases P), exactly as a lone request would;
* every other request naming a known hold is a *follower*: while the reader's pull is in flight it is not admitted
  (vLLM asks again next step), and once the reader has been scheduled with its pulled blocks (vLLM caches them in
  its prefix cache then) or has ended, it is admitted with nothing to load: D's prefix cache gives it every full
  block the reader pulled and it computes the rest. A follower never contacts P, not even to release (its release
  would end the reader's lease: every request of one D rank claims as the same reader).

P cannot be told how many readers to expect (D's ``n`` is the client's; P gets ``n = 1`` from the proxy, and
another router may send anything), so a hold that counted readers would either wait for readers that never come
or free blocks a late child still needs. Followers of a reader that failed compute what the prefix cache lacks
(vLLM's ``kv_load_failure_policy`` decides for the reader alone).

vLLM adds a parent's children one at a time, so a child queued behind a request that does not fit may be asked
first long after its reader ended and released P. A hold whose reader was such a child (its id ``{index}_{parent}``,
:func:`~vllm_kvp2p.lifecycle.sibling_offers.parent_of`) is therefore remembered after its reader ended for as long
as its params can be used: ``lifetime`` = ``hold_timeout`` + ``clock_skew`` from the reader's end, which is after P
issued them (with the secret D refuses them later than that as expired; without it P's hold timed out by then). A
later child is then a follower, not a second reader of a released hold. A hold read by any other request is
forgotten when its reader ends: a second request naming it then is a replay, which P refuses as it should.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import Enum

from vllm_kvp2p.contract.protocol import RemotePrefill
from vllm_kvp2p.lifecycle.sibling_offers import parent_of

#: A hold's name in the params, with the prompt it was issued for: requests share a pull only when their prompts are
#: the same (the followers' KV comes from D's prefix cache, found by their own tokens). Two admitted requests that
#: name one hold for different prompts are a forgery and its victim: each goes its own way, and P grants the hold
#: to the first claim only.
HoldKey = tuple[str, str, str, int]

#: Ended holds remembered at once: those whose reader, an n > 1 child, ended within the last ``lifetime`` (150 s by
#: default), i.e. 436 such holds a second sustained on one engine before the bound is reached (~0.7 KB each with its
#: ids, measured: 43 MiB at the bound). At the bound the oldest is forgotten early, and until its lifetime is over a
#: child that names a hold D does not know computes its prompt itself and contacts no P: D cannot tell it from a
#: late child of the forgotten hold, which made a reader would claim a hold its sibling released (P's refusal fails
#: it under the default ``fail`` policy). Computing is right for both; a new hold it leaves unclaimed ends at P's
#: hold_timeout. Requests that are not n > 1 children never meet the bound.
MAX_ENDED_HOLDS = 65536


def hold_key(remote: RemotePrefill) -> HoldKey:
    return remote.remote_engine_id, remote.remote_hold_id, remote.remote_prompt_digest, remote.remote_num_tokens


class Role(Enum):
    READER = "reader"  # plans the pull like any request
    FOLLOWER = "follower"  # waits for the reader's blocks, then takes them from D's prefix cache; no plan
    LOCAL = "local"  # a child naming a hold D cannot vouch for (bound reached): computes its prompt, no plan


@dataclass(eq=False, slots=True)
class HoldUse:
    """One hold as D uses it: its reader, and whether its followers may go (the reader's blocks are in D's prefix
    cache, or the reader ended). Followers keep a reference to it in their own records."""

    key: HoldKey
    reader: str
    landed: bool = False
    ended: bool = False  # its reader left vLLM (told once: a request id that comes back must not end it twice)


class SharedHolds:
    """Which request reads each hold, the holds whose readers ended that a late child may still name, and nothing
    per follower (a follower's part is in its own record)."""

    def __init__(self, lifetime: float, max_ended: int = MAX_ENDED_HOLDS) -> None:
        """``lifetime``: seconds an ended hold's params can still be used (``hold_timeout`` + ``clock_skew``)."""
        self.lifetime = lifetime
        self.max_ended = max(1, max_ended)
        self._holds: dict[HoldKey, HoldUse] = {}  # holds whose reader runs, and the ended ones remembered
        # The ended ones' forget times, in the order they ended (so oldest first: ``now`` never goes back).
        self._ended: deque[tuple[float, HoldKey]] = deque()
        self._unsure_until = -math.inf  # until then a child naming an unknown hold may be a late follower
        self.forgotten_early = 0  # ended holds forgotten at the bound (the adapter logs it)

    def join(self, request_id: str, remote: RemotePrefill, now: float) -> tuple[Role, HoldUse | None]:
        """The part of a request whose admitted params name this hold, decided once (its first admission, or its
        end if vLLM never asked): the reader of a hold D does not know (registered here), else a follower."""
        self._forget(now)
        key = hold_key(remote)
        use = self._holds.get(key)
        if use is not None:
            return (Role.READER if use.reader == request_id else Role.FOLLOWER), use
        if now < self._unsure_until and parent_of(request_id) is not None:
            return Role.LOCAL, None
        use = self._holds[key] = HoldUse(key, request_id)
        return Role.READER, use

    def on_landed(self, use: HoldUse) -> None:
        """vLLM scheduled the reader with its loaded blocks: they are in D's prefix cache now."""
        use.landed = True

    def on_reader_finished(self, use: HoldUse, now: float) -> None:
        """The reader left vLLM (finished, aborted, failed): its followers go on; a late child still follows."""
        use.landed = True
        if use.ended or self._holds.get(use.key) is not use:
            return
        use.ended = True
        if parent_of(use.reader) is None:
            del self._holds[use.key]
            return
        self._ended.append((now + self.lifetime, use.key))
        while len(self._ended) > self.max_ended:
            until, key = self._ended.popleft()
            del self._holds[key]
            self._unsure_until = max(self._unsure_until, until)
            self.forgotten_early += 1
        self._forget(now)

    def _forget(self, now: float) -> None:
        while self._ended and self._ended[0][0] <= now:
            del self._holds[self._ended.popleft()[1]]

    @property
    def remembered(self) -> int:
        """Ended holds still remembered for late children."""
        return len(self._ended)

    def __len__(self) -> int:
        """Holds whose reader has not ended: while there are any, the scheduler reports what it schedules."""
        return len(self._holds) - len(self._ended)
