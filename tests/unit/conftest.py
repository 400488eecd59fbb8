"""Fixtures shared by the vllm-ascend release checks (tests/unit/test_vllm_ascend_release*.py): the released sdists
(tests/unit/vllm_ascend_sdist.py) and the hook's active connector stand-in (tests/unit/vllm_ascend_fakes.py).

Pure (tests/conftest.py runs tests/unit without vLLM and Mooncake): nothing here imports either."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.vllm_ascend_fakes import connector_activator
from tests.unit.vllm_ascend_sdist import RELEASES, V023, V030, Release, load_release


@pytest.fixture(scope="module", params=list(RELEASES))
def release(request: pytest.FixtureRequest) -> Release:
    """Each release in turn, for the checks both share."""
    return load_release(request.param)


@pytest.fixture(scope="module")
def release_023() -> Release:
    """0.23.0.post1 alone, for the checks of code only it has."""
    return load_release(V023)


@pytest.fixture(scope="module")
def release_030() -> Release:
    """0.30.0rc2 alone, for the checks of what it changed (test_vllm_ascend_release_030*.py)."""
    return load_release(V030)


@pytest.fixture
def active_connector(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``activate(group)`` makes ``group`` the active KV connector for the hook. The hook reads it from
    ``vllm.distributed.kv_transfer.kv_transfer_state``; a stand-in module under that name keeps these checks from
    importing vLLM (slow; the real module is exercised by test_ascend_hook.py). Until activate() is called no
    connector is active."""
    return connector_activator(monkeypatch)
