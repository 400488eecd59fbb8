"""P side, scheduler half: the children of one ``n > 1`` request offer one hold. Pure: no sockets, threads, clocks
or torch.

A router that sends P a request with ``n > 1`` and ``do_remote_decode`` (the project's proxy sends ``n = 1``; others
may not) makes vLLM fan it out into n child requests, ids ``f"{index}_{parent_id}"``
(vllm/v1/engine/parallel_sampling.py), each a prefill of the same prompt. vLLM answers with the
``kv_transfer_params`` of one child only (the one that finished last), so a hold per child would leave n - 1 holds
that nobody will ever claim, pinned until P's hold timeout. Instead the first child to finish holds its blocks and
every later child with the same prompt (the same ``prompt_digest`` over the same tokens: the same KV) answers with
that hold's params and frees its own blocks at once. Whichever child's answer vLLM returns, it names the one hold.

The parent id carries vLLM's random suffix (its internal request id), so unrelated requests never share an entry;
the digest check makes a mix-up harmless anyway (a hold of the same tokens holds the same KV).
"""

from __future__ import annotations

import re
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any

#: vLLM's id of a parallel-sampling child: ``{index}_{parent request id}``.
_CHILD_ID = re.compile(r"(\d{1,9})_(.+)", re.DOTALL)

#: Parents remembered (the oldest forgotten first): their children finish within a step or two of each other.
MAX_PARENTS = 4096


def parent_of(request_id: str) -> str | None:
    """The parent request id of a parallel-sampling child; None for any other request."""
    match = _CHILD_ID.fullmatch(request_id)
    return match.group(2) if match else None


@dataclass(frozen=True)
class Offer:
    """The hold one child of a parent offered, and what it was made of."""

    num_tokens: int
    digest: str
    params: dict[str, Any]


class SiblingOffers:
    """The hold each recent ``n > 1`` parent's children share."""

    def __init__(self, capacity: int = MAX_PARENTS) -> None:
        self._capacity = capacity
        self._offers: OrderedDict[str, Offer] = OrderedDict()

    def shared(self, request_id: str, num_tokens: int, digest: str) -> dict[str, Any] | None:
        """The params an earlier child of the same parent issued for the same tokens (a copy), or None: this
        request makes its own hold."""
        parent = parent_of(request_id)
        offer = self._offers.get(parent) if parent is not None else None
        if offer is None or offer.num_tokens != num_tokens or offer.digest != digest:
            return None
        return dict(offer.params)

    def remember(self, request_id: str, num_tokens: int, digest: str, params: dict[str, Any]) -> None:
        """A child made a hold: its siblings will answer with it."""
        parent = parent_of(request_id)
        if parent is None:
            return
        self._offers[parent] = Offer(num_tokens, digest, dict(params))
        self._offers.move_to_end(parent)
        while len(self._offers) > self._capacity:
            self._offers.popitem(last=False)
