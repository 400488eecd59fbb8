"""The short soak CI runs: 120 requests from 16 clients, a tenth cancelled, a third sharing a prefix, P1 killed
and restarted in the middle. Nothing may fail, differ from the single instance, or stay behind. (The checks on
their own are shown to catch leaks and wrong answers in tests/unit/test_soak_checks.py.)"""

from __future__ import annotations

import pytest

from vllm_kvp2p.testing.soak import SoakCluster, SoakPlan, check_tables, run

pytestmark = pytest.mark.e2e

PLAN = SoakPlan(requests=120, clients=16, cancel_share=0.1, prefix_share=0.3, seed=12)


def test_soak_with_cancellations_and_a_p_restart_loses_nothing(soak_cluster: SoakCluster) -> None:
    report = run(soak_cluster, PLAN)
    print(report.summary())
    assert not report.errors, report.errors
    assert not report.mismatches, report.mismatches
    assert not report.leaks, report.leaks
    assert report.corrupted_pulls == 0 and report.verified_pulls >= PLAN.requests // 2, report.summary()  # full
    assert report.answered + report.cancelled == PLAN.requests, report.summary()
    assert report.cancelled >= 5, report.summary()  # the plan's share, drawn with this seed
    assert any(f.startswith("SIGKILL prefill1") for f in report.faults), report.faults
    assert any("serving again" in f for f in report.faults), report.faults
    assert report.proxy_retries >= 1, report.summary()  # requests sent to the dead P1 went to P2
    # Stopping the cluster here (the fixture would, later) makes every engine log its tables at shutdown.
    soak_cluster.__exit__()
    check_tables(soak_cluster, report)
    assert not report.leaks, report.leaks
