"""``platform/ascend_hook.py`` against what vllm-ascend 0.30.0rc2 changed, read and run from its released source.

The checks both releases share run for 0.30.0rc2 in test_vllm_ascend_release.py (its ``release`` fixture); this
module holds the ones only 0.30.0rc2's code supports, with its helpers (fetching, ``ast``, the recording ``torch``
and arena) imported from there. 0.30.0rc2 is 0.30.0rc1 plus a Dockerfile fix (its release notes); it runs on vLLM
0.30.0. What changed for the hook:

* vLLM 0.30's KVCacheTensor is a descriptor (``layers``, ``layer_stride``, ``block_stride``, ``offset``; every
  descriptor's ``size`` is ONE shared backing), and ``NPUModelRunner._allocate_kv_cache_tensors`` (same name and
  signature) does not allocate that backing: it gives most layers a private buffer of ``num_blocks x page`` (K + V,
  or one page-strided buffer), 2 MiB padded each. The 0.23 budget (each KVCacheTensor's size + 3 pads) is then
  both too small (2 pads per layer, not 3 per descriptor) and, with several descriptors, far too large: a genuine
  break, fixed in ``ascend_arena_size`` and run through the released code here.
* ``initialize_kv_cache`` takes ``kv_cache_allocation_context``: CaMemAllocator's sleep-mode pool when
  ``enable_sleep_mode`` is set, ``nullcontext()`` otherwise, entered around ``_allocate_kv_cache_tensors`` only --
  so around the hook's arena scope. Pinned below; only sleep mode is affected.
* The v2 model runner (allocation elsewhere, not wrapped) is opt-in: ``VLLM_USE_V2_MODEL_RUNNER=1``.
"""

from __future__ import annotations

import ast
import copy
import re
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.unit.test_vllm_ascend_release import (
    BF16,
    FP32,
    INT8,
    MIB,
    MODEL_RUNNER,
    NPU_PIECE_ALIGN,
    UTILS,
    V023,
    V030,
    WORKER,
    AttentionLayerBase,
    CacheOnlyAttentionLayer,
    FakeNpu,
    MLAAttention,
    Release,
    _calls,
    _class,
    _compile_function,
    _connector_created_first,
    _function,
    _Group,
    _is_self_call,
    _method,
    _param_names,
    _pieces_in,
    _requires_dist,
    _runner_methods,
    _runner_module,
    _shape_function,
    _stub_globals,
    _worst_path,
    connector_activator,
    load_release,
)
from vllm_kvp2p.platform import ascend_hook

KV_INTERFACE = "vllm_ascend/core/kv_cache_interface.py"
V2_RUNNER = "vllm_ascend/worker/v2/model_runner.py"
CAMEM = "vllm_ascend/device_allocator/camem.py"


@pytest.fixture(scope="module")
def release_030() -> Release:
    return load_release(V030)


@pytest.fixture
def active_connector(monkeypatch: pytest.MonkeyPatch) -> Any:
    """``activate(group)`` makes ``group`` the hook's active KV connector (test_vllm_ascend_release.py's fixture)."""
    return connector_activator(monkeypatch)


# ----------------------------------------------------------------------------------------------------------------
# (a) which runner allocates: the v1 NPUModelRunner unless VLLM_USE_V2_MODEL_RUNNER=1
# ----------------------------------------------------------------------------------------------------------------


def test_v2_model_runner_is_opt_in_and_allocates_elsewhere(release_030: Release) -> None:
    """vLLM 0.30 turns its v2 runner on by default; vllm-ascend patches ``VllmConfig.use_v2_model_runner`` to read
    only VLLM_USE_V2_MODEL_RUNNER (unset: False). So by default NPUWorker builds the wrapped NPUModelRunner. With
    the variable set, its v2 runner allocates in ``vllm_ascend/worker/v2/attn_utils.py:_allocate_kv_cache`` (vLLM's
    ``allocate_kv_cache`` replaced by patch), which the hook does not wrap: the connector then registers the KV
    tensors one by one (with the platform's region limit checked)."""
    release = release_030
    worker = _class(release.tree(WORKER), "NPUWorker")
    assign = [n for n in ast.walk(_method(worker, "__init__")) if isinstance(n, ast.Assign)
              and ast.unparse(n) == "self.use_v2_model_runner = self.vllm_config.use_v2_model_runner"]
    assert [n.lineno for n in assign] == [192]
    init_device = _method(worker, "init_device")
    choice = [n for n in ast.walk(init_device)
              if isinstance(n, ast.If) and ast.unparse(n.test) == "self.use_v2_model_runner"]
    assert [n.lineno for n in choice] == [500]
    assert "from vllm_ascend.worker.v2.model_runner import NPUModelRunner as NPUModelRunnerV2" in ast.unparse(choice[0])
    assert [ast.unparse(s) for s in choice[0].orelse] == [
        "self.model_runner = NPUModelRunner(self.vllm_config, self.device)"]

    patch = "vllm_ascend/patch/platform/patch_use_v2_model_runner.py"
    tree = release.tree(patch)
    installed = [ast.unparse(n) for n in tree.body if isinstance(n, ast.Assign)]
    assert "VllmConfig.use_v2_model_runner = property(_patched_use_v2_model_runner)" in installed
    assert "import vllm_ascend.patch.platform.patch_use_v2_model_runner" in release.text(
        "vllm_ascend/patch/platform/__init__.py")
    fn = _function(tree, "_patched_use_v2_model_runner")
    assert fn.lineno == 18
    for env, used in ((None, False), (True, True), (False, False)):
        g = {"envs": SimpleNamespace(VLLM_USE_V2_MODEL_RUNNER=env)}
        assert _compile_function(release, patch, fn, g)(SimpleNamespace()) is used, env

    v2 = _class(release.tree(V2_RUNNER), "NPUModelRunner")
    assert v2.lineno == 125 and [ast.unparse(b) for b in v2.bases] == ["GPUModelRunner"]
    assert "from vllm.v1.worker.gpu.model_runner import (" in release.text(V2_RUNNER)  # vLLM's v2, not ours
    assert ascend_hook.TARGET_METHOD not in {n.name for n in v2.body if isinstance(n, ast.FunctionDef)}
    assert "vllm.v1.worker.gpu.attn_utils.allocate_kv_cache = allocate_kv_cache_main" in release.text(
        "vllm_ascend/patch/worker/patch_v2/patch_attn_utils.py")
    main = _function(release.tree("vllm_ascend/worker/v2/attn_utils.py"), "allocate_kv_cache_main")
    assert [c.lineno for c in _calls(main) if ast.unparse(c.func) == "_allocate_kv_cache"] == [1240]


