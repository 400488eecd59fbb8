"""The one place that knows which vLLM versions exist and how their connector contracts differ.

Supported: vLLM 0.23.x (what vllm-ascend 0.23.0.post1 runs) through the newest; tested: the releases CI runs at every
commit, :data:`TESTED_RELEASES`; release-checked: those scripts/check_vllm_releases.sh passed at a recorded commit,
:data:`CHECKED_RELEASES` (docs/compatibility.md says at which commit, and whether what it ran has changed since: this
code cannot know, so it never says checked "at this commit").
Nothing else in the package compares versions or probes vLLM for optional parts: it asks
this module. Where the contract differs, the difference is detected from vLLM's own classes (a method or field is
there or not), not from the version number, so a patched or back-ported vLLM still gets the right path; the
version number only decides whether to start at all and whether to warn.

The differences handled here (0.23 -> 0.32):

* finished transfers: 0.23's workers report ``get_finished() -> (sending, recving)`` and failed loads only as block
  ids (``get_block_ids_with_load_errors``); 0.32 adds ``get_transfer_results()`` with ``failed_recving`` request
  ids (:data:`REPORTS_FAILED_REQUESTS`, :class:`TransferResults`);
* the memory-pool hook: 0.32's worker allocates the KV cache inside ``get_mem_pool_context()``; 0.23's never asks,
  but its ``GPUModelRunner._allocate_kv_cache_tensors`` (the CPU runner inherits it) is a sound route for the same
  scope (:func:`install_kv_allocation_route`);
* ``CacheHitSource`` (0.32's per-source prefix-hit metrics) is absent from 0.23 (:data:`P2P_CACHE_HIT_SOURCE`);
* ``ParallelConfig.data_parallel_index`` (:func:`data_parallel_index`).

Not a difference but a vLLM seam kept here: where the engine core has its workers load a LoRA adapter
(:func:`watch_lora_loads`, for vllm_kvp2p/connector/lora_weights.py).
"""

from __future__ import annotations

import os
import re
import threading
from dataclasses import dataclass, field
from typing import Any

from vllm_kvp2p.log import get_logger

logger = get_logger(__name__)

#: Oldest vLLM the connector starts on; older ones are refused unless ALLOW_UNSUPPORTED_SETTING is set.
MIN_SUPPORTED = (0, 23)
#: Tested: CI runs the whole suite on these at every commit (scripts/test.sh).
TESTED_RELEASES: frozenset[tuple[int, int, int]] = frozenset({(0, 23, 0), (0, 32, 0)})
#: Release-checked: scripts/check_vllm_releases.sh ran the contract tests and a real P/D pair on these and recorded a
#: pass (docs/vllm_releases.json, whose passing entries tests/unit/test_vllm_releases_table.py holds this set to), at a
#: commit that may be older than this code, so they are never called tested here: docs/compatibility.md names each
#: record's commit and says whether it is current. Not the current ones only: this set is part of what a release
#: check runs, so a set updated after the runs would make every record it lists stale.
CHECKED_RELEASES: frozenset[tuple[int, int, int]] = frozenset({
    (0, 24, 0), (0, 25, 0), (0, 25, 1), (0, 26, 0), (0, 27, 0), (0, 27, 1), (0, 28, 0), (0, 29, 0), (0, 30, 0),
    (0, 31, 0),
})
#: The environment variable that lets an older vLLM start anyway. Environment only: the check runs when the
#: connector module is imported, before vLLM hands it the kv_connector_extra_config.
ALLOW_UNSUPPORTED_SETTING = "VLLM_KVP2P_ALLOW_UNSUPPORTED_VLLM"

#: vllm-ascend release -> the vLLM release it is built for (vllm-ascend's versioning policy).
ASCEND_MATRIX: dict[str, str] = {
    "0.23.0.post1": "0.23.0",
    "0.23.0": "0.23.0",
    "0.30.0rc1": "0.30.0",
    "0.30.0rc2": "0.30.0",  # no row of its own: rc1's code with a Dockerfile fix
}


class UnsupportedVllmError(RuntimeError):
    """The installed vLLM is older than the connector supports."""


