"""KV arena (vllm_kvp2p.platform.arena over the C++ extension vllm_kvp2p._arena): torch CPU tensors allocated by the
calling
thread inside ``scope()`` come from one 2 MiB aligned mmap region, back to back; nothing else does.

The last test runs vLLM's own ``allocate_kv_cache`` for an 8-layer KVCacheConfig inside a scope and checks that the
whole KV cache is one span of the arena, i.e. one Mooncake registration.
"""

from __future__ import annotations

import gc
import inspect
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from vllm_kvp2p.platform import arena as arena_mod
from vllm_kvp2p.platform.arena import PIECE_ALIGN, REGION_ALIGN, KvArena, arena_size_for

pytestmark = [
    pytest.mark.timeout(300),
    pytest.mark.skipif(not arena_mod.available(), reason=f"KV arena unavailable: {arena_mod.unavailable_reason()}"),
]

torch = pytest.importorskip("torch")

MiB = 1 << 20


def _round_up(n: int, align: int) -> int:
    return -(-n // align) * align


def _span(t: torch.Tensor) -> tuple[int, int]:
    """[start, end) byte addresses a (possibly strided) tensor touches."""
    if t.numel() == 0:
        return t.data_ptr(), t.data_ptr()
    last = sum((size - 1) * stride for size, stride in zip(t.shape, t.stride()))
    return t.data_ptr(), t.data_ptr() + (last + 1) * t.element_size()


def _in(arena: KvArena, t: torch.Tensor) -> bool:
    start, end = _span(t)
    return arena.contains(start, end - start)


def _mapped(addr: int) -> bool:
    """Whether addr lies in a mapping of this process (/proc/self/maps)."""
    with open("/proc/self/maps") as f:
        for line in f:
            lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
            if lo <= addr < hi:
                return True
    return False


@pytest.fixture
def arena():
    a = KvArena(16 * MiB)
    yield a
    gc.collect()
    if not a.closed and a.live_allocations == 0:
        a.close()


# ---------------------------------------------------------------------------------------------------------------


def test_import_is_light_and_available_loads_the_extension():
    """In a fresh process: importing the module loads neither torch nor the extension; reading ``AVAILABLE`` does,
    and says the extension loaded (this module's skip asked ``available()`` in this process, not that one)."""
    code = ("import sys, vllm_kvp2p.platform.arena as arena\n"
            "def heavy(): return [m for m in ('torch', 'vllm_kvp2p._arena') if m in sys.modules]\n"
            "before = heavy(); available = arena.AVAILABLE; print(before, available, heavy())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[] True ['torch', 'vllm_kvp2p._arena']", out.stdout


def test_region_geometry(arena):
    assert arena.base % REGION_ALIGN == 0
    assert arena.size == 16 * MiB
    assert arena.used == 0 and arena.live_allocations == 0 and not arena.closed
    assert isinstance(arena.huge_pages, bool)
    assert _mapped(arena.base) and _mapped(arena.base + arena.size - 1)
    # The size is rounded up to whole 2 MiB.
    odd = KvArena(3 * MiB + 1)
    assert odd.size == 4 * MiB and odd.base % REGION_ALIGN == 0
    odd.close()
    with pytest.raises(ValueError):
        KvArena(0)


def test_huge_pages_flag():
    try:
        with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
            thp_usable = "[never]" not in f.read()
    except OSError:
        thp_usable = False  # kernel without transparent huge pages
    with_hp, without_hp = KvArena(2 * MiB), KvArena(2 * MiB, huge_pages=False)
    try:
        assert isinstance(with_hp.huge_pages, bool) and with_hp.huge_pages == thp_usable
        assert without_hp.huge_pages is False
    finally:
        with_hp.close()
        without_hp.close()


def test_tensors_in_scope_are_consecutive_in_the_arena(arena):
    sizes = [1000, 4096, 1, 3 * MiB + 7, 256]
    with arena.scope():
        tensors = [torch.empty(n, dtype=torch.uint8) for n in sizes]
        z = torch.zeros(10, 10, dtype=torch.float64)  # torch.zeros too
    expected = arena.base
    for t, n in zip(tensors, sizes):
        assert t.data_ptr() == expected, "allocations are back to back, 256-byte aligned, from the base"
        assert _in(arena, t)
        expected = _round_up(expected + n, PIECE_ALIGN)
    assert z.data_ptr() == expected and _in(arena, z)
    assert arena.live_allocations == len(sizes) + 1
    assert arena.used == z.data_ptr() + z.nbytes - arena.base


def test_outside_scope_and_other_threads_are_untouched(arena):
    before = torch.empty(1024)
    from_thread: list[torch.Tensor] = []
    started_inside: list[torch.Tensor] = []
    with arena.scope():
        inside = torch.empty(1024)
        t = threading.Thread(target=lambda: from_thread.append(torch.empty(1024)))
        t.start()
        t.join()

        # A thread running concurrently while this scope is active is not affected either.
        go = threading.Event()
        t2 = threading.Thread(target=lambda: (go.wait(10), started_inside.append(torch.empty(1024))))
        t2.start()
        go.set()
        t2.join()
    after = torch.empty(1024)
    assert _in(arena, inside)
    for other in (before, from_thread[0], started_inside[0], after):
        assert not _in(arena, other)
    assert arena.live_allocations == 1


def test_write_and_read(arena):
    with arena.scope():
        a = torch.arange(100_000, dtype=torch.float32)
        b = torch.empty(100_000, dtype=torch.float32)
    assert _in(arena, a) and _in(arena, b)
    b.copy_(a * 2)
    assert torch.equal(b, torch.arange(100_000, dtype=torch.float32) * 2)
    assert float((a + b).sum()) == pytest.approx(3 * sum(range(100_000)))
    # Ops outside the scope on arena tensors allocate their results normally.
    c = a + 1
    assert not _in(arena, c)


def test_overflow_raises_a_clear_error(arena):
    with arena.scope():
        keep = torch.empty(15 * MiB, dtype=torch.uint8)
        with pytest.raises(RuntimeError) as info:
            torch.empty(2 * MiB, dtype=torch.uint8)
        # Still usable for what fits.
        small = torch.empty(MiB, dtype=torch.uint8)
    msg = str(info.value)
    assert "KvArena overflow" in msg
    assert str(2 * MiB) in msg, "names the request"
    assert str(16 * MiB) in msg, "names the arena size"
    assert f"{15 * MiB} bytes used" in msg, "names the bytes used"
    assert _in(arena, keep) and _in(arena, small)


def test_close_refuses_while_tensors_live(arena):
    with arena.scope():
        t = torch.ones(1000)
        view = t[10:20]
    del t
    gc.collect()
    assert arena.live_allocations == 1, "a view keeps the storage alive"
    with pytest.raises(RuntimeError, match="alive"):
        arena.close()
    assert not arena.closed and float(view.sum()) == 10.0
    del view
    gc.collect()
    assert arena.live_allocations == 0
    base = arena.base
    arena.close()
    assert arena.closed and not arena.contains(base)
    arena.close()  # idempotent
    with pytest.raises(RuntimeError, match="closed"):
        with arena.scope():
            pass


def test_close_refuses_inside_its_scope(arena):
    with arena.scope():
        with pytest.raises(RuntimeError, match="active"):
            arena.close()
    arena.close()


def test_nested_scopes(arena):
    other = KvArena(4 * MiB)
    try:
        with arena.scope():
            a1 = torch.empty(100)
            with arena.scope():  # the same arena again
                a2 = torch.empty(100)
            a3 = torch.empty(100)
            with other.scope():  # another arena: the innermost wins
                o1 = torch.empty(100)
                with arena.scope():
                    a4 = torch.empty(100)
                o2 = torch.empty(100)
            a5 = torch.empty(100)
        outside = torch.empty(100)
        assert all(_in(arena, t) for t in (a1, a2, a3, a4, a5))
        assert all(_in(other, t) and not _in(arena, t) for t in (o1, o2))
        assert not _in(arena, outside) and not _in(other, outside)
        assert [t.data_ptr() for t in (a1, a2, a3, a4, a5)] == sorted(t.data_ptr() for t in (a1, a2, a3, a4, a5))
        del o1, o2
    finally:
        gc.collect()
        other.close()


def test_exception_inside_scope_deactivates(arena):
    with pytest.raises(KeyError):
        with arena.scope():
            raise KeyError("boom")
    assert not _in(arena, torch.empty(100))
    assert arena.live_allocations == 0


def test_zero_size_tensors_do_not_use_the_arena(arena):
    with arena.scope():
        e = torch.empty(0)
    assert arena.used == 0 and arena.live_allocations == 0
    assert e.numel() == 0


def test_concurrent_scopes_on_one_arena_do_not_overlap():
    a = KvArena(32 * MiB)
    results: list[list[torch.Tensor]] = [[] for _ in range(4)]
    barrier = threading.Barrier(4)

    def work(i: int) -> None:
        barrier.wait(10)
        with a.scope():
            for _ in range(50):
                results[i].append(torch.empty(4096 + i, dtype=torch.uint8))

    threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = sorted(_span(t) for ts in results for t in ts)
    assert len(spans) == 200 and all(a.contains(s, e - s) for s, e in spans)
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:])), "pieces overlap"
    assert a.live_allocations == 200
    results.clear()
    del spans
    gc.collect()
    a.close()


