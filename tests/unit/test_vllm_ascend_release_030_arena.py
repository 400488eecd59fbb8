"""vllm-ascend 0.30.0rc2's released allocation on vLLM 0.30's descriptors (tests/unit/vllm_ascend_030_fakes.py) run
through the hook's real ``patch_module``: every scenario fits the arena ``ascend_arena_size`` reserves, without
waste beyond the pads; the 0.23 budget does not (the break 0.30.0rc2 brought); no connector, no arena."""

from __future__ import annotations

from typing import Any

import pytest

from tests.unit.vllm_ascend_030_fakes import SCENARIOS, _allocate, _released_runner_module, _runner, _scenarios
from tests.unit.vllm_ascend_fakes import FakeNpu
from tests.unit.vllm_ascend_sdist import MIB, MODEL_RUNNER, Release
from vllm_kvp2p.platform import ascend_hook


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
