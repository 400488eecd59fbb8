"""Give vllm-ascend's NPU worker the KV arena even though it never calls ``get_mem_pool_context()``.

vLLM's GPU worker (and the CPU worker that inherits it) allocates the KV cache inside the connector's
``get_mem_pool_context()``. vllm-ascend's ``NPUWorker.initialize_from_config`` does not (checked against the
0.23.0.post1 and 0.30.0rc2 releases by tests/unit/test_vllm_ascend_release.py and ..._030.py): its
``NPUModelRunner._allocate_kv_cache_tensors(kv_cache_config)`` allocates each piece itself (K, V and, for sparse
MLA models, the indexer cache), each padded to 2 MiB alignment, so the KV cache would be up to three regions per
layer, against HCCL's 256.

:func:`install` runs from the plugin (``vllm_kvp2p.register``) and must stay cheap: when vllm-ascend is installed
it only adds an import hook; when ``vllm_ascend.worker.model_runner_v1`` is imported (or already was), that method
is wrapped so it runs inside the active MooncakeP2PConnector's arena scope. The wrap is guarded by the method's
signature, not a version list: if vllm-ascend renames or changes it, one warning is logged and the connector falls
back to merged per-tensor registration, where the region limit is checked up front with a clear error.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
from collections.abc import Sequence
from types import ModuleType
from typing import Any

from vllm_kvp2p.log import get_logger
from vllm_kvp2p.platform.alloc_hook import EXPECTED_PARAMS, wrap_allocation_method

logger = get_logger(__name__)

TARGET_MODULE = "vllm_ascend.worker.model_runner_v1"
TARGET_CLASS = "NPUModelRunner"
TARGET_METHOD = "_allocate_kv_cache_tensors"
__all__ = ["EXPECTED_PARAMS", "ascend_arena_size", "install", "patch_module"]

# vllm-ascend pads every piece it allocates (K, V, and for MLA/sparse models the rope or index cache) by one 2 MiB
# alignment; at most this many pieces per KVCacheTensor are budgeted (over-reserves <= 2 MiB per layer otherwise).
_PIECES_PER_TENSOR = 3
# With vLLM >= 0.29's KVCacheTensor (vllm-ascend 0.30.0rc2 on vLLM 0.30.0) pieces are per layer: K + V (MLA: nope +
# rope), or one (page-strided K/V, indexer K [+ scale], Mamba state).
_PIECES_PER_LAYER = 2
_ALIGN = 2 << 20

_lock = threading.Lock()
_finder_installed = False


def ascend_arena_size(kv_cache_config: Any) -> int:
    """Bytes vllm-ascend's ``_allocate_kv_cache_tensors`` asks for: each KVCacheTensor's size plus one 2 MiB
    alignment pad per piece, plus 2 MiB slack, rounded to 2 MiB.

    A KVCacheTensor whose first layer is an attention layer and which is shared with other layers (a hidden-state
    or cache-only layer) is allocated twice by vllm-ascend 0.23.0.post1: its attention branch marks only the names
    containing "attn" as done, so the single-tensor branch allocates the whole size again for the others
    (model_runner_v1.py:4118 and :4280). With the other layer first, one allocation serves all. Both orders run
    through the released code in tests/unit/test_vllm_ascend_release_arena.py.

    vLLM >= 0.29 describes the cache differently (KVCacheTensor with ``layers``/``layer_stride``: every descriptor's
    ``size`` is the one shared backing), and vllm-ascend 0.30.0rc2 does not allocate that backing: see
    :func:`_descriptor_budget`."""
    tensors = list(getattr(kv_cache_config, "kv_cache_tensors", None) or [])
    if tensors and all(hasattr(t, "layer_stride") for t in tensors):
        total = _descriptor_budget(kv_cache_config, tensors) + _ALIGN
    else:
        total = sum(_tensor_budget(t) for t in tensors) + _ALIGN
    return -(-total // _ALIGN) * _ALIGN


def _tensor_budget(tensor: Any) -> int:
    size = int(tensor.size)
    names = [str(n) for n in (getattr(tensor, "shared_by", None) or [])]
    if names and "attn" in names[0] and any("attn" not in n for n in names):
        return 2 * size + (_PIECES_PER_TENSOR + 1) * _ALIGN
    return size + _PIECES_PER_TENSOR * _ALIGN


def _descriptor_budget(kv_cache_config: Any, tensors: list[Any]) -> int:
    """What vllm-ascend 0.30.0rc2 (model_runner_v1.py:4946) allocates for vLLM >= 0.29's descriptors, 2 MiB pad
    per piece included. Mostly a private buffer per layer (``num_blocks x`` its page, as the worker budgets it in
    ``_scale_kv_cache_memory_for_multi_group``); one backing of the descriptors' ``size`` for DeepSeek-V4 and for
    hybrid attention/Mamba models whose layers all fit the compact layer-outer layout; one allocation of each
    descriptor's ``size`` for DeepSeek-V4.1 and GLM-Next's padded pages. Decided by runner state this cannot see,
    so not covered (``kv_arena=false`` avoids the arena): KVPP (``kvpp_config.size > 1``) and a hybrid model run
    with sparse or compressed attention (arena too small: torch-npu reports out-of-memory), Step-3.5/3.7 (one
    backing, budgeted per layer: too large to reserve)."""
    specs = _layer_specs(kv_cache_config)
    versions = {getattr(spec, "model_version", None) for spec in specs.values()}
    if "deepseek_v41" in versions or _padded_page_layout(specs.values()):
        return sum(int(t.size) + _ALIGN for t in tensors)  # one allocation per descriptor (:4970, :5024)
    backing = max(int(t.size) for t in tensors)
    num_blocks = int(getattr(kv_cache_config, "num_blocks", 0) or 0)
    if "deepseek_v4" in versions or (_hybrid(specs.values()) and _fits_one_backing(tensors, specs, num_blocks)):
        return backing + _ALIGN  # one shared backing (:5051, :5107)
    total, seen = 0, set()
    for tensor in tensors:
        for name in _layer_names(tensor):
            if name not in seen:
                seen.add(name)
                total += num_blocks * _page_size(specs.get(name), tensor) + _PIECES_PER_LAYER * _ALIGN
    return total


def _layer_names(tensor: Any) -> list[str]:
    return [str(n) for n in (getattr(tensor, "layers", None) or getattr(tensor, "shared_by", None) or [])]


def _layer_specs(kv_cache_config: Any) -> dict[str, Any]:
    """Layer name -> its KV cache spec (a UniformTypeKVCacheSpecs group holds one per layer)."""
    specs: dict[str, Any] = {}
    for group in getattr(kv_cache_config, "kv_cache_groups", None) or []:
        spec = group.kv_cache_spec
        per_layer = getattr(spec, "kv_cache_specs", None)
        for name in group.layer_names:
            specs[str(name)] = per_layer[name] if isinstance(per_layer, dict) else spec
    return specs


def _is_a(spec: Any, class_name: str) -> bool:
    return any(cls.__name__ == class_name for cls in type(spec).__mro__)


def _hybrid(specs: Any) -> bool:
    specs = list(specs)
    return any(_is_a(s, "MambaSpec") for s in specs) and any(_is_a(s, "AttentionSpec") for s in specs)


def _padded_page_layout(specs: Any) -> bool:
    """vllm-ascend's ``requires_padded_page_layout`` (core/kv_cache_interface.py:68)."""
    specs = list(specs)
    state = [s for s in specs if _is_a(s, "MambaSpec") and getattr(s, "page_size_padded", None) is not None]
    return bool(state) and any(getattr(s, "indexes_kv_by_block_stride", False) for s in specs)


