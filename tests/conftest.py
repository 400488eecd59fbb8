"""Which tests each vLLM runs. CI (scripts/test.sh) runs the suite on vLLM 0.32 and on vLLM 0.23; a test that
touches neither vLLM nor Mooncake is the same code whatever the vLLM, so it runs once, on the newest one.

THE RULE (keep it true when you add a test module):

* Every package but tests/unit needs vLLM or Mooncake (scheduler: vLLM's Scheduler; worker: Mooncake, whose
  version differs between the two environments; every e2e: engines). They run on every vLLM.
* A module of tests/unit that imports vLLM or Mooncake, directly or through the code it tests, even lazily inside
  a test, is named in ``NEEDS_VLLM_OR_MOONCAKE`` below. It runs on every vLLM.
* Every other module of tests/unit is *pure*.

``KVP2P_TESTS=pure`` runs only the pure modules, with vLLM and Mooncake made unimportable: that run is the check,
a pure module that needs either fails there with a message naming this list. ``KVP2P_TESTS=contract`` runs all
the rest (what each vLLM must run). Unset: everything, as a developer runs pytest.
"""

from __future__ import annotations

import importlib.abc
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from vllm_kvp2p.testing.cluster import PDCluster

NEEDS_VLLM_OR_MOONCAKE = {
    "test_arena",  # the arena's torch allocator under vLLM's allocation route
    "test_ascend_hook",  # wraps vLLM's model-runner method
    "test_check_cli",  # the check reads vLLM's node address
    "test_config",  # host detection through vLLM
    "test_metrics",  # vLLM's connector-stats classes
    "test_plugin",  # registers with vLLM's connector factory
    "test_worker_polling",  # wraps vLLM's shared-memory reader
}

MODE = os.environ.get("KVP2P_TESTS", "")
UNIT = Path(__file__).parent / "unit"


class _Unimportable(importlib.abc.MetaPathFinder):
    def find_spec(self, name: str, path: object = None, target: object = None) -> None:
        if name.split(".")[0] in ("vllm", "mooncake"):
            raise ImportError(f"{name}: KVP2P_TESTS=pure runs the modules of tests/unit that need neither vLLM "
                              "nor Mooncake; one that imports it belongs in NEEDS_VLLM_OR_MOONCAKE "
                              "(tests/conftest.py)")
        return None


if MODE == "pure":
    sys.meta_path.insert(0, _Unimportable())


def is_pure(path: Path) -> bool:
    return (path.parent == UNIT and path.suffix == ".py" and path.stem.startswith("test_")
            and path.stem not in NEEDS_VLLM_OR_MOONCAKE)


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if MODE == "contract" and is_pure(collection_path):
        return True  # the same code whatever the vLLM: the newest vLLM's run covers it
    if MODE == "pure":
        if collection_path.is_dir():
            inside = UNIT == collection_path or UNIT in collection_path.parents or collection_path in UNIT.parents
            return None if inside else True
        if collection_path.suffix == ".py" and collection_path.name != "conftest.py" and not is_pure(collection_path):
            return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    if MODE not in ("", "pure", "contract"):
        raise pytest.UsageError(f"KVP2P_TESTS={MODE!r}: 'pure', 'contract' or unset")


# ---------------------------------------------------------------------------------------------------------------
# Engines shared by several packages: started once for the whole run, where first used, stopped at its end.
# One real P/D deployment (see vllm_kvp2p.testing.cluster.PDCluster): a prefill ``vllm serve`` (kv_producer), a
# decode ``vllm serve`` (kv_consumer, test hooks on, failed loads recomputed) and the proxy console script, on
# 127.0.0.1, each vLLM worker pinned to its own core. Idle engines cost memory, not cores.
# ---------------------------------------------------------------------------------------------------------------


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    from vllm_kvp2p.testing.tiny_model import make_tiny_llama

    return make_tiny_llama(tmp_path_factory.mktemp("models") / "tiny-llama")


@pytest.fixture(scope="session")  # shared: tests/e2e's deployment, and e2e_mla's tiny-Llama control (its P)
def cluster(tiny_model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[PDCluster]:
    from vllm_kvp2p.testing.cluster import PDCluster

    with PDCluster(
        tiny_model_dir,
        tmp_path_factory.mktemp("pd-logs"),
        prefill_env={"VLLM_KVP2P_HOLD_TIMEOUT": "60", "VLLM_KVP2P_TRANSFER_TIMEOUT": "5"},
        decode_env={"VLLM_KVP2P_TRANSFER_TIMEOUT": "5", "VLLM_KVP2P_CLAIM_WAIT": "5"},
        decode_extra_config={"test_hooks": True},
        decode_failure_policy="recompute",
    ) as cluster:
        yield cluster
