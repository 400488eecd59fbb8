"""vllm-ascend 0.23.0.post1's released allocation (``NPUModelRunner._allocate_kv_cache_tensors`` and its helpers,
compiled from the sdist: tests/unit/vllm_ascend_fakes.py) run through the hook's real ``patch_module``: every piece
inside one arena sized by ``ascend_arena_size``, each padded and realigned as the release does; the budget shown to
be needed (without the pads, or without the doubled mixed tensor, the released code overflows the arena)."""

from __future__ import annotations

import inspect
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest

from tests.unit.vllm_ascend_fakes import (
    BF16,
    FP32,
    AttentionSpec,
    FakeNpu,
    FakeTensor,
    HiddenStateCacheSpec,
    MambaSpec,
    MLAAttention,
    _Group,
    _released_runner_module,
)
from tests.unit.vllm_ascend_sdist import MIB, MODEL_RUNNER, Release
from vllm_kvp2p.platform import ascend_hook


def test_patch_module_wraps_the_released_method_and_rejects_a_changed_signature(release_023: Release) -> None:
    release = release_023
    module, _ = _released_runner_module(release)
    original = module.NPUModelRunner._allocate_kv_cache_tensors
    assert original.__code__.co_filename == MODEL_RUNNER and original.__code__.co_firstlineno == 4082
    assert tuple(inspect.signature(original).parameters) == ascend_hook.EXPECTED_PARAMS
    assert ascend_hook.patch_module(module) is True
    wrapped = module.NPUModelRunner._allocate_kv_cache_tensors
    assert getattr(wrapped, "__kvp2p_arena_wrapped__", False) and wrapped.__wrapped__ is original
    assert ascend_hook.patch_module(module) is True and module.NPUModelRunner._allocate_kv_cache_tensors is wrapped

    changed, _ = _released_runner_module(release, mutate_signature=True)
    before = changed.NPUModelRunner._allocate_kv_cache_tensors
    assert ascend_hook.patch_module(changed) is False  # the signature guard rejects it ...
    assert changed.NPUModelRunner._allocate_kv_cache_tensors is before  # ... and leaves the class alone
    assert not hasattr(before, "__kvp2p_arena_wrapped__")


def _layer(i: int) -> str:
    return f"model.layers.{i}.self_attn.attn"


def _scenarios(spec_cls: type) -> dict[str, tuple[SimpleNamespace, dict[str, Any], int]]:
    """name -> (kv_cache_config, runner attributes, pieces expected per KVCacheTensor)."""
    gqa = AttentionSpec(block_size=128, num_kv_heads=2, head_size=128, head_size_v=128, dtype=BF16)
    gqa_page = 128 * 2 * (128 + 128) * 2
    mla = spec_cls(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16)
    dsa = spec_cls(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, sparse_head_dim=(512, 64, 128))
    dsa_c8 = spec_cls(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, sparse_head_dim=(512, 64, 128),
                      cache_sparse_li_c8=True)
    mamba = MambaSpec(block_size=128)

    def cfg(spec: Any, page: int, blocks: int, layout: list[list[str]], groups: list | None = None) -> Any:
        tensors = [SimpleNamespace(size=page * blocks, shared_by=names) for names in layout]
        groups = groups or [SimpleNamespace(kv_cache_spec=spec, layer_names=[n for names in layout for n in names])]
        return SimpleNamespace(kv_cache_tensors=tensors, kv_cache_groups=groups, num_blocks=blocks)

    attn = dict(use_sparse=False, use_compress=False, runner_only_attn_layers=set())
    mla_layers = {_layer(i): MLAAttention(512, 64) for i in range(6)}
    hybrid_groups = [SimpleNamespace(kv_cache_spec=mamba, layer_names=["model.layers.0.linear_attn"]),
                     SimpleNamespace(kv_cache_spec=gqa, layer_names=[_layer(1)])]
    return {
        # Odd block counts: K and V are not 2 MiB multiples, so every pad is really used.
        "dense-gqa": (cfg(gqa, gqa_page, 1001, [[_layer(i)] for i in range(4)] + [[_layer(4), _layer(5)]]),
                      attn, 2),
        "mla": (cfg(mla, mla.page_size_bytes, 3001, [[_layer(i)] for i in range(6)]),
                {**attn, "layers": mla_layers}, 2),
        "sparse-dsa": (cfg(dsa, 128 * (512 + 64 + 128) * 2, 1777, [[_layer(i)] for i in range(3)]),
                       {**attn, "use_sparse": True}, 3),
        "sparse-dsa-li-c8": (cfg(dsa_c8, dsa_c8.page_size_bytes, 1777, [[_layer(i)] for i in range(3)]),
                             {**attn, "use_sparse": True}, 3),
        "mamba-hybrid": (cfg(None, gqa_page, 501, [["model.layers.0.linear_attn", _layer(1)]], hybrid_groups),
                         attn, 1),
    }


