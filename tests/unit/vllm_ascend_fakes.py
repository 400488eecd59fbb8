"""Running vllm-ascend's released allocation code off an NPU: single real functions
(``NPUModelRunner._allocate_kv_cache_tensors`` and the helpers it calls, ``calc_split_factor``,
``AscendMLAAttentionSpec.sparse_kv_cache_ratio`` ...) compiled from the released text into a namespace whose globals
are stand-ins -- a recording ``torch``, spec classes, an NPU allocator with an arena -- so that the hook's real
``patch_module`` wraps the real method and what it allocates is measured against ``ascend_arena_size``
(tests/unit/test_vllm_ascend_release_arena.py for 0.23.0.post1; vllm_ascend_030_fakes.py adds vLLM 0.30's specs)."""

from __future__ import annotations
import __future__

import ast
import builtins
import copy
import math
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.unit.vllm_ascend_ast import _class, _function, _runner_methods
from tests.unit.vllm_ascend_sdist import KV_INTERFACE, MODEL_RUNNER, NPU_PIECE_ALIGN, UTILS, Release
from vllm_kvp2p.platform import ascend_hook


class FakeDtype:
    def __init__(self, name: str, itemsize: int) -> None:
        self.name, self.itemsize = name, itemsize

    def __repr__(self) -> str:
        return f"torch.{self.name}"


INT8, BF16, FP32 = FakeDtype("int8", 1), FakeDtype("bfloat16", 2), FakeDtype("float32", 4)


class FakeTensor:
    """Enough of a 1-D int8 tensor for the allocation code: data_ptr, slicing, element_size."""

    def __init__(self, ptr: int, numel: int, dtype: FakeDtype, alloc_id: int | None) -> None:
        self.ptr, self._numel, self.dtype, self.alloc_id = ptr, numel, dtype, alloc_id

    def data_ptr(self) -> int:
        return self.ptr

    def element_size(self) -> int:
        return self.dtype.itemsize

    def numel(self) -> int:
        return self._numel

    def is_contiguous(self) -> bool:
        return True

    def __getitem__(self, key: slice) -> FakeTensor:
        assert isinstance(key, slice) and key.step is None, key
        start, stop, _ = key.indices(self._numel)
        return FakeTensor(self.ptr + start * self.dtype.itemsize, max(stop - start, 0), self.dtype, self.alloc_id)


