"""A real Mooncake engine starts with both transports' timeouts from transfer_timeout (transfer/timeouts.py)."""

from __future__ import annotations

import logging
import os

import pytest

from vllm_kvp2p.transfer.engine import MooncakeEngine


def test_engine_sets_both_timeouts_and_replaces_another_value(monkeypatch: pytest.MonkeyPatch,
                                                              caplog: pytest.LogCaptureFixture) -> None:
    monkeypatch.setenv("ASCEND_TRANSFER_TIMEOUT", "120000")
    monkeypatch.delenv("MC_TRANSFER_TIMEOUT", raising=False)
    with caplog.at_level(logging.WARNING):
        engine = MooncakeEngine("127.0.0.1", "tcp", transfer_timeout=7)
    try:
        assert os.environ["MC_TRANSFER_TIMEOUT"] == "7"
        assert os.environ["ASCEND_TRANSFER_TIMEOUT"] == "6000"
        assert engine.transfer_timeout == 7
        assert any("ASCEND_TRANSFER_TIMEOUT='120000' in the environment replaced by 6000 ms" in r.getMessage()
                   for r in caplog.records)
    finally:
        engine.close()