# ----------------------------------------------------------------------------------------------------------------
# (c) the connector exists before the allocation runs
# ----------------------------------------------------------------------------------------------------------------


def test_worker_creates_the_connector_before_allocating_the_kv_cache(release_030: Release) -> None:
    release = release_030
    tree = release.tree(WORKER)
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "vllm.distributed.kv_transfer"]
    assert len(imports) == 1 and "ensure_kv_transfer_initialized" in {a.name for a in imports[0].names}
    assert imports[0].lineno == 36
    worker = _class(tree, "NPUWorker")
    assert worker.lineno == 122 and [ast.unparse(b) for b in worker.bases] == ["WorkerBase"]
    fn = _method(worker, "initialize_from_config")
    assert fn.lineno == 1178 and _param_names(fn) == ("self", "kv_cache_config")
    # Unconditional, at the top level, after a DSpark-only adjustment of kv_cache_config; then the allocation.
    assert _connector_created_first(tree) == (1194, [1198])
    for other in (n for n in worker.body if isinstance(n, ast.FunctionDef) and n is not fn):
        names = {ast.unparse(c.func) for c in _calls(other)}
        assert not names & {"self.model_runner.initialize_kv_cache", "self.model_runner.initialize_kv_cache_tensors",
                            "self.model_runner._allocate_kv_cache_tensors"}, f"{WORKER}:{other.lineno} {other.name}"
    # The order check can fail: with the connector created after the allocation it reports so.
    text = release.text(WORKER)
    ensure = "        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)\n"
    init_end = ('            kv_cache_allocation_context=self._maybe_get_memory_pool_context(tag="kv_cache"),\n'
                '        )\n')
    assert text.count(ensure) == 1 and text.count(init_end) == 1
    swapped = text.replace(ensure, "").replace(init_end, init_end + ensure)
    late_line, late_reach = _connector_created_first(ast.parse(swapped))
    assert late_line > min(late_reach)

    # initialize_kv_cache -> initialize_kv_cache_tensors -> (inside the allocation context)
    # _allocate_kv_cache_tensors; the connector gets the tensors afterwards (register_kv_caches).
    methods = _runner_methods(release)
    init_kv = methods["initialize_kv_cache"]
    assert init_kv.lineno == 4591
    assert _param_names(init_kv) == ("self", "kv_cache_config", "kv_cache_allocation_context")
    tensors_call = [c for c in _calls(init_kv) if _is_self_call(c, "initialize_kv_cache_tensors")]
    register = [c for c in _calls(init_kv) if ast.unparse(c.func) == "get_kv_transfer_group().register_kv_caches"]
    assert [c.lineno for c in tensors_call] == [4629] and [c.lineno for c in register] == [4692]
    alloc_call = [c for c in _calls(methods["initialize_kv_cache_tensors"])
                  if _is_self_call(c, ascend_hook.TARGET_METHOD)]
    assert [c.lineno for c in alloc_call] == [4760] and ast.unparse(alloc_call[0].args[0]) == "kv_cache_config"


# ----------------------------------------------------------------------------------------------------------------
# (b) pieces per layer, and vLLM 0.30's descriptors through the released allocation and the hook's budget
# ----------------------------------------------------------------------------------------------------------------

_OFFLOAD = "allocate_kv_cache_tensors_for_sparse_kv_offload"


def _loop_pieces(loop: ast.For) -> int:
    """Device pieces one iteration of ``loop`` allocates (worst path). The sparse-offload helper allocates K and V
    through ``self._allocate_int8_cache_tensor`` (sparse_kv_offload_manager.py:355 and :359): 2."""
    return _worst_path(loop.body) + 2 * sum(1 for c in _calls(loop) if ast.unparse(c.func) == _OFFLOAD)


def _allocations_in(node: ast.AST) -> int:
    return _pieces_in(node) + sum(1 for c in _calls(node) if ast.unparse(c.func) == _OFFLOAD)


def _allocating_loops(fn: ast.FunctionDef) -> dict[int, tuple[str, int]]:
    """line -> (what the loop iterates over, pieces per iteration) for each loop that allocates in its own body,
    not in a loop nested in it."""
    out = {}
    for loop in (n for n in ast.walk(fn) if isinstance(n, ast.For)):
        nested = [n for n in ast.walk(loop) if isinstance(n, ast.For) and n is not loop]
        if _allocations_in(loop) and not any(_allocations_in(n) for n in nested):
            out[loop.lineno] = (ast.unparse(loop.iter), _loop_pieces(loop))
    return out