def _allocate_with_hook(module: ModuleType, cfg: Any, attrs: dict[str, Any], activate: Any) -> tuple:
    """Run ``module``'s (released, compiled) allocation through the real hook with an active connector group."""
    assert ascend_hook.patch_module(module) is True
    npu = FakeNpu()
    group = _Group(npu)
    activate(group)
    runner = _runner(module, npu, attrs)
    raw = runner._allocate_kv_cache_tensors(cfg)
    return raw, npu, group


def _runner(module: ModuleType, npu: FakeNpu, attrs: dict[str, Any]) -> Any:
    runner = module.NPUModelRunner()
    # kv_transfer_config set: a KV connector is configured, as whenever MooncakeP2PConnector runs.
    vllm_config = SimpleNamespace(kv_transfer_config=SimpleNamespace(is_kv_consumer=False), quant_config=None,
                                  layers=attrs.get("layers", {}))
    runner.__dict__.update(vllm_config=vllm_config, device=npu, **{k: v for k, v in attrs.items() if k != "layers"})
    return runner


def _views(raw: dict, names: list[str]) -> list[FakeTensor]:
    return [t for n in names for t in (raw[n] if isinstance(raw[n], tuple) else (raw[n],)) if t is not None]


@pytest.mark.parametrize("scenario", ["dense-gqa", "mla", "sparse-dsa", "sparse-dsa-li-c8", "mamba-hybrid"])
def test_released_allocation_runs_inside_one_arena_sized_by_ascend_arena_size(
        release_023: Release, active_connector: Any, scenario: str) -> None:
    release = release_023
    module, g = _released_runner_module(release)
    cfg, attrs, pieces = _scenarios(g["AscendMLAAttentionSpec"])[scenario]
    raw, npu, group = _allocate_with_hook(module, cfg, attrs, active_connector)

    # One arena, sized by the hook's budget, and every device allocation was made inside it (FakeNpu raises
    # MemoryError if the budget is short).
    budget = ascend_hook.ascend_arena_size(cfg)
    assert group.sizes == [budget]
    assert npu.requests and all(inside for _, inside in npu.requests), npu.requests
    arena = npu.last_arena
    assert arena.used <= arena.size == budget
    # Pieces: as many as expected, none orphaned, each padded by exactly 2 MiB, together at most the tensor size.
    assert len(npu.requests) == pieces * len(cfg.kv_cache_tensors)
    all_views = _views(raw, list(raw))
    assert {t.alloc_id for t in all_views} == set(range(len(npu.requests)))
    for kv in cfg.kv_cache_tensors:
        views = _views(raw, kv.shared_by)
        ids = sorted({t.alloc_id for t in views})
        assert len(ids) == pieces <= ascend_hook._PIECES_PER_TENSOR
        piece_bytes = [npu.requests[i][0] - ascend_hook._ALIGN for i in ids]
        assert all(b > 0 for b in piece_bytes)
        # (+ at most 3 B: the C8 scale view starts at the indexer K size rounded up to the scale dtype's size)
        assert kv.size - 2 * len(ids) <= sum(piece_bytes) <= kv.size + FP32.itemsize - 1, (kv.size, piece_bytes)
        for i in ids:
            first = min(t.data_ptr() for t in views if t.alloc_id == i)
            assert first % (2 * MIB) == 0  # realigned by the released _align_memory
            assert all(arena.base <= t.data_ptr() and t.data_ptr() + t.numel() * t.element_size()
                       <= arena.base + arena.size for t in views)