def parse_version(text: str) -> tuple[int, int, int]:
    """(major, minor, patch) of a vLLM version string such as ``0.23.0``, ``0.32.0+cpu`` or ``0.11.1rc2.dev3``."""
    match = re.match(r"\s*v?(\d+)\.(\d+)(?:\.(\d+))?", text)
    if match is None:
        raise ValueError(f"not a vLLM version: {text!r}")
    major, minor, patch = match.groups()
    return int(major), int(minor), int(patch or 0)


def installed_vllm_version() -> str:
    import vllm

    return str(getattr(vllm, "__version__", "0.0.0"))


@dataclass(frozen=True)
class SupportVerdict:
    """What the connector does on a given vLLM: start quietly (tested or release-checked), start with a warning, or
    refuse."""

    version: str
    supported: bool
    tested: bool
    message: str
    checked: bool = False  # a release-checked release (CHECKED_RELEASES), not tested at every commit

    @property
    def warns(self) -> bool:
        """Started with the "untested" warning: supported, but neither tested nor release-checked."""
        return self.supported and not (self.tested or self.checked)

    @property
    def label(self) -> str:
        """What the start-up line says of this vLLM."""
        if self.tested:
            return "tested"
        if self.checked:
            return ("release-checked at a recorded commit, not necessarily this code: docs/compatibility.md says "
                    "whether it is current")
        return "untested"


def support_verdict(version: str, allow_unsupported: bool = False) -> SupportVerdict:
    """Pure: the decision for ``version`` (no logging, no imports)."""
    try:
        parsed = parse_version(version)
    except ValueError:
        parsed = (0, 0, 0)
    series = parsed[:2]
    tested_names = tested_releases_text()
    supported_range = f"vLLM >= {MIN_SUPPORTED[0]}.{MIN_SUPPORTED[1]}"
    if series < MIN_SUPPORTED:
        if allow_unsupported:
            return SupportVerdict(version, True, False, (
                f"vLLM {version} is older than the supported range ({supported_range}; tested: {tested_names}); "
                f"starting anyway because {ALLOW_UNSUPPORTED_SETTING} is set. Expect failures."
            ))
        return SupportVerdict(version, False, False, (
            f"MooncakeP2PConnector supports {supported_range} (tested: {tested_names}); vLLM {version} is "
            f"installed. Install a supported vLLM (docs/compatibility.md), or set {ALLOW_UNSUPPORTED_SETTING}=1 "
            "to start anyway."
        ))
    if parsed in TESTED_RELEASES:
        return SupportVerdict(version, True, True, f"vLLM {version}: a tested version (CI runs it at every commit)")
    if parsed in CHECKED_RELEASES:
        return SupportVerdict(version, True, False, (
            f"vLLM {version}: release-checked (scripts/check_vllm_releases.sh passed on it at the commit "
            f"docs/compatibility.md names, not necessarily this code; tested at every commit: {tested_names})"
        ), checked=True)
    return SupportVerdict(version, True, False, (
        f"vLLM {version} is untested with MooncakeP2PConnector (tested: {tested_names}; release-checked: "
        f"{checked_releases_text()}); starting anyway. "
        "Report problems with the vLLM version."
    ))


def tested_releases_text() -> str:
    """``0.23.0 and 0.32.0``: the releases CI tests at every commit (``0.23.0 to 0.32.0, every release`` if those
    were ever every minor series between two)."""
    return _releases_text(TESTED_RELEASES)


def checked_releases_text() -> str:
    """``0.24.0 to 0.31.0, every release``: the release-checked releases (:data:`CHECKED_RELEASES`)."""
    return _releases_text(CHECKED_RELEASES)


def _releases_text(releases: frozenset[tuple[int, int, int]]) -> str:
    names = [".".join(map(str, v)) for v in sorted(releases)]
    minors = sorted({v[1] for v in releases})
    if len(names) > 2 and minors == list(range(minors[0], minors[-1] + 1)):
        return f"{names[0]} to {names[-1]}, every release"
    return ", ".join(names[:-1]) + " and " + names[-1] if len(names) > 1 else names[0]


_checked = threading.Event()