def _fits_one_backing(tensors: list[Any], specs: dict[str, Any], num_blocks: int) -> bool:
    """Every layer's region lies in the shared backing with a page-sized block stride: the test with which
    model_runner_v1.py:5126 materializes one backing instead of a buffer per layer."""
    if len({int(t.size) for t in tensors}) != 1:
        return False
    for tensor in tensors:
        for index, name in enumerate(_layer_names(tensor)):
            page = _page_size(specs.get(name), tensor)
            start = int(getattr(tensor, "offset", 0)) + index * int(tensor.layer_stride)
            if int(tensor.block_stride) != page or start + num_blocks * page > int(tensor.size):
                return False
    return True


def _page_size(spec: Any, tensor: Any) -> int:
    page = getattr(spec, "page_size_bytes", None) if spec is not None else None
    if page:
        return int(page)
    strides = [int(s) for s in (tensor.layer_stride, tensor.block_stride) if int(s) > 0]
    return min(strides) if strides else int(tensor.size)


def install() -> bool:
    """Arrange for NPUModelRunner to allocate from the arena. True when vllm-ascend is installed (wrapped now or
    on import), False when it is not (nothing to do). Idempotent."""
    global _finder_installed
    try:
        if importlib.util.find_spec("vllm_ascend") is None:
            return False
    except (ImportError, ValueError):
        return False
    module = sys.modules.get(TARGET_MODULE)
    if module is not None:
        patch_module(module)
        return True
    with _lock:
        if not _finder_installed:
            sys.meta_path.insert(0, _PatchOnImport())
            _finder_installed = True
    return True


def patch_module(module: ModuleType) -> bool:
    """Wrap ``NPUModelRunner._allocate_kv_cache_tensors`` in ``module``. False (with one warning) when it is not
    there in the expected form."""
    version = _vllm_ascend_version()
    outcome = wrap_allocation_method(module, TARGET_CLASS, TARGET_METHOD, ascend_arena_size)
    if not outcome.startswith("wrapped"):
        logger.warning(
            "vllm-ascend %s: %s; the KV cache will not come from the connector's arena: it is registered per "
            "tensor (touching tensors merged) and the region limit is checked at registration", version, outcome,
        )
        return False
    logger.info("vllm-ascend %s: %s.%s now allocates the KV cache inside MooncakeP2PConnector's arena",
                version, TARGET_CLASS, TARGET_METHOD)
    return True


def _vllm_ascend_version() -> str:
    try:
        from importlib.metadata import version

        return version("vllm-ascend")
    except Exception:
        return "(version unknown)"


class _PatchOnImport(importlib.abc.MetaPathFinder):
    """Import hook: lets the normal finders load TARGET_MODULE, then patches it right after it executes."""

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        if fullname != TARGET_MODULE:
            return None
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None or not hasattr(spec.loader, "exec_module"):
            return None
        spec.loader = _PatchingLoader(spec.loader)
        return spec


class _PatchingLoader(importlib.abc.Loader):
    def __init__(self, inner: importlib.abc.Loader) -> None:
        self._inner = inner

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> ModuleType | None:
        return self._inner.create_module(spec)

    def exec_module(self, module: ModuleType) -> None:
        self._inner.exec_module(module)
        try:
            patch_module(module)
        except Exception:  # never break vllm-ascend's import because of us
            logger.exception("could not wrap %s.%s; KV cache registered per tensor", TARGET_CLASS, TARGET_METHOD)
