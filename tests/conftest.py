"""Which tests each vLLM runs. CI (scripts/test.sh) runs the suite on vLLM 0.32 and on vLLM 0.23; a test that
touches neither vLLM nor Mooncake is the same code whatever the vLLM, so it runs once, on the newest one.

THE RULE (keep it true when you add a test module):

* Every package but tests/unit needs vLLM or Mooncake (scheduler: vLLM's Scheduler; worker: Mooncake, whose
  version differs between the two environments; every e2e: engines). They run on every vLLM.
* A module of tests/unit that imports vLLM or Mooncake, directly or through the code it tests, even lazily inside
  a test, is named in ``NEEDS_VLLM_OR_MOONCAKE`` below. It runs on every vLLM.
* Every other module of tests/unit is *pure*.

* A package (or a module, ``package/test_x.py``) named in ``NEWEST_VLLM_ONLY`` below runs on the newest vLLM only:
  what it adds is the connector's own code on paths where the two vLLMs do not differ, and each vLLM seam it touches
  is exercised on the older vLLM by the package its entry names. Adding one there needs that argument written
  down; CI's time rule (docs/testing.md) is why the list exists.

``KVP2P_TESTS=pure`` runs only the pure modules, with vLLM and Mooncake made unimportable: that run is the check,
a pure module that needs either fails there with a message naming this list. ``KVP2P_TESTS=contract`` runs all
the rest (what the newest vLLM runs); ``KVP2P_TESTS=older`` the same less ``NEWEST_VLLM_ONLY`` (what vLLM 0.23
runs). Unset: everything, as a developer runs pytest.
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
    "test_kv_events_vllm",  # vLLM's KV-event structs, block hashing and ZMQ publisher
    "test_metrics",  # vLLM's connector-stats classes
    "test_plugin",  # registers with vLLM's connector factory
    "test_proxy_prechecks_vllm",  # the proxy's checks before P against vLLM's own request classes
    "test_worker_polling",  # wraps vLLM's shared-memory reader
}

#: Packages the older vLLM (0.23) skips, each with the argument: why it adds nothing vLLM-specific there, and which
#: package exercises on 0.23 the vLLM seams it touches.
NEWEST_VLLM_ONLY = {
    "e2e_netns": "the network faults (a cut link, a killed or frozen P, a vanished reader, a killed D) run the "
                 "connector's lifecycle and timers, the same code on every vLLM; vLLM's host detection on a host of "
                 "its own (compat.node_ip, no host settings) runs on 0.23 in e2e_multinode, on three hosts",
    "e2e_soak": "cancellations and a P restart under load: the connector's lifecycle; vLLM's aborts and finished "
                "requests run on 0.23 in tests/scheduler (its real Scheduler) and tests/e2e (leaving clients, aborts; "
                "failed loads recomputed in test_hostile_params.py)",
    "e2e_dp": "P at DP 2 on one host: its vLLM seam, each engine core's index from vLLM's parallel config "
              "(compat.data_parallel_index, vLLM resets data_parallel_rank), runs on 0.23 in e2e_multinode's "
              "DP 2 over two nodes",
    "e2e_auth": "the shared secret is the connector's own HMAC; its vLLM seam, the prompt token ids the params are "
                "bound to (read from vLLM's request), runs on 0.23 in e2e_multinode (the secret on every node, every "
                "pull signed and checked) and tests/scheduler (prompt-bound params on vLLM's real Scheduler)",
    "e2e_state": "vLLM 0.23 serves the tiny Qwen3-Next on no CPU tried, with or without a KV connector (its CPU GDN "
                 "kernel: 'RuntimeError: Input tensor dtype mismatch'; this package's probe proved it in every run "
                 "until it was listed here, three engine starts each time); linear-attention groups run on 0.23 in "
                 "tests/scheduler on vLLM's own specs",
    # Modules (a path under tests/): the rest of their package runs on 0.23.
    "e2e/test_prefill_faults_end_to_end.py": "a P whose hold expires, that freezes, that is killed: the connector's "
                 "timers, probes and lifecycle, the same code on every vLLM (tests/worker runs them on 0.23 against "
                 "real Mooncake engines); D's side in vLLM, a failed load recomputed, runs on 0.23 in "
                 "e2e/test_hostile_params.py",
    "e2e/test_parallel_sampling_kv_pressure.py": "n > 1 children under KV pressure through one more, small D: D's "
                 "roles (one record per request, ended holds remembered) are the connector's own code; the vLLM "
                 "seams they meet (children added one at a time, preemption, a request that does not fit) run on "
                 "0.23 in tests/scheduler/test_parallel_sampling.py on vLLM's real Scheduler, each case failing "
                 "without the fix, and n = 3 through real engines in e2e/test_openai_clients.py",
    "worker/test_integrity_fairness.py": "P's question queue and D's handling of a busy or erring P: the "
                 "connector's own code over ZMQ; Mooncake 0.3.11's reads and the integrity sums they are checked "
                 "against run on 0.23 in worker/test_integrity.py",
    "e2e_multinode/test_tp_over_nodes.py": "P's TP ranks on two nodes: the rank table is gathered over vLLM's TP "
                 "group (compat.gather_over_engine), which runs on 0.23 in e2e_tp (P at TP 2 on one host); what the "
                 "second node adds is each rank's own address (compat.node_ip) and the secret on every node, which "
                 "run on 0.23 in test_dp_over_nodes.py, on three hosts; gloo across nodes is vLLM's, not a seam",
    "e2e_multinode/test_pp_over_nodes.py": "P's pipeline stages on two nodes: a stage registers only its own layers "
                 "and the rank table is gathered over vLLM's PP x TP groups, both of which run on 0.23 in e2e_tp "
                 "(D at PP 2 on one host; a P stage meets the same vLLM calls as a D stage); the second node adds "
                 "what test_dp_over_nodes.py runs on 0.23",
}

MODE = os.environ.get("KVP2P_TESTS", "")
TESTS = Path(__file__).parent
UNIT = TESTS / "unit"


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


def is_newest_only(path: Path) -> bool:
    """A package of tests/ (``e2e_netns``) or a module (``e2e_multinode/test_tp_over_nodes.py``) NEWEST_VLLM_ONLY
    names."""
    return path.parent.parent == TESTS and path.parent.name + "/" + path.name in NEWEST_VLLM_ONLY or (
        path.parent == TESTS and path.name in NEWEST_VLLM_ONLY)


def pytest_ignore_collect(collection_path: Path) -> bool | None:
    if MODE in ("contract", "older") and is_pure(collection_path):
        return True  # the same code whatever the vLLM: the newest vLLM's run covers it
    if MODE == "older" and is_newest_only(collection_path):
        return True
    if MODE == "pure":
        if collection_path.is_dir():
            inside = UNIT == collection_path or UNIT in collection_path.parents or collection_path in UNIT.parents
            return None if inside else True
        if collection_path.suffix == ".py" and collection_path.name != "conftest.py" and not is_pure(collection_path):
            return True
    return None


def pytest_configure(config: pytest.Config) -> None:
    if MODE not in ("", "pure", "contract", "older"):
        raise pytest.UsageError(f"KVP2P_TESTS={MODE!r}: 'pure', 'contract', 'older' or unset")
    from tests.support import skip_log  # every skip and xfail to $KVP2P_SKIP_LOG, for scripts/check_skips.py

    if not config.pluginmanager.is_registered(skip_log):
        config.pluginmanager.register(skip_log, "kvp2p-skip-log")
    if MODE != "pure":  # every `vllm serve` this run starts, counted and timed (tests/support/engine_starts.py)
        from tests.support.engine_starts import EngineStartLedger

        ledger = EngineStartLedger()
        ledger.install()
        config.pluginmanager.register(ledger, "kvp2p-engine-starts")
        config.add_cleanup(ledger.uninstall)


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
        decode_extra_config={"test_hooks": True, "integrity": "full"},  # every pull's bytes verified
        decode_failure_policy="recompute",
    ) as cluster:
        yield cluster


# ---------------------------------------------------------------------------------------------------------------
# A test that fails part-way must not fail the next one through what it left behind: holds on a shared P pin
# blocks for up to hold_timeout + lease_timeout, and the next test's idleness check would see them. After a
# failed test, every running engine it used is waited on until vLLM reports no KV block in use (bounded by those
# two timers), so the failure is reported once, where it happened.
# ---------------------------------------------------------------------------------------------------------------

_FAILED = pytest.StashKey[bool]()


@pytest.hookimpl(wrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[pytest.TestReport]:
    report = yield
    if report.failed:
        item.stash[_FAILED] = True
    return report


def _engines_in(value: object) -> list[object]:
    from vllm_kvp2p.testing.server import VllmServer

    if isinstance(value, VllmServer):
        return [value]
    # The deployments of this suite: P/D pairs and clusters (prefill, decode), the soak's (engines: both P and D).
    parts = [getattr(value, "prefill", None), getattr(value, "decode", None), *getattr(value, "engines", ())]
    return [part for part in parts if isinstance(part, VllmServer)]


@pytest.fixture(autouse=True)
def _engines_idle_after_a_failure(request: pytest.FixtureRequest) -> Iterator[None]:
    yield
    if MODE == "pure" or not request.node.stash.get(_FAILED, False):
        return
    import time

    seen: set[int] = set()
    for value in list(getattr(request.node, "funcargs", {}).values()):
        for server in _engines_in(value):
            if id(server) in seen or not server.is_running():
                continue
            seen.add(id(server))
            env = server.env
            bound = float(env.get("VLLM_KVP2P_HOLD_TIMEOUT", 120)) + float(env.get("VLLM_KVP2P_LEASE_TIMEOUT", 60)) + 10
            deadline = time.monotonic() + bound
            while time.monotonic() < deadline:
                try:
                    if server.metric("vllm:kv_cache_usage_perc") == 0:
                        break
                except Exception:  # noqa: BLE001 - a dead or frozen engine: nothing to wait for
                    break
                time.sleep(0.5)
