"""CI mode: where a test would skip because this environment lacks something CI's machine has, CI fails instead.

scripts/test.sh (what .ci/run runs) sets ``KVP2P_CI=1``. Its machine is built by scripts/setup.sh and
scripts/setup_vllm_release.sh and runs as root on 2 cores: the C++ extension ``vllm_kvp2p._C`` is built and loads,
network namespaces and ``tc`` can be made, a C++ compiler and setuptools are there, the vllm-ascend sdists are cached
or fetched from the registry, the checkout has its history. A test that finds one of those missing there is looking
at a broken set-up, and a skip would hide it (issue 47: a ``_C`` that built but did not load skipped 34
comparisons). Outside CI (a developer's laptop, a container without root) the same test skips with the reason.

Skips that follow from the vLLM under test (no CPU MLA backend on 0.23 ...) are not environment skips: they are
listed per vLLM in tests/expected_skips.toml, which scripts/check_skips.py holds every CI run to.

Pure: imports neither vLLM nor Mooncake.
"""

from __future__ import annotations

import os
from typing import NoReturn

import pytest

#: Set to 1 by scripts/test.sh.
CI_MODE_ENV = "KVP2P_CI"


def ci_mode() -> bool:
    return os.environ.get(CI_MODE_ENV) == "1"


def lacks(reason: str) -> NoReturn:
    """This environment lacks what the test needs: a skip with ``reason``, or in CI mode a failure naming it."""
    if ci_mode():
        pytest.fail(f"{reason} -- {CI_MODE_ENV}=1 (scripts/test.sh): CI's machine has this, so its absence is a "
                    "broken set-up, not a skip (tests/support/ci_mode.py)", pytrace=False)
    pytest.skip(reason)
