"""``Descriptors.batches``: descriptors cut into batches of at most ``max_entries`` entries, in order, every batch
full but the last."""

from __future__ import annotations

import pytest
from hypothesis import given
from hypothesis import strategies as st

from vllm_kvp2p.transfer.descriptors import Descriptors

pytestmark = pytest.mark.timeout(300)


def test_batches_examples():
    d = Descriptors([1, 2, 3, 4, 5], [10, 20, 30, 40, 50], [7, 7, 7, 7, 8])
    assert len(d) == 5 and d.total_bytes == 36
    assert d.batches(2) == [
        Descriptors([1, 2], [10, 20], [7, 7]),
        Descriptors([3, 4], [30, 40], [7, 7]),
        Descriptors([5], [50], [8]),
    ]
    assert d.batches(5) == [d]
    assert d.batches(100) == [d]
    assert Descriptors([], [], []).batches(3) == []
    for bad in (0, -1):
        with pytest.raises(ValueError):
            d.batches(bad)


@given(n=st.integers(0, 200), max_entries=st.integers(1, 64))
def test_batches_property(n, max_entries):
    d = Descriptors(list(range(n)), list(range(1000, 1000 + n)), [1 + i % 3 for i in range(n)])
    batches = d.batches(max_entries)
    assert all(1 <= len(b) <= max_entries for b in batches)
    assert all(len(b) == max_entries for b in batches[:-1])  # only the last may be short
    assert len(batches) == -(-n // max_entries)
    assert [x for b in batches for x in b.local_addrs] == d.local_addrs
    assert [x for b in batches for x in b.remote_addrs] == d.remote_addrs
    assert [x for b in batches for x in b.lengths] == d.lengths
    assert sum(b.total_bytes for b in batches) == d.total_bytes
