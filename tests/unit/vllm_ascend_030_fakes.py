"""vllm-ascend 0.30.0rc2's allocation run off an NPU on vLLM 0.30's descriptors: stand-ins for vLLM 0.30's spec
classes, the released runner module (``_allocate_kv_cache_tensors`` and what it calls, compiled from the sdist),
KVCacheConfigs as vLLM 0.30 makes them, and the scenarios test_vllm_ascend_release_030_arena.py and
test_vllm_ascend_release_030_sleep_mode.py run through the hook."""

from __future__ import annotations

import ast
from types import ModuleType, SimpleNamespace
from typing import Any

from tests.unit.vllm_ascend_ast import _class, _function
from tests.unit.vllm_ascend_fakes import (
    BF16,
    FP32,
    INT8,
    AttentionLayerBase,
    CacheOnlyAttentionLayer,
    FakeNpu,
    MLAAttention,
    _compile_function,
    _Group,
    _runner_module,
    _stub_globals,
)
from tests.unit.vllm_ascend_sdist import KV_INTERFACE, UTILS, Release
from vllm_kvp2p.platform import ascend_hook

_OFFLOAD = "allocate_kv_cache_tensors_for_sparse_kv_offload"


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