def allow_unsupported_from_env(env: Any = None) -> bool:
    raw = (os.environ if env is None else env).get(ALLOW_UNSUPPORTED_SETTING, "")
    return raw.strip().lower() in ("1", "true", "yes", "on")


def check_vllm_supported(version: str | None = None) -> SupportVerdict:
    """Refuse an unsupported vLLM (raises :class:`UnsupportedVllmError`); once per process, log the stack in one
    line, warn for an untested vLLM and for a vLLM / vllm-ascend pair outside vllm-ascend's matrix. Called when
    the connector module is imported and again when a connector is created."""
    verdict = support_verdict(version or installed_vllm_version(), allow_unsupported_from_env())
    if not verdict.supported:
        raise UnsupportedVllmError(verdict.message)
    if not _checked.is_set():
        _checked.set()
        ascend = installed_ascend_version()
        logger.info(
            "MooncakeP2PConnector on vLLM %s (%s), vllm-ascend %s, Mooncake %s", verdict.version,
            verdict.label, ascend or "not installed", installed_mooncake_version(),
        )
        if verdict.warns:
            logger.warning("%s", verdict.message)
        pairing = ascend_pairing_problem(verdict.version, ascend)
        if pairing is not None:
            logger.warning("%s", pairing)
    return verdict


def ascend_pairing_problem(vllm_version: str, ascend_version: str | None) -> str | None:
    """A sentence when the installed vLLM / vllm-ascend pair is not one of vllm-ascend's matrix, else None."""
    if ascend_version is None:
        return None
    expected = ASCEND_MATRIX.get(ascend_version)
    if expected is None:
        known = ", ".join(f"vllm-ascend {a} + vLLM {v}" for a, v in ASCEND_MATRIX.items())
        return f"vllm-ascend {ascend_version} is not in the tested matrix ({known}); see docs/compatibility.md"
    if parse_version(vllm_version)[:3] != parse_version(expected)[:3]:
        return (
            f"vllm-ascend {ascend_version} is built for vLLM {expected} but vLLM {vllm_version} is installed; "
            "install the pair from docs/compatibility.md"
        )
    return None