def test_a_budget_without_the_pads_does_not_fit(release_023: Release, active_connector: Any,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The fit check above can fail: budgeting one pad per KVCacheTensor instead of three leaves the released
    code (two padded pieces per tensor) short of arena space."""
    module, g = _released_runner_module(release_023)
    cfg, attrs, _ = _scenarios(g["AscendMLAAttentionSpec"])["dense-gqa"]
    monkeypatch.setattr(ascend_hook, "_PIECES_PER_TENSOR", 1)
    with pytest.raises(MemoryError, match="arena of .* full"):
        _allocate_with_hook(module, cfg, attrs, active_connector)


def test_without_a_connector_group_the_released_code_allocates_as_usual(release_023: Release,
                                                                       active_connector: Any) -> None:
    """No active group (has_kv_transfer_group() false): the wrapper just calls the released method."""
    module, g = _released_runner_module(release_023)
    cfg, attrs, pieces = _scenarios(g["AscendMLAAttentionSpec"])["dense-gqa"]
    assert ascend_hook.patch_module(module) is True
    npu = FakeNpu()
    _runner(module, npu, attrs)._allocate_kv_cache_tensors(cfg)
    assert len(npu.requests) == pieces * len(cfg.kv_cache_tensors)
    assert not any(inside for _, inside in npu.requests)


@pytest.mark.parametrize("attention_first", [True, False], ids=["attention-first", "cache-only-first"])
def test_mixed_attention_and_cache_only_tensor_fits_the_budget(
    release_023: Release, active_connector: Any, attention_first: bool
) -> None:
    """vllm-ascend 0.23.0.post1 model_runner_v1.py:4280 vs :4118: when one KVCacheTensor is shared by an attention
    layer and a cache-only / hidden-state layer, the attention branch records only the 'attn' layers as done and
    the single-tensor branch allocates the whole size again (with the other layer first, once serves all).
    ascend_arena_size budgets that case twice; with
    the plain per-piece budget (what it was before) the released code overflows the arena (MemoryError)."""
    gqa = AttentionSpec(block_size=128, num_kv_heads=2, head_size=128, head_size_v=128, dtype=BF16)
    hidden = HiddenStateCacheSpec(block_size=128)
    size = 128 * 2 * 256 * 2 * 1001
    shared_by = [_layer(0), "cache_only_layers.0"] if attention_first else ["cache_only_layers.0", _layer(0)]
    cfg = SimpleNamespace(
        kv_cache_tensors=[SimpleNamespace(size=size, shared_by=shared_by)],
        kv_cache_groups=[SimpleNamespace(kv_cache_spec=gqa, layer_names=[_layer(0)]),
                         SimpleNamespace(kv_cache_spec=hidden, layer_names=["cache_only_layers.0"])])
    module, _ = _released_runner_module(release_023)
    attrs = dict(use_sparse=False, use_compress=False, runner_only_attn_layers=set())
    _, npu, group = _allocate_with_hook(module, cfg, attrs, active_connector)
    assert group.sizes == [ascend_hook.ascend_arena_size(cfg)]
    arena = npu.last_arena
    assert arena.used <= arena.size
    # Budgeted as allocated: twice when attention comes first, once (plus pads) otherwise.
    assert arena.size - arena.used <= 8 * MIB, (arena.size, arena.used)

    # The negative control: the budget without the doubling overflows the arena when attention comes first.
    plain = sum(t.size + ascend_hook._PIECES_PER_TENSOR * MIB * 2 for t in cfg.kv_cache_tensors) + 2 * MIB
    module, _ = _released_runner_module(release_023)
    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ascend_hook, "ascend_arena_size", lambda _cfg: -(-plain // (2 * MIB)) * 2 * MIB)
        if attention_first:
            with pytest.raises(MemoryError):
                _allocate_with_hook(module, cfg, attrs, active_connector)
