"""Which instance of a role gets a request: one pure function, the proxy's only routing decision.

Two policies (``--routing``):

* ``least-outstanding``: the instance with the fewest requests in flight.
* ``prefix-aware`` (default): the instance with the least *work ahead* of this request, in prompt tokens:
  ``pending_tokens`` (the uncached prompt tokens of the requests already in flight there) plus this prompt's
  tokens that instance does not hold yet (``prompt_tokens - prefix_weight * cached_tokens``). An instance that holds
  a prompt's prefix wins while it is not busier by more than the prefix is worth; a hot prefix spills over to a
  second instance once the first has that much queued. On P a hit is prefill not computed; on D it is blocks not
  pulled. ``prefix_weight`` 0 makes it least-pending-tokens.

Equal costs go to the instance with fewer requests in flight (requests of unknown tokens add no pending tokens),
then round-robin from ``cursor``. Skipped instances (see :mod:`health`) are left out; when every instance of the
role is skipped the one whose back-off ends first is tried rather than failing the request, so stale health, like
a stale or empty cache index, costs speed, never an answer. When the prompt's tokens are unknown (its tokenization
failed or was not attempted) ``prefix-aware`` falls back to ``least-outstanding`` for that request.
"""

from __future__ import annotations

import enum
from collections.abc import Collection, Sequence
from dataclasses import dataclass


class Policy(enum.Enum):
    LEAST_OUTSTANDING = "least-outstanding"
    PREFIX_AWARE = "prefix-aware"


@dataclass(frozen=True)
class Candidate:
    """What routing needs to know of one instance at this moment."""

    usable: bool
    outstanding: int
    pending_tokens: int
    cached_tokens: int
    retry_at: float = 0.0


def cost(c: Candidate, prompt_tokens: int, prefix_weight: float) -> float:
    """Work ahead of a request on ``c``, in prompt tokens (the ``prefix-aware`` score; lower is better)."""
    return c.pending_tokens + max(0.0, prompt_tokens - prefix_weight * c.cached_tokens)


def choose(
    candidates: Sequence[Candidate],
    *,
    policy: Policy,
    prompt_tokens: int | None,
    prefix_weight: float = 1.0,
    cursor: int = 0,
    exclude: int | None = None,
    among: Collection[int] | None = None,
) -> int:
    """The index of the instance to use. ``exclude`` (an index) is avoided unless it is the only instance;
    ``among`` (indices, not empty) restricts the choice to those (the instances that can pair with a given one)."""
    n = len(candidates)
    if n == 0:
        raise ValueError("no instance to choose from")
    if n == 1:
        return 0
    allowed = [i for i in range(n) if i != exclude and (among is None or i in among)] or [
        i for i in range(n) if among is None or i in among]
    usable = [i for i in allowed if candidates[i].usable]
    if not usable:
        soonest = min(candidates[i].retry_at for i in allowed)
        return _round_robin([i for i in allowed if candidates[i].retry_at == soonest], cursor, n)
    if policy is Policy.PREFIX_AWARE and prompt_tokens is not None:
        scores = {i: (cost(candidates[i], prompt_tokens, prefix_weight), candidates[i].outstanding) for i in usable}
    else:
        scores = {i: (float(candidates[i].outstanding), 0) for i in usable}
    best = min(scores.values())
    return _round_robin([i for i in usable if scores[i] == best], cursor, n)


def _round_robin(indices: Sequence[int], cursor: int, n: int) -> int:
    """The first of ``indices`` at or after ``cursor``, wrapping around."""
    return min(indices, key=lambda i: (i - cursor) % n)
