"""D side, scheduler half: one P hold, several D requests. Pure: no sockets, threads, clocks or torch.

vLLM fans a request with ``n > 1`` out into n child requests that carry the same ``kv_transfer_params``, so n
requests name one hold. A hold has one reader: P grants one lease per reader, and every request of one D rank
claims as the same reader, so a second pull of the same hold is refused (or, after the first released it, finds
it gone). The children therefore share what one pull brings:

* the first request that plans for a hold is its *reader*: it pulls (or, with everything cached on D, only
  releases P), exactly as a lone request would;
* every other request naming that hold is a *follower*: while the reader's pull is in flight it is not admitted
  (vLLM asks again next step), and once the reader has been scheduled with its pulled blocks (vLLM caches them in
  its prefix cache then) it is admitted with nothing to load: D's prefix cache gives it every full block the reader
  pulled and it computes only the partial last block. A follower never contacts P.

P cannot be told how many readers to expect (D's ``n`` is the client's; P gets ``n = 1`` from the proxy, and
another router may send anything), so a hold that counted readers would either wait for readers that never come
or free blocks a late child still needs. Followers of a reader that failed compute what the prefix cache lacks
(vLLM's ``kv_load_failure_policy`` decides for the reader alone).

:class:`SharedHolds` keeps one :class:`HoldUse` per hold in use: created with the reader's plan, ended when the
reader and every follower have finished (so it is bounded by D's running requests).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

from vllm_kvp2p.protocol import RemotePrefill

#: A hold's name in the params, with the prompt it was issued for: requests share a pull only when their prompts are
#: the same (the followers' KV comes from D's prefix cache, found by their own tokens). Two admitted requests that
#: name one hold for different prompts are a forgery and its victim: each goes its own way, and P grants the hold
#: to the first claim only.
HoldKey = tuple[str, str, str, int]

#: Holds in use remembered at once (D's running requests bound it; this bounds a bug).
MAX_HOLDS_IN_USE = 65536


def hold_key(remote: RemotePrefill) -> HoldKey:
    return remote.remote_engine_id, remote.remote_hold_id, remote.remote_prompt_digest, remote.remote_num_tokens


class Role(Enum):
    READER = "reader"  # plans the pull like any request
    WAIT = "wait"  # a follower while the reader's pull is in flight: not admitted this step
    FOLLOW = "follow"  # a follower once the reader's blocks are in D's prefix cache: nothing to load, no plan


@dataclass
class HoldUse:
    """One hold as D uses it: its reader, whether the reader's blocks have landed, the followers."""

    reader: str
    landed: bool = False
    reader_finished: bool = False
    followers: set[str] = field(default_factory=set)

    @property
    def ended(self) -> bool:
        return self.reader_finished and not self.followers


class SharedHolds:
    """Which request reads each hold, and which requests wait for it."""

    def __init__(self) -> None:
        self._uses: dict[HoldKey, HoldUse] = {}
        self._reader_of: dict[str, HoldKey] = {}  # reader request id -> its hold (on_scheduled, on_finished)

    def role(self, request_id: str, remote: RemotePrefill) -> Role:
        """The request's part for the hold its (admitted) params name. Pure: vLLM may ask many times."""
        use = self._uses.get(hold_key(remote))
        if use is None or use.reader == request_id:
            return Role.READER
        return Role.FOLLOW if use.landed else Role.WAIT

    def on_planned(self, request_id: str, remote: RemotePrefill) -> None:
        """The request got the hold's one plan: it is the reader."""
        key = hold_key(remote)
        if key in self._uses or len(self._uses) >= MAX_HOLDS_IN_USE:
            return
        self._uses[key] = HoldUse(request_id)
        self._reader_of[request_id] = key

    def on_followed(self, request_id: str, remote: RemotePrefill) -> None:
        """A follower was asked about (waiting or admitted): remembered until it finishes, so that the record
        outlives the reader while it waits and its end never contacts P. Idempotent."""
        use = self._uses.get(hold_key(remote))
        if use is not None and use.reader != request_id:
            use.followers.add(request_id)

    def is_follower(self, request_id: str, remote: RemotePrefill) -> bool:
        use = self._uses.get(hold_key(remote))
        return use is not None and use.reader != request_id

    def on_scheduled(self, request_id: str) -> None:
        """vLLM scheduled the request with its loaded blocks (they are in D's prefix cache now)."""
        key = self._reader_of.get(request_id)
        if key is not None:
            self._uses[key].landed = True

    def on_finished(self, request_id: str, remote: RemotePrefill | None) -> None:
        """The request left vLLM (finished, aborted, failed): a reader lets its followers go on; the record ends
        when nobody uses the hold any more."""
        key = self._reader_of.pop(request_id, None)
        if key is not None:
            use = self._uses[key]
            use.landed = use.reader_finished = True
        elif remote is not None:
            key = hold_key(remote)
            use = self._uses.get(key)
            if use is None:
                return
            use.followers.discard(request_id)
        else:
            return
        if use.ended:
            del self._uses[key]

    def __len__(self) -> int:
        """Holds in use by more than nothing: while there are any, the scheduler reports what it schedules."""
        return len(self._uses)
