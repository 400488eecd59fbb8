from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.worker.engine_teardown import wait_for_closes


@pytest.fixture(scope="package", autouse=True)
def _mooncake_engines_closed() -> Iterator[None]:
    """Every engine handed to close_later is closed before the package ends."""
    yield
    wait_for_closes()
