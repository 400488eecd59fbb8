"""``platform/ascend_hook.py`` against what vllm-ascend 0.30.0rc2 changed, read from its released source.

The checks both releases share run for 0.30.0rc2 in test_vllm_ascend_release.py (its ``release`` fixture); this
module holds the ones only 0.30.0rc2's code supports, read with the shared helpers (tests/unit/vllm_ascend_sdist.py,
vllm_ascend_ast.py). 0.30.0rc2 is 0.30.0rc1 plus a Dockerfile fix (its release notes); it runs on vLLM 0.30.0.
What changed for the hook:

* vLLM 0.30's KVCacheTensor is a descriptor (``layers``, ``layer_stride``, ``block_stride``, ``offset``; every
  descriptor's ``size`` is ONE shared backing), and ``NPUModelRunner._allocate_kv_cache_tensors`` (same name and
  signature) does not allocate that backing: it gives most layers a private buffer of ``num_blocks x page`` (K + V,
  or one page-strided buffer), 2 MiB padded each (counted here). The 0.23 budget (each KVCacheTensor's size + 3
  pads) is then both too small (2 pads per layer, not 3 per descriptor) and, with several descriptors, far too
  large: a genuine break, fixed in ``ascend_arena_size`` and run through the released code in
  test_vllm_ascend_release_030_arena.py.
* ``initialize_kv_cache`` takes ``kv_cache_allocation_context``: CaMemAllocator's sleep-mode pool when
  ``enable_sleep_mode`` is set, ``nullcontext()`` otherwise, entered around ``_allocate_kv_cache_tensors`` only --
  so around the hook's arena scope. Pinned in test_vllm_ascend_release_030_sleep_mode.py; only sleep mode is
  affected.
* The v2 model runner (allocation elsewhere, not wrapped) is opt-in: ``VLLM_USE_V2_MODEL_RUNNER=1``.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path
from types import SimpleNamespace

from tests.unit.vllm_ascend_030_fakes import _OFFLOAD
from tests.unit.vllm_ascend_ast import (
    _calls,
    _class,
    _connector_created_first,
    _function,
    _is_self_call,
    _method,
    _param_names,
    _pieces_in,
    _requires_dist,
    _runner_methods,
    _shape_function,
    _worst_path,
)
from tests.unit.vllm_ascend_fakes import _compile_function
from tests.unit.vllm_ascend_sdist import MODEL_RUNNER, WORKER, Release
from vllm_kvp2p.platform import ascend_hook

V2_RUNNER = "vllm_ascend/worker/v2/model_runner.py"

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