def test_at_most_two_pieces_per_layer(release_030: Release) -> None:
    """Where 0.30.0rc2 allocates, and how much each time: per layer at most K + V (``_PIECES_PER_LAYER``); per
    descriptor one piece (DeepSeek-V4.1 :4974, GLM-Next's padded pages :5025); one backing for DeepSeek-V4 (:5093)
    and for hybrid attention/Mamba (:5133). The compressed branch (:5191, page-strided MLA specs of compress-ratio
    models: DeepSeek-V4, whose backing already placed every layer) allocates one piece per descriptor."""
    methods = _runner_methods(release_030)
    fn = methods[ascend_hook.TARGET_METHOD]
    assert _allocating_loops(fn) == {
        4974: ("kv_cache_config.kv_cache_tensors", 1),  # DeepSeek-V4.1: each descriptor's size
        5025: ("kv_cache_config.kv_cache_tensors", 1),  # GLM-Next padded pages: each descriptor's size
        5172: ("shared_layers", 1),  # single-tensor branch: num_blocks x page, per layer
        5232: ("allocation_layers", 1),  # SFA indexer K (+ its C8 scale in the same allocation)
        5286: ("allocation_layers", 2),  # sparse KV offload with keep_device_kv_cache: K + V
        5301: ("allocation_layers", 2),  # attention: K + V (MLA nope + rope), or one packed SFA main cache
    }
    assert max(p for _, p in _allocating_loops(fn).values()) <= ascend_hook._PIECES_PER_LAYER
    # Outside those loops: the DeepSeek-V4 and hybrid backings, and the compressed branch (once per descriptor:
    # guarded by "layer_name not in kv_cache_raw_tensors", it then assigns every layer of the descriptor).
    inner = {n for line in _allocating_loops(fn) for loop in ast.walk(fn) if isinstance(loop, ast.For)
             and loop.lineno == line for n in ast.walk(loop)}
    outside = sorted(c.lineno for c in _calls(fn) if c not in inner and (
        any(_is_self_call(c, h) for h in ("_allocate_int8_cache_tensor", "_allocate_sparse_c8_indexer_tensors"))
        or (ast.unparse(c.func) == "torch.zeros")))
    assert outside == [5093, 5133, 5193, 5198]
    text = release_030.lines(MODEL_RUNNER)
    assert text[5191 - 1].strip() == "elif use_compressed_cache and layer_name not in kv_cache_raw_tensors:"
    # The offload helper's two device pieces, as counted above.
    offload = _function(release_030.tree(
        "vllm_ascend/distributed/kv_transfer/sparse_kv_offload/sparse_kv_offload_manager.py"), _OFFLOAD)
    assert [c.lineno for c in _calls(offload) if ast.unparse(c.func) == "npu_kv_cache_allocate_func"] == [355, 359]
    # Per-layer sizes come from the layer's own page, not from the (shared-backing) descriptor size.
    assert [line.strip() for line in text[5179:5181]] == [
        "kv_cache_config.num_blocks", "* layer_kv_cache_spec[layer_name_inner].page_size_bytes"]
    assert text[5260 - 1].strip() == "kv_cache_config.num_blocks * current_kv_cache_spec.page_size_bytes"


# --- stand-ins for vLLM 0.30's spec classes (isinstance relations as in vllm/v1/kv_cache_interface.py) ---------


class _Spec:
    def __init__(self, **kw: Any) -> None:
        self.__dict__.update(kw)


class AttentionSpec(_Spec):
    pass


class FullAttentionSpec(AttentionSpec):
    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * (self.head_size + self.head_size_v) * self.dtype.itemsize


class MLAAttentionSpec(FullAttentionSpec):
    scale_dim, scale_dtype = 0, INT8

    @property
    def page_size_bytes(self) -> int:
        return self.block_size * self.num_kv_heads * (self.head_size * self.dtype.itemsize
                                                      + self.scale_dim * self.scale_dtype.itemsize)


class HiddenStateCacheSpec(MLAAttentionSpec):
    pass


class SlidingWindowSpec(AttentionSpec):
    page_size_bytes = FullAttentionSpec.page_size_bytes


class MambaSpec(_Spec):
    page_size_padded = None


class UniformTypeKVCacheSpecs:
    def __init__(self, kv_cache_specs: dict[str, Any]) -> None:
        self.kv_cache_specs = kv_cache_specs


class Attention(AttentionLayerBase):
    def __init__(self, contiguous_pa: bool = False) -> None:
        self.contiguous_pa = contiguous_pa  # what requires_contiguous_pa_kv_cache decides (paged attention)


def _ascend_spec_classes(release: Release, g: dict[str, Any]) -> dict[str, type]:
    """vllm-ascend's spec classes, with their released page-size / packing properties compiled in."""
    tree = release.tree(KV_INTERFACE)

    def props(cls_name: str, *names: str) -> dict[str, Any]:
        members = {n.name: n for n in _class(tree, cls_name).body if isinstance(n, ast.FunctionDef)}
        return {name: _compile_function(release, KV_INTERFACE, members[name], g) for name in names}

    mla_defaults = dict(scale_dim=0, scale_dtype=INT8, cache_sparse_sfa_c8=False, cache_sparse_sfa_turboquant=False,
                        indexes_kv_by_block_stride=False, model_version=None)
    classes = {
        "AscendMLAAttentionSpec": type("AscendMLAAttentionSpec", (MLAAttentionSpec,), {
            **mla_defaults, **props("AscendMLAAttentionSpec", "uses_packed_sfa_main_cache")}),
        "AscendSFAIndexerCacheSpec": type("AscendSFAIndexerCacheSpec", (MLAAttentionSpec,), dict(
            scale_dim=0, scale_dtype=INT8, sfa_dcp_replicated_indexer_size=1,
            **props("AscendSFAIndexerCacheSpec", "page_size_bytes", "real_page_size_bytes"))),
        "AscendSlidingWindowMLASpec": type("AscendSlidingWindowMLASpec", (SlidingWindowSpec,), dict(
            model_version=None, indexes_kv_by_block_stride=False)),
        "AscendIndexerKPoolTailSpec": type("AscendIndexerKPoolTailSpec", (SlidingWindowSpec,), {}),
    }
    g.update(classes)
    g["_fake_modules"]["vllm_ascend.core.kv_cache_interface"].AscendMLAAttentionSpec = classes["AscendMLAAttentionSpec"]
    return classes


_RUNNER_METHODS = (ascend_hook.TARGET_METHOD, "_allocate_int8_cache_tensor", "_allocate_sparse_c8_indexer_tensors",
                   "_align_memory", "_align_up", "_get_layer_kv_cache_specs", "_uses_page_strided_kv_layout",
                   "_get_attention_kv_cache_dims")