def test_dropping_the_arena_keeps_live_tensors_valid():
    a = KvArena(4 * MiB)
    with a.scope():
        t = torch.full((1000,), 7.0)
    base = a.base
    del a
    gc.collect()
    assert _mapped(base), "the region must outlive the handle while a tensor uses it"
    assert float(t.sum()) == 7000.0
    del t
    gc.collect()
    assert not _mapped(base), "the last tensor of an orphaned arena unmaps it"


def test_per_layer_kv_tensors_form_one_region(arena):
    # What a per-layer allocator does (older vLLM, vllm-ascend): one tensor per layer, one after the other.
    layer_bytes = MiB + 4096
    with arena.scope():
        layers = [torch.zeros(layer_bytes, dtype=torch.int8) for _ in range(8)]
    spans = [_span(t) for t in layers]
    assert spans[0][0] == arena.base
    assert all(e1 == s2 for (_, e1), (s2, _) in zip(spans, spans[1:])), "layers are contiguous"
    assert arena.contains(spans[0][0], spans[-1][1] - spans[0][0])


def test_arena_size_for_older_per_tensor_configs():
    old = SimpleNamespace(kv_cache_tensors=[SimpleNamespace(size=3 * MiB + 5, shared_by=["x"]) for _ in range(4)])
    need = arena_size_for(old)
    assert need % REGION_ALIGN == 0
    assert need >= 4 * _round_up(3 * MiB + 5, PIECE_ALIGN) + REGION_ALIGN
    assert arena_size_for(SimpleNamespace(kv_cache_tensors=[])) == REGION_ALIGN


