"""log.WarningPace: at most one WARNING of a kind a minute, with the count of those not logged since (P's refusals,
D's busy-P pulls and the proxy's abandons use it). Pure."""

from __future__ import annotations

from vllm_kvp2p.log import WarningPace


def test_one_line_a_minute_per_kind_with_the_count_not_logged() -> None:
    pace = WarningPace(60.0)
    assert pace.allow("a", now=0.0) == 0  # the first is logged
    assert [pace.allow("a", now=t) for t in (1.0, 30.0, 59.9)] == [None, None, None]
    assert pace.allow("b", now=30.0) == 0  # another kind has its own pace
    assert pace.allow("a", now=60.0) == 3  # the next line says how many were not logged
    assert pace.allow("a", now=61.0) is None and pace.allow("a", now=120.0) == 1
