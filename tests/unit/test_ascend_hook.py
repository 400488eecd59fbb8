"""The vllm-ascend path: its NPU worker never calls get_mem_pool_context, so the plugin wraps
``NPUModelRunner._allocate_kv_cache_tensors`` (vllm_kvp2p/platform/ascend_hook.py).

vllm-ascend cannot be installed here (it needs torch-npu and CANN), so each test writes a stand-in
``vllm_ascend.worker.model_runner_v1`` whose allocation does what vllm-ascend's does (K and V allocated separately,
each padded by 2 MiB and sliced to a 2 MiB boundary), but on CPU with torch; everything else is real: the plugin's
``register()``, the import hook, vLLM's kv_transfer_state and the C++ CPU arena. Each scenario runs in a fresh
interpreter because the hook changes ``sys.meta_path`` and the patched class.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path
from types import SimpleNamespace

import pytest

from vllm_kvp2p.platform.ascend_hook import ascend_arena_size

RUNNER_LIKE_VLLM_ASCEND = '''
import torch

ALIGN = 2 * 1024 * 1024

def _align(t):
    off = (-t.data_ptr()) % ALIGN
    return t[off:]

class NPUModelRunner:
    def _allocate_kv_cache_tensors(self, kv_cache_config):
        out = {}
        for kv in kv_cache_config.kv_cache_tensors:
            half = kv.size // 2
            k = _align(torch.zeros(half + ALIGN, dtype=torch.int8))[:half]
            v = _align(torch.zeros(half + ALIGN, dtype=torch.int8))[:half]
            for name in kv.shared_by:
                out[name] = (k, v)
        return out
'''

RUNNER_CHANGED_SIGNATURE = '''
class NPUModelRunner:
    def _allocate_kv_cache_tensors(self, kv_cache_config, kernel_block_sizes):
        return {}
'''

RUNNER_WITHOUT_METHOD = '''
class NPUModelRunner:
    pass
'''

SCENARIO = '''
import logging, sys
from types import SimpleNamespace
logging.basicConfig(level=logging.INFO, stream=sys.stdout, format="LOG %(levelname)s %(message)s")
import vllm_kvp2p
IMPORT_FIRST = {import_first}
if IMPORT_FIRST:
    import vllm_ascend.worker.model_runner_v1 as mr
vllm_kvp2p.register()
vllm_kvp2p.register()  # plugins load several times per process tree
assert IMPORT_FIRST or "vllm_ascend.worker.model_runner_v1" not in sys.modules, "the plugin imported vllm-ascend"
import vllm_ascend.worker.model_runner_v1 as mr
method = getattr(mr.NPUModelRunner, "_allocate_kv_cache_tensors", None)
print("WRAPPED", getattr(method, "__kvp2p_arena_wrapped__", False))
if {run}:
    from vllm.distributed.kv_transfer import kv_transfer_state
    from vllm_kvp2p.platform.arena import KvArena
    from vllm_kvp2p.platform.ascend_hook import ascend_arena_size
    from vllm_kvp2p.platform.npu import NpuPlatform
    from vllm_kvp2p.transfer.layout import TensorView
    from vllm_kvp2p.connector.worker import WorkerSide

    class Group:  # what the wrapper asks of the active connector (MooncakeP2PConnector.kvp2p_arena_context)
        arena = None
        def kvp2p_arena_context(self, size):
            self.arena = KvArena(size)
            return self.arena.scope()

    cfg = SimpleNamespace(kv_cache_tensors=[
        SimpleNamespace(size=3 * 1024 * 1024 + 4096 * i, shared_by=[f"layer.{{i}}"]) for i in range(12)])
    def regions(kv, arena=None):  # what the connector registers (WorkerSide._regions, HCCL's limit applies)
        views = [TensorView(t.data_ptr(), tuple(t.shape), tuple(t.stride()), t.element_size())
                 for pair in kv.values() for t in pair]
        return WorkerSide._regions(SimpleNamespace(arena=arena, platform=NpuPlatform()), views)[0]

    print("REGIONS_WITHOUT_CONNECTOR", len(regions(mr.NPUModelRunner()._allocate_kv_cache_tensors(cfg))))
    group = Group()
    kv_transfer_state._KV_CONNECTOR_AGENT = group
    kv = mr.NPUModelRunner()._allocate_kv_cache_tensors(cfg)
    arena = group.arena
    inside = all(arena.contains(t.data_ptr(), t.numel()) for pair in kv.values() for t in pair)
    print("ARENA", arena.size == ascend_arena_size(cfg), arena.base % (2 << 20) == 0, arena.used <= arena.size)
    print("ALL_INSIDE", inside, "REGIONS_WITH_CONNECTOR", len(regions(kv, arena)))
'''


def _run(tmp_path: Path, runner_source: str, *, import_first: bool = False, run: bool = False) -> str:
    pkg = tmp_path / "vllm_ascend"
    (pkg / "worker").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "worker" / "__init__.py").write_text("")
    (pkg / "worker" / "model_runner_v1.py").write_text(runner_source)
    script = SCENARIO.format(import_first=import_first, run=run)
    proc = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        # VLLM_CONFIGURE_LOGGING=0: vLLM 0.23 otherwise installs its own handler over the scenario's basicConfig.
        cwd=tmp_path, env={**os.environ, "PYTHONPATH": str(tmp_path), "VLLM_CONFIGURE_LOGGING": "0"},
        capture_output=True, text=True, timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


def test_wrapped_on_import_and_every_kv_tensor_comes_from_one_arena(tmp_path: Path) -> None:
    out = _run(tmp_path, RUNNER_LIKE_VLLM_ASCEND, run=True)
    assert "WRAPPED True" in out
    assert "now allocates the KV cache inside MooncakeP2PConnector's arena" in out
    # Without an active connector vllm-ascend allocates as it always did: 2 separate pieces per layer.
    assert "REGIONS_WITHOUT_CONNECTOR 24" in out
    # With it, all K and V pieces (alignment padding included) lie in one 2 MiB aligned arena, sized exactly by
    # ascend_arena_size: Mooncake registers one region.
    assert "ARENA True True True" in out
    assert "ALL_INSIDE True REGIONS_WITH_CONNECTOR 1" in out


def test_module_imported_before_the_plugin_is_patched_at_once(tmp_path: Path) -> None:
    out = _run(tmp_path, RUNNER_LIKE_VLLM_ASCEND, import_first=True, run=True)
    assert "WRAPPED True" in out
    assert "ALL_INSIDE True REGIONS_WITH_CONNECTOR 1" in out


@pytest.mark.parametrize(
    ("source", "expected"),
    [
        (RUNNER_CHANGED_SIGNATURE, "NPUModelRunner._allocate_kv_cache_tensors takes ('self', 'kv_cache_config', "
                                   "'kernel_block_sizes'), expected ('self', 'kv_cache_config')"),
        (RUNNER_WITHOUT_METHOD, "vllm_ascend.worker.model_runner_v1 has no NPUModelRunner._allocate_kv_cache_tensors"),
    ],
    ids=["changed-signature", "missing-method"],
)
def test_unknown_vllm_ascend_is_left_alone_with_one_warning(tmp_path: Path, source: str, expected: str) -> None:
    out = _run(tmp_path, source)
    assert "WRAPPED False" in out
    warnings = [line for line in out.splitlines() if line.startswith("LOG WARNING") and "vllm-ascend" in line]
    assert len(warnings) == 1 and expected in warnings[0], out
    assert "registered per tensor" in warnings[0]


def test_without_vllm_ascend_nothing_is_installed() -> None:
    from vllm_kvp2p.platform import ascend_hook

    before = list(sys.meta_path)
    assert ascend_hook.install() is False
    assert sys.meta_path == before


def test_arena_size_budgets_three_padded_pieces_per_tensor() -> None:
    mib = 1 << 20
    cfg = SimpleNamespace(kv_cache_tensors=[SimpleNamespace(size=10 * mib), SimpleNamespace(size=10 * mib + 1)])
    # 2 x (size + 3 x 2 MiB) + 2 MiB, rounded up to 2 MiB
    assert ascend_arena_size(cfg) == 10 * mib + 6 * mib + 10 * mib + 6 * mib + 2 * mib + 2 * mib
    assert ascend_arena_size(SimpleNamespace(kv_cache_tensors=[])) == 2 * mib


def test_per_tensor_fallback_over_the_hccl_limit_names_count_and_limit() -> None:
    from vllm_kvp2p.connector.worker import WorkerSide
    from vllm_kvp2p.platform.npu import NpuPlatform
    from vllm_kvp2p.transfer.layout import TensorView

    # 2 pieces per layer, 2 MiB apart with gaps (vllm-ascend's padding): 300 regions on a 61+ layer model is easy.
    views = [TensorView(0x10_0000_0000 + i * (4 << 20), (1024,), (1,), 1) for i in range(300)]
    side = SimpleNamespace(arena=None, platform=NpuPlatform())
    with pytest.raises(RuntimeError, match=r"needs 300 registered memory regions, above this platform's limit of 256"):
        WorkerSide._regions(side, views)  # type: ignore[arg-type]
    regions, how = WorkerSide._regions(side, views[:256])  # type: ignore[arg-type]
    assert len(regions) == 256 and how.startswith("per-tensor")