def test_vllm_allocate_kv_cache_lands_in_one_arena_span():
    """vLLM >= 0.32: its allocate_kv_cache, run inside the scope get_mem_pool_context() returns."""
    pytest.importorskip("vllm")
    kv_cache_interface = pytest.importorskip("vllm.v1.kv_cache_interface")
    if not hasattr(kv_cache_interface, "compute_layout_strides"):
        pytest.skip("this vLLM (0.23) allocates in GPUModelRunner._allocate_kv_cache_tensors: see the next test")
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        KVCacheTensor,
        compute_layout_strides,
    )
    from vllm.v1.kv_cache_layout import KVCacheLayout
    from vllm.v1.worker.utils import allocate_kv_cache

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    num_blocks, names = 32, [f"model.layers.{i}.self_attn.attn" for i in range(8)]
    layout = KVCacheLayout.LBNHC
    layer_stride, block_stride, *_ = compute_layout_strides(spec, num_blocks, len(names), layout)
    size = len(names) * spec.page_size_bytes * num_blocks
    config = KVCacheConfig(
        num_blocks=num_blocks,
        kv_cache_tensors=[KVCacheTensor(size=size, layers=names, layer_stride=layer_stride, block_stride=block_stride)],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )

    need = arena_size_for(config)
    assert size < need <= size + 2 * REGION_ALIGN
    a = KvArena(need)
    with a.scope():  # what the connector's get_mem_pool_context() returns
        kv_caches = allocate_kv_cache(config, torch.device("cpu"), layout, [spec.block_size])
    outside = allocate_kv_cache(config, torch.device("cpu"), layout, [spec.block_size])

    assert list(kv_caches) == names
    spans = [_span(t) for t in kv_caches.values()]
    assert spans[0][0] == a.base
    for i, (start, end) in enumerate(spans):
        assert start == a.base + i * layer_stride, f"layer {i} is not where the layout puts it"
        assert a.contains(start, end - start)
    # One contiguous span from the base covers all 8 layers: a single registration.
    assert all(e1 == s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))
    assert spans[-1][1] - a.base == size
    assert all(not _in(a, t) for t in outside.values())

    # The cache is usable memory: write one block of every layer, read it back.
    for i, t in enumerate(kv_caches.values()):
        t[3].fill_(i + 1)
    assert [float(t[3].float().mean()) for t in kv_caches.values()] == [float(i + 1) for i in range(8)]
    assert a.live_allocations == 1, "vLLM 0.32 allocates one backing buffer and views it per layer"
    del kv_caches, t
    gc.collect()
    a.close()


