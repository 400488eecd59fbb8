"""The ``ProducerLedger`` the tests of P's ledger (tests/unit/test_producer_ledger_*.py) build by default."""

from __future__ import annotations

import itertools

from vllm_kvp2p.lifecycle.producer import ProducerLedger


def ledger(**kw) -> ProducerLedger:
    """hold_timeout 10 s, lease_timeout 4 s (a hold is pinned until created + 14 s at most), lease tokens tok-1,
    tok-2, ... in the order granted."""
    tokens = itertools.count(1)
    return ProducerLedger(hold_timeout=10.0, lease_timeout=4.0, token_factory=lambda: f"tok-{next(tokens)}", **kw)