def _distribution_version(*names: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in names:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def installed_ascend_version() -> str | None:
    return _distribution_version("vllm-ascend")


def installed_mooncake_version() -> str:
    found = _distribution_version(
        "mooncake-transfer-engine-npu", "mooncake-transfer-engine-non-cuda", "mooncake-transfer-engine"
    )
    return found or "not installed"


# ---------------------------------------------------------------------------------------------- contract points

def _base() -> Any:
    try:
        from vllm.distributed.kv_transfer.kv_connector.v1 import base
    except ImportError:  # a vLLM too old for the v1 contract; check_vllm_supported refuses it
        return None
    return base


#: True when vLLM's workers call ``get_transfer_results`` and take failed loads as request ids (0.32); False when
#: they call ``get_finished`` and take failed loads only as block ids (0.23).
REPORTS_FAILED_REQUESTS: bool = hasattr(_base(), "KVConnectorTransferResults")

#: True when vLLM's worker allocates the KV cache inside the connector's ``get_mem_pool_context()``.
HAS_MEM_POOL_HOOK: bool = hasattr(getattr(_base(), "KVConnectorBase_V1", None), "get_mem_pool_context")


@dataclass(frozen=True)
class _LocalTransferResults:
    """Stand-in with the fields of 0.32's ``KVConnectorTransferResults`` (never handed to a 0.23 vLLM)."""

    finished_sending: set[str] = field(default_factory=set)
    finished_recving: set[str] = field(default_factory=set)
    failed_recving: set[str] = field(default_factory=set)


TransferResults: Any = getattr(_base(), "KVConnectorTransferResults", _LocalTransferResults)


def _p2p_cache_hit_source() -> Any:
    try:
        from vllm.v1.metrics.cache_hit_source import CacheHitSource
    except ImportError:  # vLLM without per-source prefix-hit metrics
        return None
    return CacheHitSource.P2P


#: ``CacheHitSource.P2P`` where vLLM counts prefix hits per source, else None.
P2P_CACHE_HIT_SOURCE: Any = _p2p_cache_hit_source()


def kv_event_hashes_problem(vllm_config: Any, environ: Any = None) -> str | None:
    """Why the block hashes this engine publishes in its KV events no router can reproduce, or None.

    vLLM seeds a prompt's first block hash with ``PYTHONHASHSEED``; unset, vLLM 0.32 uses the fixed
    ``DEFAULT_NONE_HASH_SEED`` for sha256 / sha256_cbor and a random per-process seed for xxhash, while vLLM 0.23
    draws a random seed for every algorithm (``init_none_hash`` in ``vllm/v1/core/kv_cache_utils.py``). None too
    when the engine publishes no KV events."""
    events = getattr(vllm_config, "kv_events_config", None)
    if events is None or not getattr(events, "enable_kv_cache_events", False):
        return None
    env = os.environ if environ is None else environ
    if env.get("PYTHONHASHSEED") is not None:
        return None
    algo = str(getattr(vllm_config.cache_config, "prefix_caching_hash_algo", "sha256"))
    from vllm.v1.core import kv_cache_utils

    if hasattr(kv_cache_utils, "DEFAULT_NONE_HASH_SEED") and not algo.startswith("xxhash"):
        return None
    return (f"this engine publishes KV events whose block hashes are seeded at random in every process "
            f"(PYTHONHASHSEED unset, --prefix-caching-hash-algo {algo}, vLLM {installed_vllm_version()}): no router "
            "can match them, so routing by cached prefix (vllm-kvp2p-proxy, vllm-router kv_aware) finds nothing. "
            "Set PYTHONHASHSEED to one value on every engine and the router (docs/routing.md)")


def data_parallel_index(parallel_config: Any) -> int:
    """This engine's DP rank as the operator launched it. vLLM runs the DP ranks of a dense model as independent
    engines and resets their ``data_parallel_rank`` to 0 (``reconfigure_for_independent_dp_rank``); only
    ``data_parallel_index`` keeps the launch rank, so ports derived from the rank would collide. Versions without
    the field fall back to the rank."""
    index = getattr(parallel_config, "data_parallel_index", None)
    return int(index if index is not None else parallel_config.data_parallel_rank)


def node_ip() -> str:
    """This node's address as vLLM determines it: ``VLLM_HOST_IP``, else the source address of the route to a
    public address (a UDP socket is connected, nothing is sent); "0.0.0.0" when there is none. Where the connector's
    ``host`` is unset, peers are given this (KVP2PConfig.advertised_host). ``vllm.utils.network_utils.get_ip`` in
    0.23 and 0.32; ``vllm.utils.get_ip`` in older releases."""
    try:
        from vllm.utils.network_utils import get_ip
    except ImportError:
        from vllm.utils import get_ip  # type: ignore[attr-defined,no-redef]
    return str(get_ip())


def gather_over_engine(obj: Any) -> list[Any] | None:
    """``obj`` of every rank of this engine, in engine-rank order (pipeline stage by stage, each stage's
    tensor-parallel ranks in order: rank ``stage * tp_size + tp_rank``). A collective: every rank of the engine must
    call it. Over vLLM's CPU process groups (gloo, across nodes too): the TP group, then the PP group. None when the
    engine has one rank, or no vLLM distributed set-up (a worker built by hand)."""
    stage = _gather_over("get_tp_group", obj)
    stages = _gather_over("get_pp_group", stage if stage is not None else [obj])
    if stages is None:
        return stage
    return [item for ranks in stages for item in ranks]


def _gather_over(group_getter: str, obj: Any) -> list[Any] | None:
    import torch.distributed as dist

    try:
        from vllm.distributed import parallel_state

        group = getattr(parallel_state, group_getter)()
    except (ImportError, AssertionError):  # vLLM asserts the group was initialised
        return None
    if not dist.is_initialized() or group.world_size <= 1:
        return None
    out: list[Any] = [None] * group.world_size
    dist.all_gather_object(out, obj, group=group.cpu_group)
    return out


def transfer_group_ids(kv_cache_config: Any) -> tuple[int, ...]:
    """KV-cache groups that take part in KV transfer: vLLM 0.32 lets a group opt out (``enable_kv_transfer``,
    ``KVCacheConfig.transfer_group_ids``); in 0.23 every group does."""
    ids = getattr(kv_cache_config, "transfer_group_ids", None)
    return tuple(ids) if ids is not None else tuple(range(len(kv_cache_config.kv_cache_groups)))


# ------------------------------------------------------------------------------------- KV allocation route

#: Where a vLLM without ``get_mem_pool_context`` allocates the KV cache (the CPU model runner inherits it): 0.23 to
#: 0.28 in a runner method, 0.29 and 0.30 in a module function the runner module imports by name; 0.31 on asks
#: the connector for a memory pool.
ALLOCATION_ROUTE = ("vllm.v1.worker.gpu_model_runner", "GPUModelRunner", "_allocate_kv_cache_tensors")
ALLOCATION_FUNCTION_ROUTE = ("vllm.v1.worker.gpu_model_runner", "allocate_kv_cache")


def install_kv_allocation_route() -> str:
    """Make sure this worker's KV cache is allocated inside the connector's arena scope; returns how, for the
    start-up log: "get_mem_pool_context" (vLLM calls it), "wrapped <Class.method>" or "wrapped <module.function>"
    (the allocation is wrapped, as the vllm-ascend hook does on NPU) or "none (...)" (per-tensor registration
    follows). Which one is found from vLLM's code, not its version number."""
    if HAS_MEM_POOL_HOOK:
        return "get_mem_pool_context"
    import importlib

    from vllm_kvp2p.platform.alloc_hook import wrap_allocation_function, wrap_allocation_method

    module_name, class_name, method_name = ALLOCATION_ROUTE
    try:
        module = importlib.import_module(module_name)
    except ImportError as exc:
        return f"none ({module_name} not importable: {exc})"
    route = wrap_allocation_method(module, class_name, method_name, size_of=None)
    if not route.startswith("none"):
        return route
    function_route = wrap_allocation_function(module, ALLOCATION_FUNCTION_ROUTE[1])
    return function_route if not function_route.startswith("none") else f"{route[:-1]}; {function_route[6:]}"


# ------------------------------------------------------------------------------------- LoRA loads

#: Where vLLM's engine core has its workers load a LoRA adapter outside a request's step (``--lora-modules`` at
#: start-up, ``/v1/load_lora_adapter``, LoRA resolvers): ``EngineCore.add_lora`` -> ``model_executor.add_lora`` ->
#: every worker's ``add_lora``, in the engine-core process whatever the executor; the same in 0.23 and 0.32.
LORA_LOAD_ROUTE = ("vllm.v1.engine.core", "EngineCore", "add_lora")


def watch_lora_loads(around: Any) -> str:
    """Run every engine-level LoRA load of this process inside ``around(lora_request)`` (a context manager:
    vllm_kvp2p/connector/lora_weights.py looks at the adapter's files before and after the workers read them). Once per
    process; returns the route for the log: "wrapped EngineCore.add_lora", or "none (...)" when vLLM has no such
    method or it takes other arguments (then those loads cannot be watched and the caller binds no adapter)."""
    import functools
    import importlib
    import inspect

    module_name, class_name, method_name = LORA_LOAD_ROUTE
    route = f"wrapped {class_name}.{method_name}"
    try:
        owner = getattr(importlib.import_module(module_name), class_name)
    except (ImportError, AttributeError) as exc:
        return f"none ({module_name}.{class_name} not found: {exc})"
    method = getattr(owner, method_name, None)
    if method is None:
        return f"none ({class_name} has no {method_name})"
    if getattr(method, "_kvp2p_watched", False):
        return route
    parameters = list(inspect.signature(method).parameters)
    if parameters != ["self", "lora_request"]:
        return f"none ({class_name}.{method_name} takes ({', '.join(parameters)}), not (self, lora_request))"

    @functools.wraps(method)
    def add_lora(self: Any, lora_request: Any) -> Any:
        with around(lora_request):
            return method(self, lora_request)

    add_lora._kvp2p_watched = True  # type: ignore[attr-defined]
    setattr(owner, method_name, add_lora)
    return route