def test_vllm_023_allocation_route_lands_in_one_arena(monkeypatch: pytest.MonkeyPatch):
    """vLLM 0.23: no get_mem_pool_context; the real GPUModelRunner._allocate_kv_cache_tensors (the CPU runner
    inherits it), wrapped by compat.install_kv_allocation_route, allocates every layer inside the connector's arena.
    Without the wrap (the original method) nothing lands in it."""
    pytest.importorskip("vllm")
    from vllm_kvp2p.connector import compat

    if compat.HAS_MEM_POOL_HOOK:
        pytest.skip("this vLLM calls get_mem_pool_context: see the previous test")
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm.v1.kv_cache_interface import FullAttentionSpec, KVCacheConfig, KVCacheGroupSpec, KVCacheTensor
    from vllm.v1.worker import gpu_model_runner

    runner_cls = gpu_model_runner.GPUModelRunner
    original = inspect.unwrap(runner_cls.__dict__["_allocate_kv_cache_tensors"])
    monkeypatch.setattr(runner_cls, "_allocate_kv_cache_tensors", original)  # restored after the test
    assert compat.install_kv_allocation_route() == "wrapped GPUModelRunner._allocate_kv_cache_tensors"
    assert compat.install_kv_allocation_route() == "wrapped GPUModelRunner._allocate_kv_cache_tensors"  # idempotent

    spec = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=64, dtype=torch.float16)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(6)]
    size = spec.page_size_bytes * 32
    config = KVCacheConfig(
        num_blocks=32,
        kv_cache_tensors=[KVCacheTensor(size=size, shared_by=[n]) for n in names],
        kv_cache_groups=[KVCacheGroupSpec(names, spec)],
    )

    class Connector:  # what the wrapper asks of the active connector (MooncakeP2PConnector.kvp2p_arena_context)
        arena: KvArena | None = None

        def kvp2p_arena_context(self, size_bytes):
            assert size_bytes is None  # sized by the connector from its own KVCacheConfig
            self.arena = KvArena(arena_size_for(config))
            return self.arena.scope()

    connector = Connector()
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    runner = SimpleNamespace(device=torch.device("cpu"), runner_only_attn_layers=set())
    kv = runner_cls._allocate_kv_cache_tensors(runner, config)
    arena = connector.arena
    assert arena is not None and list(kv) == names
    assert all(_in(arena, t) for t in kv.values())
    spans = sorted(_span(t) for t in kv.values())
    assert all(e1 <= s2 for (_, e1), (s2, _) in zip(spans, spans[1:]))  # disjoint pieces of one region

    plain = original(runner, config)  # the unwrapped method: vLLM's own allocator, outside the arena
    assert not any(_in(arena, t) for t in plain.values())


