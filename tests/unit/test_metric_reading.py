"""The tests' metric reader (vllm_kvp2p/testing/server.py): absent is never zero (issue 38). Before, a renamed
metric read 0.0, so every idle check (``kv_cache_usage_perc == 0``) and every "nothing moved" delta passed on
nothing."""

from __future__ import annotations

import pytest

from vllm_kvp2p.testing.server import MissingMetric, metric_value, parse_prometheus

EXPOSITION = """# HELP vllm:kv_cache_usage_perc KV-cache usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.0
# TYPE vllm:kvp2p_pull_failures counter
vllm:kvp2p_pull_failures_total{engine="0",reason="corrupted"} 2.0
vllm:kvp2p_pull_failures_total{engine="0",reason="timeout"} 1.0
vllm:kvp2p_pull_failures_created{engine="0",reason="timeout"} 1.7e9
"""


def test_a_present_metric_reads_its_samples_summed_and_a_zero_is_a_zero() -> None:
    samples = parse_prometheus(EXPOSITION)
    assert metric_value(samples, "vllm:kv_cache_usage_perc") == 0.0
    assert metric_value(samples, "vllm:kvp2p_pull_failures_total") == 3.0
    assert metric_value(samples, "vllm:kvp2p_pull_failures_total", reason="corrupted") == 2.0


@pytest.mark.parametrize(("name", "labels"), [
    ("vllm:kv_cache_usage_percent", {}),  # renamed: read 0.0 before, so "KV idle" held on any engine
    ("vllm:kvp2p_pull_failures_total", {"reason": "sums_lost"}),  # a label value never created
    ("vllm:kvp2p_pull_failures_created", {}),  # *_created series are skipped by the parser
])
def test_an_absent_metric_fails_the_check(name: str, labels: dict[str, str]) -> None:
    with pytest.raises(MissingMetric, match="absent is not zero"):
        metric_value(parse_prometheus(EXPOSITION), name, **labels)
