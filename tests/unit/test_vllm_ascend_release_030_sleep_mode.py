"""``kv_cache_allocation_context`` (new in vllm-ascend 0.30.0rc2): CaMemAllocator's sleep-mode pool entered around
the released allocation, hence around the hook's arena; what that means for where the KV cache lands, run from the
released statements with a stand-in NPU that has both pools."""

from __future__ import annotations

import ast
import copy
from collections.abc import Iterator
from contextlib import contextmanager, nullcontext
from pathlib import Path
from types import SimpleNamespace
from typing import Any

from tests.unit.vllm_ascend_030_fakes import _released_runner_module, _runner, _scenarios
from tests.unit.vllm_ascend_ast import _calls, _class, _function, _method, _runner_methods
from tests.unit.vllm_ascend_fakes import FakeNpu, _compile_function, _Group
from tests.unit.vllm_ascend_sdist import MODEL_RUNNER, NPU_PIECE_ALIGN, V023, WORKER, Release, load_release
from vllm_kvp2p.platform import ascend_hook

CAMEM = "vllm_ascend/device_allocator/camem.py"

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