def test_vllm_029_030_allocation_function_route_lands_in_one_arena(monkeypatch: pytest.MonkeyPatch):
    """vLLM 0.29 and 0.30: no get_mem_pool_context and no runner method; the runner module calls the module
    function ``allocate_kv_cache(kv_cache_config, device, layout, ...)`` it imported by name. Wrapped where the
    runner looks it up (alloc_hook.wrap_allocation_function), what it allocates lands in the connector's arena; the
    unwrapped function's does not. Here on a runner module of the same shape (the function's body differs per
    release and is vLLM's own); the releases themselves run it end to end (scripts/check_vllm_releases.sh,
    tests/e2e/test_vllm_versions.py)."""
    pytest.importorskip("vllm")
    from types import ModuleType

    from vllm.distributed.kv_transfer import kv_transfer_state

    from vllm_kvp2p.platform.alloc_hook import is_wrapped, wrap_allocation_function

    names = [f"model.layers.{i}.self_attn.attn" for i in range(4)]
    config = SimpleNamespace(num_blocks=32, layer_bytes=64 * 1024)

    def allocate_kv_cache(kv_cache_config, device, layout, kernel_block_sizes=None):  # 0.30's signature
        buf = torch.zeros(kv_cache_config.layer_bytes * len(names), dtype=torch.int8, device=device)
        return dict(zip(names, buf.view(len(names), -1)))

    runner_module = ModuleType("vllm.v1.worker.gpu_model_runner_0_30")
    runner_module.allocate_kv_cache = allocate_kv_cache  # type: ignore[attr-defined]
    route = "wrapped gpu_model_runner_0_30.allocate_kv_cache"
    assert wrap_allocation_function(runner_module, "allocate_kv_cache") == route
    assert wrap_allocation_function(runner_module, "allocate_kv_cache") == route  # idempotent: wrapped once
    wrapped = runner_module.allocate_kv_cache
    assert is_wrapped(wrapped) and inspect.unwrap(wrapped) is allocate_kv_cache

    class Connector:  # what the wrapper asks of the active connector (MooncakeP2PConnector.kvp2p_arena_context)
        arena: KvArena | None = None

        def kvp2p_arena_context(self, size_bytes):
            assert size_bytes is None  # sized by the connector from its own KVCacheConfig
            self.arena = KvArena(4 * config.layer_bytes + REGION_ALIGN)
            return self.arena.scope()

    connector = Connector()
    monkeypatch.setattr(kv_transfer_state, "_KV_CONNECTOR_AGENT", connector)
    kv = wrapped(config, torch.device("cpu"), "NHD", kernel_block_sizes=[16])
    arena = connector.arena
    assert arena is not None and list(kv) == names
    assert all(_in(arena, t) for t in kv.values())
    plain = allocate_kv_cache(config, torch.device("cpu"), "NHD")
    assert not any(_in(arena, t) for t in plain.values())


def test_the_allocation_function_route_refuses_another_signature() -> None:
    from types import ModuleType

    from vllm_kvp2p.platform.alloc_hook import wrap_allocation_function

    module = ModuleType("vllm.v1.worker.fake_runner")

    def allocate_kv_cache(config, device):  # not the parameter name the wrapper passes on
        return {}

    module.allocate_kv_cache = allocate_kv_cache  # type: ignore[attr-defined]
    assert wrap_allocation_function(module, "allocate_kv_cache").startswith("none (fake_runner.allocate_kv_cache takes")
    assert module.allocate_kv_cache is allocate_kv_cache
    assert wrap_allocation_function(module, "missing") == "none (vllm.v1.worker.fake_runner has no missing)"