class FakeNpu:
    """Stands in for torch-npu's allocator: 512-byte granules from a heap that is NOT 2 MiB aligned (so the
    released ``_align_memory`` really has to move each piece), or, inside an arena scope, from that arena -- a
    bump allocator like csrc/npu/npu_arena.cpp that fails when full."""

    def __init__(self) -> None:
        self.heap_next = 0x7F00_0000_0000 + 3 * NPU_PIECE_ALIGN
        self.arena: SimpleNamespace | None = None
        self.requests: list[tuple[int, bool]] = []  # (bytes asked, inside an arena scope)

    def alloc(self, nbytes: int) -> int:
        self.requests.append((nbytes, self.arena is not None))
        granule = -(-nbytes // NPU_PIECE_ALIGN) * NPU_PIECE_ALIGN
        if self.arena is None:
            ptr, self.heap_next = self.heap_next, self.heap_next + granule
            return ptr
        a = self.arena
        if a.used + granule > a.size:
            raise MemoryError(f"arena of {a.size} B full: {a.used} B used, {nbytes} B more asked")
        ptr, a.used = a.base + a.used, a.used + granule
        return ptr

    @contextmanager
    def arena_scope(self, size: int) -> Iterator[SimpleNamespace]:
        assert self.arena is None
        self.arena = SimpleNamespace(base=0x10_0000_0000, size=size, used=0)  # 2 MiB aligned, like the real one
        try:
            yield self.arena
        finally:
            self.last_arena, self.arena = self.arena, None


def _fake_torch() -> SimpleNamespace:
    counter = iter(range(1 << 30))

    def zeros(*size: Any, dtype: FakeDtype = FP32, device: FakeNpu | None = None) -> FakeTensor:
        dims = size[0] if len(size) == 1 and isinstance(size[0], tuple) else size
        numel = math.prod(dims)
        if device is None:  # host tensor (only used to learn an element size)
            return FakeTensor(0, numel, dtype, None)
        assert isinstance(device, FakeNpu)
        return FakeTensor(device.alloc(numel * dtype.itemsize), numel, dtype, next(counter))

    return SimpleNamespace(zeros=zeros, empty=zeros, int8=INT8, bfloat16=BF16, float32=FP32, Tensor=FakeTensor,
                           dtype=FakeDtype)


class AttentionSpec:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class MambaSpec:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class HiddenStateCacheSpec(AttentionSpec):
    pass


class UniformTypeKVCacheSpecs:
    pass


class AttentionLayerBase:
    pass


class MLAAttention(AttentionLayerBase):
    def __init__(self, kv_lora_rank: int, qk_rope_head_dim: int) -> None:
        self.kv_lora_rank, self.qk_rope_head_dim = kv_lora_rank, qk_rope_head_dim


class CacheOnlyAttentionLayer(AttentionLayerBase):
    pass


def _stub_globals() -> dict[str, Any]:
    """Globals for functions compiled from the release: stand-ins for what they use from torch, vLLM and the
    rest of vllm-ascend. An import the stand-ins do not provide fails loudly."""
    g: dict[str, Any] = {}
    fake_modules = {
        "vllm_ascend.core.kv_cache_interface": SimpleNamespace(),  # filled with AscendMLAAttentionSpec below
        "vllm.v1.kv_cache_interface": SimpleNamespace(HiddenStateCacheSpec=HiddenStateCacheSpec),
    }

    def fake_import(name: str, globals: Any = None, locals: Any = None, fromlist: Any = (), level: int = 0) -> Any:
        if name in fake_modules and fromlist:
            return fake_modules[name]
        raise ImportError(f"released code imported {name!r}, which this test does not stand in for")

    fake_builtins = dict(vars(builtins), __import__=fake_import)
    g.update(
        __builtins__=fake_builtins, __name__="vllm_ascend_release_stub", _fake_modules=fake_modules,
        torch=_fake_torch(), get_dtype_size=lambda dtype: dtype.itemsize,
        AttentionSpec=AttentionSpec, MambaSpec=MambaSpec, UniformTypeKVCacheSpecs=UniformTypeKVCacheSpecs,
        AttentionLayerBase=AttentionLayerBase, MLAAttention=MLAAttention,
        CacheOnlyAttentionLayer=CacheOnlyAttentionLayer,
        get_layers_from_vllm_config=lambda vllm_config, base, names: {n: vllm_config.layers[n] for n in names},
        enable_fa_quant=lambda vllm_config, layer_name=None: False,  # FA quantization is not what is checked here
    )
    return g


def _compile_function(release: Release, rel: str, node: ast.FunctionDef, g: dict[str, Any]) -> Any:
    """The released function ``node`` as a Python function whose globals are ``g`` (line numbers kept).
    Annotations stay unevaluated (``from __future__ import annotations``), so type names need no stand-in."""
    module = ast.fix_missing_locations(ast.Module(body=[copy.deepcopy(node)], type_ignores=[]))
    code = compile(module, rel, "exec", flags=__future__.annotations.compiler_flag, dont_inherit=True)
    namespace: dict[str, Any] = {}
    exec(code, g, namespace)  # noqa: S102 -- one released function definition, stub globals
    return namespace[node.name]


def _fake_ascend_mla_spec_class(release: Release, g: dict[str, Any]) -> type:
    cls_node = _class(release.tree(KV_INTERFACE), "AscendMLAAttentionSpec")
    members = {n.name: n for n in cls_node.body if isinstance(n, ast.FunctionDef)}
    props = {name: _compile_function(release, KV_INTERFACE, members[name], g)
             for name in ("page_size_bytes", "sparse_kv_cache_ratio")}
    defaults = dict(scale_dim=0, scale_dtype=INT8, sparse_head_dim=None, cache_sparse_sfa_c8=False,
                    cache_sparse_li_c8=False, c8_k_cache_dtype=INT8, c8_k_scale_cache_dtype=FP32,
                    sfa_dcp_replicated_indexer_size=1)

    def __init__(self: Any, **kw: Any) -> None:
        self.__dict__.update({**defaults, **kw})

    spec = type("AscendMLAAttentionSpec", (AttentionSpec,), {"__init__": __init__, **props})
    g["AscendMLAAttentionSpec"] = spec
    g["_fake_modules"]["vllm_ascend.core.kv_cache_interface"].AscendMLAAttentionSpec = spec
    return spec


_RUNNER_METHODS = (ascend_hook.TARGET_METHOD, "_allocate_int8_cache_tensor", "_allocate_sparse_c8_indexer_tensors",
                   "_align_memory", "_align_up", "_get_layer_kv_cache_specs", "_get_attention_kv_cache_dims")
_UTILS_FUNCTIONS = ("calc_split_factor", "kv_cache_spec_uses_sparse_sfa_c8", "kv_cache_spec_uses_sparse_li_c8",
                    "sparse_kv_cache_has_indexer", "is_hidden_state_cache_spec")


def _released_runner_module(release: Release, *, mutate_signature: bool = False) -> tuple[ModuleType, dict]:
    """A module ``vllm_ascend.worker.model_runner_v1`` whose NPUModelRunner carries the RELEASED
    ``_allocate_kv_cache_tensors`` and the helpers it calls, compiled from the sdist's text."""
    g = _stub_globals()
    for name in _UTILS_FUNCTIONS:
        g[name] = _compile_function(release, UTILS, _function(release.tree(UTILS), name), g)
    _fake_ascend_mla_spec_class(release, g)
    return _runner_module(release, g, mutate_signature, _RUNNER_METHODS), g


def _runner_module(release: Release, g: dict[str, Any], mutate_signature: bool, names: tuple[str, ...]) -> ModuleType:
    """``vllm_ascend.worker.model_runner_v1`` with an NPUModelRunner of the released runner methods ``names``
    compiled into ``g`` (the hook's target method given one parameter more when ``mutate_signature``)."""
    nodes = _runner_methods(release)
    methods = {}
    for name in names:
        node = nodes[name]
        if mutate_signature and name == ascend_hook.TARGET_METHOD:
            node = copy.deepcopy(node)
            node.args.args.append(ast.arg(arg="kernel_block_sizes"))
        methods[name] = _compile_function(release, MODEL_RUNNER, node, g)
    module = ModuleType(ascend_hook.TARGET_MODULE)
    module.NPUModelRunner = type("NPUModelRunner", (), methods)  # type: ignore[attr-defined]
    return module


class _Group:
    """What the hook asks of the active connector: MooncakeP2PConnector.kvp2p_arena_context(size)."""

    def __init__(self, npu: FakeNpu) -> None:
        self.npu, self.sizes = npu, []

    def kvp2p_arena_context(self, size: int) -> Any:
        self.sizes.append(size)
        return self.npu.arena_scope(size)


def connector_activator(monkeypatch: pytest.MonkeyPatch) -> Any:
    """The ``active_connector`` fixture's value (test_vllm_ascend_release_030.py makes its own from it)."""
    state = ModuleType("vllm.distributed.kv_transfer.kv_transfer_state")
    state.group = None  # type: ignore[attr-defined]
    state.has_kv_transfer_group = lambda: state.group is not None  # type: ignore[attr-defined]
    state.get_kv_transfer_group = lambda: state.group  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, state.__name__, state)

    def activate(group: _Group) -> None:
        state.group = group  # type: ignore[attr-defined]

    return activate