def _not_here(name: str) -> Any:
    def refuse(*args: Any, **kwargs: Any) -> Any:
        raise AssertionError(f"{name} is not exercised by these scenarios")
    return refuse


def _released_runner_module(release: Release, *, mutate_signature: bool = False) -> tuple[ModuleType, dict]:
    """``vllm_ascend.worker.model_runner_v1`` with 0.30.0rc2's ``_allocate_kv_cache_tensors`` and the helpers it
    calls, compiled from the sdist; the functions it imports from the rest of vllm-ascend are the released ones
    where they decide what is allocated (layers of a descriptor, packed SFA cache, V4.1 / padded-page detection)."""
    g = _stub_globals()
    g["_fake_modules"]["vllm.v1.kv_cache_interface"].HiddenStateCacheSpec = HiddenStateCacheSpec
    g.update(
        AttentionSpec=AttentionSpec, FullAttentionSpec=FullAttentionSpec, MambaSpec=MambaSpec,
        UniformTypeKVCacheSpecs=UniformTypeKVCacheSpecs, AttentionLayerBase=AttentionLayerBase,
        MLAAttention=MLAAttention, CacheOnlyAttentionLayer=CacheOnlyAttentionLayer,
        get_layers_from_vllm_config=lambda vllm_config, base, names=None: {
            n: layer for n, layer in vllm_config.layers.items() if names is None or n in names},
        requires_contiguous_pa_kv_cache=lambda layer, vllm_config, spec: getattr(layer, "contiguous_pa", False),
        get_layerwise_reuse_config=lambda kv_transfer_config: None,  # AscendStore's layerwise reuse only
        allocate_kvpp_cache=_not_here("allocate_kvpp_cache"), **{_OFFLOAD: _not_here(_OFFLOAD)},
    )
    _ascend_spec_classes(release, g)
    for rel, name in ((UTILS, "calc_split_factor"), (UTILS, "get_kv_cache_tensor_layers"),
                      (UTILS, "is_hidden_state_cache_spec"), (UTILS, "kv_cache_spec_uses_packed_sfa_main_cache"),
                      (KV_INTERFACE, "requires_padded_page_layout"),
                      ("vllm_ascend/models/deepseek_v41/cache_config.py", "is_deepseek_v41_cache")):
        g[name] = _compile_function(release, rel, _function(release.tree(rel), name), g)
    return _runner_module(release, g, mutate_signature, _RUNNER_METHODS), g


def _vllm030_config(groups: list[tuple[Any, list[str]]], num_blocks: int, *, block_outer: bool = False) -> Any:
    """A KVCacheConfig as vLLM 0.30 makes it (vllm/v1/core/kv_cache_utils.py get_kv_cache_config_from_groups):
    one backing of ``num_blocks x`` the largest group's bytes per block; per group and spec one descriptor of that
    size, groups overlaid from byte 0; layer-outer (LBHNC, the default) or block-outer (BLHNC) strides."""
    def spec_of(spec: Any, name: str) -> Any:
        return spec.kv_cache_specs[name] if isinstance(spec, UniformTypeKVCacheSpecs) else spec

    bytes_per_block = max(sum(spec_of(s, n).page_size_bytes for n in names) for s, names in groups)
    size = bytes_per_block * num_blocks
    tensors = []
    for spec, names in groups:
        by_spec: dict[int, tuple[Any, list[str]]] = {}
        for name in names:
            by_spec.setdefault(id(spec_of(spec, name)), (spec_of(spec, name), []))[1].append(name)
        byte_offset = 0
        for layer_spec, layer_names in by_spec.values():
            page = layer_spec.page_size_bytes
            if block_outer:
                layer_stride, block_stride, offset = page, bytes_per_block, byte_offset
            else:
                layer_stride, block_stride, offset = page * num_blocks, page, byte_offset * num_blocks
            tensors.append(SimpleNamespace(size=size, layers=layer_names, layer_stride=layer_stride,
                                           block_stride=block_stride, offset=offset))
            byte_offset += len(layer_names) * page
    return SimpleNamespace(num_blocks=num_blocks, kv_cache_tensors=tensors,
                           kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=n) for s, n in groups])


