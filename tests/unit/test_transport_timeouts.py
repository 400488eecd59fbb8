"""Mooncake's transport timeouts are decided from transfer_timeout alone (vllm_kvp2p/transfer/timeouts.py)."""

from __future__ import annotations

import pytest

from vllm_kvp2p.transfer.timeouts import roce_budget_ms, transport_timeouts


def test_both_transports_get_their_timeout_from_transfer_timeout() -> None:
    decided = transport_timeouts(30, "tcp", {})
    assert decided.env == {"MC_TRANSFER_TIMEOUT": "30", "ASCEND_TRANSFER_TIMEOUT": "29000"}
    assert decided.warnings == ()
    # Mooncake's minimum holds for both.
    assert transport_timeouts(1, "ascend", {"HCCL_RDMA_TIMEOUT": "10"}).env == {
        "MC_TRANSFER_TIMEOUT": "5", "ASCEND_TRANSFER_TIMEOUT": "4000"}


def test_a_different_value_in_the_environment_is_replaced_with_a_warning() -> None:
    decided = transport_timeouts(35, "ascend", {"ASCEND_TRANSFER_TIMEOUT": "120000", "MC_TRANSFER_TIMEOUT": "35"})
    assert decided.env["ASCEND_TRANSFER_TIMEOUT"] == "34000"
    assert len(decided.warnings) == 1
    assert "ASCEND_TRANSFER_TIMEOUT='120000'" in decided.warnings[0]
    assert "VLLM_KVP2P_TRANSFER_TIMEOUT=35" in decided.warnings[0]


def test_roce_budget_that_does_not_fit_is_named_with_the_value_that_fits() -> None:
    assert roce_budget_ms({}) == pytest.approx(30064.771, rel=1e-6)  # HCCL's defaults 20 and 7
    default = transport_timeouts(30, "ascend", {})
    assert len(default.warnings) == 1 and "VLLM_KVP2P_TRANSFER_TIMEOUT=33" in default.warnings[0]
    assert transport_timeouts(33, "ascend", {}).warnings == ()
    # Not on the tcp transport, and not with a budget the operator lowered.
    assert transport_timeouts(30, "tcp", {}).warnings == ()
    assert transport_timeouts(30, "ascend", {"HCCL_RDMA_TIMEOUT": "17"}).warnings == ()


@pytest.mark.parametrize("value", ["x" * 100_000, "-1", "99", "1e9", ""])
def test_hostile_hccl_values_give_no_budget_and_a_bounded_warning(value: str) -> None:
    environ = {"HCCL_RDMA_TIMEOUT": value, "ASCEND_TRANSFER_TIMEOUT": value}
    assert roce_budget_ms(environ) is None
    decided = transport_timeouts(30, "ascend", environ)
    assert all(len(w) < 400 for w in decided.warnings)