def _attn(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _scenarios(g: dict[str, Any]) -> dict[str, tuple[Any, dict[str, Any], int]]:
    """name -> (kv_cache_config, runner attributes, device pieces the released code allocates); ``g`` holds the
    spec classes _released_runner_module compiled."""
    ascend_mla, indexer = g["AscendMLAAttentionSpec"], g["AscendSFAIndexerCacheSpec"]
    gqa = FullAttentionSpec(block_size=128, num_kv_heads=2, head_size=128, head_size_v=128, dtype=BF16)
    swa = SlidingWindowSpec(block_size=128, num_kv_heads=2, head_size=128, head_size_v=128, dtype=BF16,
                            sliding_window=1024)
    mla = ascend_mla(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16)
    mla_c8 = ascend_mla(block_size=128, num_kv_heads=1, head_size=656, dtype=INT8, cache_sparse_sfa_c8=True)
    idx = indexer(block_size=128, num_kv_heads=1, head_size=128, dtype=BF16)
    idx_c8 = indexer(block_size=128, num_kv_heads=1, head_size=128, dtype=INT8, scale_dim=1, scale_dtype=FP32)
    dense = {_attn(i): Attention() for i in range(6)}
    base = dict(use_sparse=False, use_compress=False, layers=dense)

    def uniform(*parts: tuple[Any, list[str]]) -> tuple[Any, list[str]]:
        return UniformTypeKVCacheSpecs({n: s for s, names in parts for n in names}), [n for _, ns in parts for n in ns]

    mla_names = [_attn(i) for i in range(4)]
    idx_names = [f"model.layers.{i}.self_attn.indexer.k_cache" for i in range(4)]
    mla_layers = {n: MLAAttention(512, 64) for n in mla_names}
    # Hybrid (Qwen3.5-like): 2 full-attention layers, 6 linear-attention (Mamba) layers padded to the same page.
    mamba = MambaSpec(page_size_bytes=gqa.page_size_bytes)
    linear = [f"model.layers.{i}.linear_attn" for i in range(6)]
    hybrid = [(gqa, [_attn(6), _attn(7)]), (mamba, linear[0:2]), (mamba, linear[2:4]), (mamba, linear[4:6])]
    hybrid_layers = {_attn(6): Attention(), _attn(7): Attention()}
    dsv4 = ascend_mla(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, model_version="deepseek_v4")
    v41 = ascend_mla(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, model_version="deepseek_v41")
    v41_page = v41.page_size_bytes
    # DeepSeek-V4.1: vllm-ascend's own planner, two layers aliasing each allocation.
    v41_cfg = SimpleNamespace(
        num_blocks=501, kv_cache_groups=[SimpleNamespace(kv_cache_spec=v41, layer_names=mla_names)],
        kv_cache_tensors=[SimpleNamespace(size=v41_page * 501, layers=mla_names[i:i + 2], layer_stride=0,
                                          block_stride=v41_page, offset=0) for i in (0, 2)])
    # GLM-Next: MLA (block-stride indexed) and Mamba state share each physical slot (vllm-ascend's own planner).
    glm_mla = ascend_mla(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, indexes_kv_by_block_stride=True)
    glm_state = MambaSpec(page_size_bytes=glm_mla.page_size_bytes, page_size_padded=glm_mla.page_size_bytes)
    glm_mamba = [f"model.layers.{i}.mixer" for i in range(4)]
    glm_cfg = SimpleNamespace(
        num_blocks=333, kv_cache_groups=[SimpleNamespace(kv_cache_spec=glm_mla, layer_names=mla_names),
                                         SimpleNamespace(kv_cache_spec=glm_state, layer_names=glm_mamba)],
        kv_cache_tensors=[SimpleNamespace(size=glm_mla.page_size_bytes * 333, layers=[m, s], layer_stride=0,
                                          block_stride=glm_mla.page_size_bytes, offset=0)
                          for m, s in zip(mla_names, glm_mamba)])
    return {
        # Odd block counts: no piece is a 2 MiB multiple, so every pad is really used.
        "dense-gqa": (_vllm030_config([(gqa, list(dense))], 1001), base, 6),  # page-strided K/V: one per layer
        "dense-gqa-paged-attention": (_vllm030_config([(gqa, list(dense))], 1001),
                                      {**base, "layers": {n: Attention(contiguous_pa=True) for n in dense}}, 12),
        "mla": (_vllm030_config([(mla, mla_names)], 3001), {**base, "layers": mla_layers}, 8),
        "sparse-dsa": (_vllm030_config([uniform((mla, mla_names), (idx, idx_names))], 1777),
                       {**base, "use_sparse": True, "layers": mla_layers}, 12),
        "sparse-dsa-c8": (_vllm030_config([uniform((mla_c8, mla_names), (idx_c8, idx_names))], 1777),
                          {**base, "use_sparse": True, "layers": mla_layers}, 8),
        "sliding-and-full": (_vllm030_config([(gqa, [_attn(i) for i in range(3)]),
                                              (swa, [_attn(i) for i in range(3, 6)])], 1001), base, 9),
        "hybrid-mamba": (_vllm030_config(hybrid, 1001), {**base, "layers": hybrid_layers}, 1),  # one backing
        "hybrid-mamba-block-outer": (_vllm030_config(hybrid, 1001, block_outer=True),
                                     {**base, "layers": hybrid_layers, "layout_compact": False}, 8),  # per layer
        "deepseek-v4": (_vllm030_config([(dsv4, mla_names)], 777), {**base, "use_compress": True}, 1),
        "deepseek-v4.1": (v41_cfg, {**base, "layers": mla_layers}, 2),
        "glm-next-padded-pages": (glm_cfg, {**base, "layers": mla_layers}, 4),
    }


def _runner(module: ModuleType, npu: FakeNpu, cfg: Any, attrs: dict[str, Any]) -> Any:
    runner = module.NPUModelRunner()
    layers = attrs.get("layers", {})
    groups = [SimpleNamespace(backend=SimpleNamespace(is_sparse=lambda: False), layer_names=list(layers))]
    compact = attrs.get("layout_compact", True)  # LBHNC (vLLM's default) or BLHNC
    layout = SimpleNamespace(is_layer_compact=compact, is_block_compact=compact)
    runner.__dict__.update(
        # kv_transfer_config set: a KV connector is configured, as whenever MooncakeP2PConnector runs.
        vllm_config=SimpleNamespace(kv_transfer_config=SimpleNamespace(kv_connector="MooncakeP2PConnector"),
                                    quant_config=None, layers=layers,
                                    cache_config=SimpleNamespace(get_resolved_kv_cache_layout=lambda: layout)),
        device=npu, use_dcp=False, sparse_kv_offload_enabled=False, runner_only_attn_layers=set(), tp_rank=0,
        ascend_config=SimpleNamespace(kvpp_config=SimpleNamespace(size=1),
                                      xlite_graph_config=SimpleNamespace(enabled=False)),
        model_config=SimpleNamespace(hf_text_config=SimpleNamespace(model_type="test")),
        _kv_cache_spec_attn_group_iterator=lambda: iter(groups),
        **{k: v for k, v in attrs.items() if k not in ("layers", "layout_compact")},
    )
    return runner


def _allocate(module: ModuleType, cfg: Any, attrs: dict[str, Any], activate: Any) -> tuple:
    """Run ``module``'s (released, compiled) allocation through the real hook with an active connector group."""
    assert ascend_hook.patch_module(module) is True
    npu = FakeNpu()
    group = _Group(npu)
    activate(group)
    raw = _runner(module, npu, cfg, attrs)._allocate_kv_cache_tensors(cfg)
    return raw, npu, group


SCENARIOS = ["dense-gqa", "dense-gqa-paged-attention", "mla", "sparse-dsa", "sparse-dsa-c8", "sliding-and-full",
             "hybrid-mamba", "hybrid-mamba-block-outer", "deepseek-v4", "deepseek-v4.1", "glm-next-padded-pages"]


def test_patch_module_wraps_the_released_method_and_rejects_a_changed_signature(release_030: Release) -> None:
    module, _ = _released_runner_module(release_030)
    original = module.NPUModelRunner._allocate_kv_cache_tensors
    assert original.__code__.co_filename == MODEL_RUNNER and original.__code__.co_firstlineno == 4946
    assert ascend_hook.patch_module(module) is True
    wrapped = module.NPUModelRunner._allocate_kv_cache_tensors
    assert getattr(wrapped, "__kvp2p_arena_wrapped__", False) and wrapped.__wrapped__ is original
    changed, _ = _released_runner_module(release_030, mutate_signature=True)
    before = changed.NPUModelRunner._allocate_kv_cache_tensors
    assert ascend_hook.patch_module(changed) is False and changed.NPUModelRunner._allocate_kv_cache_tensors is before


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_released_allocation_fits_the_arena_ascend_arena_size_reserves(
        release_030: Release, active_connector: Any, scenario: str) -> None:
    """vLLM 0.30 descriptors through 0.30.0rc2's released allocation and the real hook: one arena of
    ``ascend_arena_size``, every piece inside it (FakeNpu raises MemoryError when it is short), each realigned to
    2 MiB, and not much more reserved than used (the budget must also not ask for memory the worker never
    budgeted: 2 MiB per layer at most, plus 4 MiB)."""
    module, g = _released_runner_module(release_030)
    cfg, attrs, pieces = _scenarios(g)[scenario]
    raw, npu, group = _allocate(module, cfg, attrs, active_connector)
    budget = ascend_hook.ascend_arena_size(cfg)
    assert group.sizes == [budget]
    assert len(npu.requests) == pieces and all(inside for _, inside in npu.requests), npu.requests
    arena = npu.last_arena
    assert arena.used <= arena.size == budget
    layers = {n for t in cfg.kv_cache_tensors for n in t.layers}
    assert arena.size - arena.used <= 2 * MIB * (len(layers) + 2), (arena.size, arena.used)
    assert all(n - ascend_hook._ALIGN > 0 for n, _ in npu.requests)  # each padded by the 2 MiB
    views = [t for v in raw.values() for t in (v if isinstance(v, tuple) else (v,)) if t is not None]
    assert set(raw) == layers
    for alloc_id in {t.alloc_id for t in views}:
        assert min(t.data_ptr() for t in views if t.alloc_id == alloc_id) % (2 * MIB) == 0


@pytest.mark.parametrize("scenario", ["mla", "sliding-and-full", "hybrid-mamba"])
def test_the_0_23_budget_does_not_fit_vllm_0_30_descriptors(
        release_030: Release, active_connector: Any, monkeypatch: pytest.MonkeyPatch, scenario: str) -> None:
    """The break: budgeted the 0.23 way (each KVCacheTensor's size + 3 pads), vLLM 0.30's descriptors leave the
    released allocation short (4 MLA layers in one descriptor need 8 pads; two groups of 3 layers need 9) or
    reserve several times what it uses (a hybrid model's 4 overlaid descriptors, each sized as the whole backing,
    for the one backing vllm-ascend allocates)."""
    module, g = _released_runner_module(release_030)
    cfg, attrs, _ = _scenarios(g)[scenario]
    old = -(-(sum(ascend_hook._tensor_budget(t) for t in cfg.kv_cache_tensors) + 2 * MIB) // (2 * MIB)) * 2 * MIB
    monkeypatch.setattr(ascend_hook, "ascend_arena_size", lambda _cfg: old)
    if scenario == "hybrid-mamba":
        _, npu, _ = _allocate(module, cfg, attrs, active_connector)
        assert npu.last_arena.size > 3.9 * npu.last_arena.used
    else:
        with pytest.raises(MemoryError, match="arena of .* full"):
            _allocate(module, cfg, attrs, active_connector)


def test_without_a_connector_group_the_released_code_allocates_as_usual(release_030: Release,
                                                                       active_connector: Any) -> None:
    module, g = _released_runner_module(release_030)
    cfg, attrs, pieces = _scenarios(g)["mla"]
    assert ascend_hook.patch_module(module) is True
    npu = FakeNpu()
    _runner(module, npu, cfg, attrs)._allocate_kv_cache_tensors(cfg)
    assert len(npu.requests) == pieces and not any(inside for _, inside in npu.requests)


# ----------------------------------------------------------------------------------------------------------------
# kv_cache_allocation_context: CaMemAllocator's sleep-mode pool around the allocation, hence around the arena
# ----------------------------------------------------------------------------------------------------------------


class SleepModeNpu(FakeNpu):
    """FakeNpu with CaMemAllocator's pool as well. Both are torch-npu MemPools entered with ``use_mem_pool``
    (camem.py:109; vllm_kvp2p/platform/npu_arena.py), so when the sleep pool is entered around the arena scope,
    torch-npu's nesting decides where a piece goes: the innermost pool (PyTorch since pytorch#168382) or the first
    one entered (PyTorch before it)."""

    def __init__(self, innermost_wins: bool) -> None:
        super().__init__()
        self.innermost_wins, self.pools, self.events, self.sleep_pool = innermost_wins, [], [], []

    @contextmanager
    def use_memory_pool(self, tag: str) -> Iterator[None]:  # CaMemAllocator.use_memory_pool(tag=...)
        self.pools.append(f"camem:{tag}")
        self.events.append(f"enter camem:{tag}")
        try:
            yield
        finally:
            self.pools.pop()
            self.events.append(f"exit camem:{tag}")

    @contextmanager
    def arena_scope(self, size: int) -> Iterator[SimpleNamespace]:
        self.pools.append("arena")
        self.events.append("enter arena")
        try:
            with super().arena_scope(size) as arena:
                yield arena
        finally:
            self.pools.pop()
            self.events.append("exit arena")

    def alloc(self, nbytes: int) -> int:
        pool = (self.pools[-1] if self.innermost_wins else self.pools[0]) if self.pools else None
        self.events.append(f"alloc in {pool}")
        if pool is None or pool == "arena":
            return super().alloc(nbytes)
        self.sleep_pool.append(nbytes)  # CaMemAllocator's: discarded by sleep(), unmapped until wake_up()
        self.requests.append((nbytes, False))
        granule = -(-nbytes // NPU_PIECE_ALIGN) * NPU_PIECE_ALIGN
        ptr, self.heap_next = self.heap_next, self.heap_next + granule
        return ptr


def _released_allocation_with_context(release: Release) -> Any:
    """The two statements of 0.30.0rc2's ``initialize_kv_cache_tensors`` that allocate (model_runner_v1.py:4758-4760),
    compiled from the release: ``with (kv_cache_allocation_context or nullcontext()): self._allocate_...``."""
    fn = _runner_methods(release)["initialize_kv_cache_tensors"]
    assign = [s for s in fn.body if isinstance(s, ast.Assign)
              and ast.unparse(s.value) == "kv_cache_allocation_context or nullcontext()"]
    with_ = [s for s in fn.body
             if isinstance(s, ast.With) and ast.unparse(s.items[0].context_expr) == "allocation_context"]
    assert [s.lineno for s in assign] == [4758] and [s.lineno for s in with_] == [4759]
    assert [ast.unparse(s) for s in with_[0].body] == [
        "kv_cache_raw_tensors = self._allocate_kv_cache_tensors(kv_cache_config)"]  # reshape and bind stay outside
    node = ast.parse("def allocate(self, kv_cache_config, kv_cache_allocation_context):\n"
                     "    return kv_cache_raw_tensors\n").body[0]
    assert isinstance(node, ast.FunctionDef)
    node.body[:0] = [copy.deepcopy(assign[0]), copy.deepcopy(with_[0])]
    return _compile_function(release, MODEL_RUNNER, node, {"nullcontext": nullcontext})


def _worker_pool_context(release: Release, sleep_mode: bool, npu: SleepModeNpu) -> Any:
    """The released ``NPUWorker._maybe_get_memory_pool_context(tag="kv_cache")`` (worker.py:1171), with
    CaMemAllocator standing in by ``npu``."""
    fn = _method(_class(release.tree(WORKER), "NPUWorker"), "_maybe_get_memory_pool_context")
    assert fn.lineno == 1171
    camem = SimpleNamespace(get_instance=lambda: npu)
    pick = _compile_function(release, WORKER, fn, {"CaMemAllocator": camem, "nullcontext": nullcontext})
    worker = SimpleNamespace(vllm_config=SimpleNamespace(model_config=SimpleNamespace(enable_sleep_mode=sleep_mode)))
    return pick(worker, tag="kv_cache")


def test_the_allocation_context_is_the_sleep_mode_pool_around_the_hooks_arena(
        release_030: Release, active_connector: Any) -> None:
    """``kv_cache_allocation_context`` (new in 0.30.0rc2, as in vLLM 0.30's GPU worker) is what
    ``NPUWorker._maybe_get_memory_pool_context(tag="kv_cache")`` returns (worker.py:1171, passed at :1200):
    CaMemAllocator's ``use_memory_pool(tag="kv_cache")`` with ``enable_sleep_mode``, else ``nullcontext()``. The
    runner enters it around ``_allocate_kv_cache_tensors`` alone (model_runner_v1.py:4758-4760), so around the
    hook's arena scope.

    By default (no sleep mode) nothing changes: every piece lands in the arena. With sleep mode the KV cache is in
    ONE of the two pools, which torch-npu's nested ``use_mem_pool`` decides (not checkable here): innermost first,
    it is all in the arena and CaMemAllocator never sees it, so sleep() frees none of the KV cache (it stays
    registered and resident); first-entered first, none of it is in the arena, the connector registers the
    tensors one by one (region limit checked) and sleep() would unmap memory registered with the transfer engine.
    0.23.0.post1 entered the same pool around the whole of initialize_kv_cache (worker.py:910-918): the nesting is
    not new, only narrower."""
    release = release_030
    allocate = _released_allocation_with_context(release)
    module, g = _released_runner_module(release)
    cfg, attrs, pieces = _scenarios(g)["mla"]
    assert ascend_hook.patch_module(module) is True

    def run(sleep_mode: bool, innermost_wins: bool) -> SleepModeNpu:
        npu = SleepModeNpu(innermost_wins)
        active_connector(_Group(npu))
        context = _worker_pool_context(release, sleep_mode, npu)
        assert isinstance(context, nullcontext) == (not sleep_mode)
        allocate(_runner(module, npu, cfg, attrs), cfg, context)
        return npu

    for innermost_wins in (True, False):  # by default the nesting question does not arise
        npu = run(sleep_mode=False, innermost_wins=innermost_wins)
        assert npu.events == ["enter arena", *["alloc in arena"] * pieces, "exit arena"]
        assert npu.sleep_pool == [] and len(npu.requests) == pieces and all(inside for _, inside in npu.requests)

    npu = run(sleep_mode=True, innermost_wins=True)
    assert npu.events == ["enter camem:kv_cache", "enter arena", *["alloc in arena"] * pieces, "exit arena",
                          "exit camem:kv_cache"]
    assert npu.sleep_pool == [] and all(inside for _, inside in npu.requests)  # CaMemAllocator holds no KV cache
    npu = run(sleep_mode=True, innermost_wins=False)
    assert len(npu.sleep_pool) == pieces and not any(inside for _, inside in npu.requests)  # the arena holds none
    assert npu.last_arena.used == 0

    # Both are torch-npu MemPools selected with use_mem_pool, and sleep() discards the "kv_cache" tag at both
    # levels (only "weights" is ever offloaded).
    pool_fn = _function(release.tree(CAMEM), "use_memory_pool_with_allocator")
    assert [ast.unparse(w.items[0].context_expr) for w in ast.walk(pool_fn) if isinstance(w, ast.With)] == [
        "torch.npu.memory.use_mem_pool(mem_pool)"]
    arena_py = (Path(__file__).resolve().parents[2] / "vllm_kvp2p/platform/npu_arena.py").read_text()
    assert "with torch.npu.use_mem_pool(self._pool):" in arena_py
    sleep = _method(_class(release.tree(WORKER), "NPUWorker"), "sleep")
    assert [ast.unparse(c) for c in _calls(sleep) if ast.unparse(c.func) == "allocator.sleep"] == [
        "allocator.sleep(offload_tags=('weights',) if level == 1 else tuple())"]
    # 0.23.0.post1: the same pool around the whole initialize_kv_cache (so around the hook too).
    old = load_release(V023).lines(WORKER)
    assert [line.strip() for line in old[908:918]] == [
        "ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)",
        "if self.vllm_config.model_config.enable_sleep_mode:", "allocator = CaMemAllocator.get_instance()",
        'context = allocator.use_memory_pool(tag="kv_cache")', "else:", "from contextlib import nullcontext", "",
        "context = nullcontext()  # type: ignore", "with context:",
        "self.model_runner.initialize_kv_cache(kv_cache_config)"]


# ----------------------------------------------------------------------------------------------------------------
# what else 0.30.0rc2 says: its compatibility matrix, and the KV layout its attention backend declares
# ----------------------------------------------------------------------------------------------------------------


def _matrix(release: Release) -> dict[str, dict[str, str]]:
    lines = release.lines("docs/source/community/versioning_policy.md")
    header_i = next(i for i, line in enumerate(lines) if line.startswith("| vLLM Ascend |"))
    header = [c.strip() for c in lines[header_i].strip("|").split("|")]
    rows = {}
    for line in lines[header_i + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        rows[cells[0]] = dict(zip(header, cells))
    return rows


def test_compatibility_matrix_and_what_the_ascend_extra_would_pin(release_030: Release) -> None:
    """0.30.0rc2's own matrix has no row for it, only for 0.30.0rc1 -- which it repeats in code (its release notes:
    no code change, a Dockerfile fix). Pairing: vLLM 0.30.0, CANN 9.2.0, torch 2.10.0 / torch-npu 2.10.0.post4,
    Mooncake 0.3.11.post1: of pyproject's [ascend] pins only vllm-ascend's would change."""
    release = release_030
    rows = _matrix(release)
    assert "v0.30.0rc2" not in rows
    assert rows["v0.30.0rc1"] == {
        "vLLM Ascend": "v0.30.0rc1", "vLLM": "v0.30.0", "Python": ">= 3.10, < 3.13", "Stable CANN": "9.2.0",
        "PyTorch/torch_npu": "2.10.0 / 2.10.0.post4", "Triton Ascend": "3.2.2", "Mooncake": "v0.3.11.post1"}
    notes = release.text("docs/source/user_guide/release_notes.md")
    assert "## v0.30.0rc2 - 2026.10.13\n\nThere is no code change in this release." in notes
    docker = release.text("Dockerfile")
    for arg in ("ARG VLLM_TAG=v0.30.0", 'ARG CANN_VERSION="9.2.0_20260930220649"', "ARG MOONCAKE_TAG=0.3.11.post1"):
        assert re.search(rf"^{re.escape(arg)}$", docker, re.M), arg
    pins = _requires_dist(release)
    assert {k: pins[k] for k in ("torch", "torch-npu", "triton-ascend")} == \
        {"torch": "2.10.0", "torch-npu": "2.10.0.post4", "triton-ascend": "3.2.2"}
    row = rows["v0.30.0rc1"]
    torch_pin, npu_pin = (v.strip() for v in row["PyTorch/torch_npu"].split("/"))
    wanted = {"vllm-ascend": release.version, "torch-npu": npu_pin, "torch": torch_pin,
              "mooncake-transfer-engine-npu": row["Mooncake"].lstrip("v")}
    import tomllib  # Python >= 3.11, like the 0.23 module's check

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extra = dict(re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", r.strip()).groups()  # type: ignore[union-attr]
                 for r in pyproject["project"]["optional-dependencies"]["ascend"])
    unchanged = [k for k in wanted if k != "vllm-ascend"]
    assert {k: wanted[k] for k in unchanged} == {k: extra[k] for k in unchanged}
    assert wanted == {"vllm-ascend": "0.30.0rc2", "torch-npu": "2.10.0.post4", "torch": "2.10.0",
                      "mooncake-transfer-engine-npu": "0.3.11.post1"}


def test_attention_kv_layout_follows_vllm_kv_cache_layout(release_030: Release) -> None:
    """New in 0.30.0rc2 (attention_v1.py:109): the attention backend's shape follows VLLM_KV_CACHE_LAYOUT. Unset
    (vLLM's default) it is token-major, what platform/npu.py declares; LBHNC or HND make it head-major."""
    assert _method(_class(release_030.tree("vllm_ascend/attention/attention_v1.py"), "AscendAttentionBackend"),
                   "get_kv_cache_shape").lineno == 109
    for layout in (None, "NHD", "LBNHC"):
        assert _shape_function(release_030, "vllm_ascend/attention/attention_v1.py", "AscendAttentionBackend",
                               layout)(100, 128, 8, 128) == (2, 100, 128, 8, 128)
    for layout in ("LBHNC", "HND"):
        assert _shape_function(release_030, "vllm_ascend/attention/attention_v1.py", "AscendAttentionBackend",
                               layout)(100, 128, 8, 128) == (2, 100, 8, 128, 128)
