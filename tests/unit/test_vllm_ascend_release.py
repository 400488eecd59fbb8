"""``platform/ascend_hook.py`` checked against vllm-ascend 0.23.0.post1 and 0.30.0rc2 as released, not against a
stand-in: what the hook assumes, read off each release's source (fetched and pinned by tests/unit/vllm_ascend_sdist.py,
read with tests/unit/vllm_ascend_ast.py).

The ``release`` fixture (tests/unit/conftest.py) runs the checks both releases share for each (line numbers per
release in ``AT``); those that only one release's code supports take ``release_023`` here, or live in
test_vllm_ascend_release_030.py, which also checks what 0.30.0rc2 changed. Where running the code says more than
reading it, the released allocation runs through the real hook: test_vllm_ascend_release_arena.py (0.23.0.post1),
test_vllm_ascend_release_030_arena.py and test_vllm_ascend_release_030_sleep_mode.py (0.30.0rc2); the KV layout the
NPU platform declares is test_vllm_ascend_release_layout.py's.

What the hook assumes, and where the release says so (line numbers are asserted, so a different file fails):

* (a) ``vllm_ascend.worker.model_runner_v1.NPUModelRunner._allocate_kv_cache_tensors(self, kv_cache_config)``;
* (b) it allocates every piece (K, V; MLA nope/rope; sparse indexer K [+ scale]) as ONE ``torch.zeros`` of
  ``size + alignment`` with ``alignment = 2 * 1024 * 1024`` when a KV connector is configured, at most
  ``_PIECES_PER_TENSOR`` (3) pieces per KVCacheTensor, pieces adding up to at most the tensor's size (0.23.0.post1
  on vLLM 0.23; 0.30.0rc2 on vLLM 0.30's descriptors: at most ``_PIECES_PER_LAYER`` (2) per layer of
  ``num_blocks x`` its page, or one shared backing -- test_vllm_ascend_release_030.py);
* (c) ``NPUWorker.initialize_from_config`` creates the connector (``ensure_kv_transfer_initialized``) before it
  reaches that method, so the connector's arena scope exists when allocation runs;
* (d) nothing in vllm-ascend calls ``get_mem_pool_context`` (why the hook exists at all);
* (e) the plugin is ``vllm.platform_plugins: ascend = vllm_ascend:register``; what the ``[ascend]`` extra pins.

One contradiction found this way is now budgeted for (``test_mixed_attention_and_cache_only_tensor_...`` in
test_vllm_ascend_release_arena.py), and one break of (b) by 0.30.0rc2 on vLLM 0.30
(``test_the_0_23_budget_does_not_fit_vllm_0_30_descriptors`` in test_vllm_ascend_release_030_arena.py).
"""

from __future__ import annotations

import ast
import configparser
import copy
import re
from pathlib import Path

from tests.unit.vllm_ascend_ast import (
    _PIECE_HELPERS,
    _calls,
    _class,
    _connector_created_first,
    _const_int,
    _elif_chain,
    _function,
    _is_self_call,
    _method,
    _on_device,
    _only_without_connector,
    _param_names,
    _parents,
    _pieces_in,
    _requires_dist,
    _runner_methods,
    _torch_allocations,
    _worst_path,
)
from tests.unit.vllm_ascend_fakes import BF16, _compile_function, _fake_ascend_mla_spec_class, _stub_globals
from tests.unit.vllm_ascend_sdist import (
    AT,
    MIB,
    MODEL_RUNNER,
    RELEASES,
    UTILS,
    VERSION,
    WORKER,
    Release,
    _sha256,
)
from vllm_kvp2p.platform import ascend_hook

# ----------------------------------------------------------------------------------------------------------------
# (a) the wrapped method
# ----------------------------------------------------------------------------------------------------------------


def test_the_release_is_the_pinned_one(release: Release) -> None:
    pkg = release.text("PKG-INFO")
    assert re.search(r"^Name: vllm_ascend$", pkg, re.M)
    assert re.search(rf"^Version: {re.escape(release.version)}$", pkg, re.M)
    assert _sha256(release.sdist) == RELEASES[release.version]


def test_npu_model_runner_has_the_method_the_hook_wraps(release: Release) -> None:
    at = AT[release.version]
    assert ascend_hook.TARGET_MODULE.replace(".", "/") + ".py" == MODEL_RUNNER
    cls = _class(release.tree(MODEL_RUNNER), ascend_hook.TARGET_CLASS)
    assert cls.lineno == at.runner_class, f"{MODEL_RUNNER}:{cls.lineno}"
    fn = _method(cls, ascend_hook.TARGET_METHOD)
    assert fn.lineno == at.method, f"{MODEL_RUNNER}:{fn.lineno}"
    assert _param_names(fn) == ascend_hook.EXPECTED_PARAMS, f"{MODEL_RUNNER}:{fn.lineno} takes {_param_names(fn)}"
    assert fn.args.defaults == [] and fn.args.kw_defaults == []
    # A plain method: the wrapper passes (self, kv_cache_config) through, so no staticmethod/classmethod/property.
    assert fn.decorator_list == [], f"{MODEL_RUNNER}:{fn.lineno} is decorated"


def test_the_only_override_of_the_method_is_the_310p_runner(release: Release) -> None:
    """Subclasses that override the method escape the wrap on NPUModelRunner. Only the Atlas 300I (310P) runners
    do (0.30.0rc2 adds the 310P v2 runner's) -- not a 910B path, but the hook does not cover them."""
    overriding = set()
    for rel in release.files("vllm_ascend/", ".py"):
        for cls in (n for n in ast.walk(release.tree(rel)) if isinstance(n, ast.ClassDef)):
            if any(isinstance(n, ast.FunctionDef) and n.name == ascend_hook.TARGET_METHOD for n in cls.body):
                overriding.add(f"{rel}:{cls.name}")
    assert overriding == {f"{MODEL_RUNNER}:NPUModelRunner", *AT[release.version].overrides}


def test_v2_model_runner_is_not_used_with_vllm_0_23(release_023: Release) -> None:
    """NPUWorker builds the v2 runner (a different class, not wrapped) only when use_v2_model_runner is still set;
    worker.py forces it off on vLLM 0.23.0. (0.30.0rc2: opt-in, test_vllm_ascend_release_030.py.)"""
    release = release_023
    init = _method(_class(release.tree(WORKER), "NPUWorker"), "__init__")
    guards = [n for n in ast.walk(init) if isinstance(n, ast.If) and "use_v2_model_runner" in ast.unparse(n.test)
              and 'vllm_version_is("0.23.0")' in ast.unparse(n.test).replace("'", '"')]
    assert len(guards) == 1, f"{WORKER}: no v2-runner guard for vLLM 0.23.0 in NPUWorker.__init__"
    guard = guards[0]
    assert guard.lineno == 161, f"{WORKER}:{guard.lineno}"
    assigns = [s for s in guard.body if isinstance(s, ast.Assign)]
    assert [ast.unparse(s) for s in assigns] == ["self.use_v2_model_runner = False"]


# ----------------------------------------------------------------------------------------------------------------
# (b) how the pieces are allocated and padded
# ----------------------------------------------------------------------------------------------------------------


def test_alignment_pad_is_2_mib_as_budgeted(release: Release) -> None:
    fn = _runner_methods(release)[ascend_hook.TARGET_METHOD]
    assigns = [n for n in ast.walk(fn) if isinstance(n, ast.Assign)
               and any(isinstance(t, ast.Name) and t.id == "alignment" for t in n.targets)]
    assert len(assigns) == 1, f"{MODEL_RUNNER}: {len(assigns)} assignments to alignment"
    assign = assigns[0]
    assert assign.lineno == AT[release.version].alignment, f"{MODEL_RUNNER}:{assign.lineno}"
    assert ast.unparse(assign.value) == "2 * 1024 * 1024"
    assert _const_int(assign.value) == ascend_hook._ALIGN == 2 * MIB


def test_every_piece_is_one_allocation_padded_by_the_alignment(release: Release) -> None:
    """With a connector configured (kv_transfer_config set, as it is whenever our connector runs), every device
    allocation in the method and its two allocation helpers is ``torch.zeros(n + alignment, int8, device)`` then
    ``self._align_memory(t, alignment)[:n]``; unpadded ones only exist under ``kv_transfer_config is None``."""
    at = AT[release.version]
    methods = _runner_methods(release)
    names = [ascend_hook.TARGET_METHOD, *_PIECE_HELPERS]
    padded_lines, unpadded_lines = [], []
    for name in names:
        fn = methods[name]
        parents = _parents(fn)
        for call in _torch_allocations(fn):
            if not _on_device(call):
                # The only host allocation: torch.empty((), dtype=scale_dtype).element_size() to learn a dtype size.
                assert name == "_allocate_sparse_c8_indexer_tensors" and ast.unparse(call) == \
                    "torch.empty((), dtype=scale_dtype)", f"{MODEL_RUNNER}:{call.lineno} {ast.unparse(call)}"
                continue
            assert call.func.attr == "zeros", f"{MODEL_RUNNER}:{call.lineno}"  # type: ignore[attr-defined]
            assert {k.arg: ast.unparse(k.value) for k in call.keywords} == \
                {"dtype": "torch.int8", "device": "self.device"}, f"{MODEL_RUNNER}:{call.lineno}"
            if _only_without_connector(call, parents):
                unpadded_lines.append(call.lineno)
                continue
            size = call.args[0]
            if isinstance(size, ast.Name):  # cache_size_aligned = kv_cache_tensor.size + alignment
                defs = [n for n in ast.walk(fn) if isinstance(n, ast.Assign) and n.lineno < call.lineno
                        and any(isinstance(t, ast.Name) and t.id == size.id for t in n.targets)]
                size = defs[-1].value
            assert isinstance(size, ast.BinOp) and isinstance(size.op, ast.Add) and \
                ast.unparse(size.right) == "alignment", f"{MODEL_RUNNER}:{call.lineno} pads by {ast.unparse(size)}"
            padded_lines.append(call.lineno)
    padded_lines.sort()
    unpadded_lines.sort()
    assert padded_lines == at.padded, padded_lines
    assert unpadded_lines == at.unpadded, unpadded_lines
    # Each padded allocation is realigned to the 2 MiB boundary and cut back to its size.
    text = release.lines(MODEL_RUNNER)
    for line, statement in at.realigned.items():
        assert text[line - 1].strip() == statement, f"{MODEL_RUNNER}:{line}"
    # The helpers get the method's 2 MiB alignment, nothing else.
    fn = methods[ascend_hook.TARGET_METHOD]
    helper_calls = [c for c in _calls(fn) if any(_is_self_call(c, h) for h in _PIECE_HELPERS)]
    assert sorted(c.lineno for c in helper_calls) == at.helper_calls
    for call in helper_calls:
        passed = [ast.unparse(a) for a in call.args[1:2]] + [ast.unparse(k.value) for k in call.keywords
                                                               if k.arg == "alignment"]
        assert passed == ["alignment"], f"{MODEL_RUNNER}:{call.lineno}"
    # The sparse C8 helper makes ONE raw allocation and views the indexer K and its scale inside it.
    c8 = methods["_allocate_sparse_c8_indexer_tensors"]
    assert _worst_path(c8.body) == 1
    assert [c.lineno for c in _calls(c8) if _is_self_call(c, "_allocate_int8_cache_tensor")] == [at.c8_int8_call]
    int8 = methods["_allocate_int8_cache_tensor"]
    assert _worst_path(int8.body) == 1  # the unpadded early return OR the padded allocation, never both


def _branch_piece_counts(tree: ast.Module) -> tuple[tuple[int, ...], list[ast.expr], int]:
    """(worst-path pieces of each branch of the per-layer if/elif chain, the branch tests, pieces outside it)."""
    fn = _method(_class(tree, "NPUModelRunner"), ascend_hook.TARGET_METHOD)
    outer = [n for n in fn.body if isinstance(n, ast.For) and ast.unparse(n.iter) == "kv_cache_config.kv_cache_tensors"]
    assert len(outer) == 1 and outer[0].lineno == 4107, f"{MODEL_RUNNER}: outer loop"
    inner = [n for n in outer[0].body if isinstance(n, ast.For)
             and ast.unparse(n.iter) == "range(len(kv_cache_tensor.shared_by))"]
    assert len(inner) == 1 and inner[0].lineno == 4115
    chains = [s for s in inner[0].body if isinstance(s, ast.If)]
    assert len(chains) == 1 and chains[0].lineno == 4118
    branches = _elif_chain(chains[0])
    inside = sum(_pieces_in(stmt) for _, body in branches for stmt in body)
    return tuple(_worst_path(body) for _, body in branches), [t for t, _ in branches], _pieces_in(fn) - inside


def test_at_most_three_pieces_per_kv_cache_tensor_and_path(release_023: Release) -> None:
    """The loop ``for kv_cache_tensor in kv_cache_config.kv_cache_tensors`` → ``for idx in range(len(shared_by))``
    → an if/elif chain with three allocating branches, each guarded by ``layer_name not in kv_cache_raw_tensors``:
    single tensor (mamba / hybrid / cache-only / hidden-state) = 1 piece, compressed attention = 1, attention
    = K + V + sparse indexer K (its C8 scale shares the indexer allocation) = 3."""
    release = release_023
    counts, tests, outside = _branch_piece_counts(release.tree(MODEL_RUNNER))
    assert counts == (1, 1, 3), f"{MODEL_RUNNER}:4118 pieces per branch {counts}"
    assert max(counts) <= ascend_hook._PIECES_PER_TENSOR
    for test in tests:
        assert "layer_name not in kv_cache_raw_tensors" in ast.unparse(test), ast.unparse(test)
    assert outside == 0  # no allocation anywhere else in the method


def test_the_piece_count_sees_a_fourth_piece(release_023: Release) -> None:
    """The count above can fail: one more padded allocation in the attention branch makes it 4."""
    release = release_023
    anchor = "                    if self.use_sparse and dsa_k_tensor_size is not None:\n"
    text = release.text(MODEL_RUNNER)
    assert text.count(anchor) == 1
    mutated = text.replace(anchor, "                    extra = self._allocate_int8_cache_tensor(8, alignment)\n"
                           + anchor)
    counts, _, _ = _branch_piece_counts(ast.parse(mutated))
    assert counts == (1, 1, 4) and max(counts) > ascend_hook._PIECES_PER_TENSOR


def test_attention_pieces_add_up_to_at_most_the_tensor_size(release_023: Release) -> None:
    """K/V (and sparse) sizes are ``int(size // split_factor)`` with split factors from the released
    ``calc_split_factor`` / ``sparse_kv_cache_ratio``: the pieces never exceed the KVCacheTensor's size, so
    ``size + pieces x 2 MiB`` is the whole request."""
    release = release_023
    text = release.lines(MODEL_RUNNER)
    assert text[4227 - 1].strip() == "k_tensor_size = int(kv_cache_tensor.size // k_tensor_split_factor)"
    assert text[4229 - 1].strip() == "int(kv_cache_tensor.size // v_tensor_split_factor)"
    assert text[4237 - 1].strip() == "dsa_k_tensor_size = int(kv_cache_tensor.size // dsa_k_tensor_split_factor)"
    g = _stub_globals()
    calc_split_factor = _compile_function(release, UTILS, _function(release.tree(UTILS), "calc_split_factor"), g)
    assert _function(release.tree(UTILS), "calc_split_factor").lineno == 1611
    for dims in ([128, 128], [512, 64], [64, 64], [192, 128], [576, 0 + 64], [96, 160]):
        for size in (147456 * 3001, 524288 * 1001, 2 * MIB * 7 + 4096, 1_000_003 * 64):
            factors = calc_split_factor(dims)
            pieces = [int(size // f) for f in factors]
            assert sum(pieces) <= size, (dims, size, pieces)
            assert size - sum(pieces) < len(pieces) * 2, (dims, size, pieces)  # only floor rounding lost
    spec_cls = _fake_ascend_mla_spec_class(release, g)
    for li_c8 in (False, True):
        spec = spec_cls(block_size=128, num_kv_heads=1, head_size=576, dtype=BF16, sparse_head_dim=(512, 64, 128),
                        cache_sparse_li_c8=li_c8)
        ratios = [r for r in spec.sparse_kv_cache_ratio if r is not None]
        assert len(ratios) == (4 if li_c8 else 3)
        size = spec.page_size_bytes * 1777
        assert sum(int(size // r) for r in ratios) <= size


# ----------------------------------------------------------------------------------------------------------------
# (c) order: the connector exists before the allocation runs
# ----------------------------------------------------------------------------------------------------------------


def test_worker_creates_the_connector_before_allocating_the_kv_cache(release_023: Release) -> None:
    release = release_023
    worker_files = [p for p in release.files("vllm_ascend/worker/", ".py")
                    if re.fullmatch(r"vllm_ascend/worker/worker[^/]*\.py", p)]
    assert worker_files == [WORKER]
    tree = release.tree(WORKER)
    imports = [n for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "vllm.distributed.kv_transfer"]
    assert len(imports) == 1 and "ensure_kv_transfer_initialized" in {a.name for a in imports[0].names}
    assert imports[0].lineno == 33
    worker = _class(tree, "NPUWorker")
    assert worker.lineno == 89 and [ast.unparse(b) for b in worker.bases] == ["WorkerBase"]
    fn = _method(worker, "initialize_from_config")
    assert fn.lineno == 907 and _param_names(fn) == ("self", "kv_cache_config")
    # ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config) is the first statement after the
    # docstring, unconditional; the only way to the allocation comes after it.
    assert ast.unparse(fn.body[1]) == "ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)"
    ensure_line, reach = _connector_created_first(tree)
    assert (ensure_line, reach) == (909, [918])
    # No other NPUWorker method reaches the allocation (so none can run before the connector exists).
    for other in (n for n in worker.body if isinstance(n, ast.FunctionDef) and n is not fn):
        names = {ast.unparse(c.func) for c in _calls(other)}
        assert not names & {"self.model_runner.initialize_kv_cache", "self.model_runner.initialize_kv_cache_tensors",
                            "self.model_runner._allocate_kv_cache_tensors"}, f"{WORKER}:{other.lineno} {other.name}"
    # The order check can fail: with the connector created after the allocation it reports so.
    text = release.text(WORKER)
    ensure = "        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)\n"
    init = "            self.model_runner.initialize_kv_cache(kv_cache_config)\n"
    assert text.count(ensure) == 1 and text.count(init) == 1
    swapped = text.replace(ensure, "").replace(init, init + "    " + ensure)
    late_line, late_reach = _connector_created_first(ast.parse(swapped))
    assert late_line == 0 or late_line > min(late_reach)

    # NPUModelRunner.initialize_kv_cache -> initialize_kv_cache_tensors -> _allocate_kv_cache_tensors, then the
    # connector gets the tensors (register_kv_caches) -- after the arena scope closed.
    methods = _runner_methods(release)
    init_kv = methods["initialize_kv_cache"]
    assert init_kv.lineno == 3843
    tensors_call = [c for c in _calls(init_kv) if _is_self_call(c, "initialize_kv_cache_tensors")]
    register = [c for c in _calls(init_kv) if ast.unparse(c.func) == "get_kv_transfer_group().register_kv_caches"]
    assert [c.lineno for c in tensors_call] == [3865] and [c.lineno for c in register] == [3884]
    alloc_call = [c for c in _calls(methods["initialize_kv_cache_tensors"])
                  if _is_self_call(c, ascend_hook.TARGET_METHOD)]
    assert [c.lineno for c in alloc_call] == [3928]
    assert ast.unparse(alloc_call[0].args[0]) == "kv_cache_config"


# ----------------------------------------------------------------------------------------------------------------
# (d) no get_mem_pool_context anywhere
# ----------------------------------------------------------------------------------------------------------------


def _mem_pool_context_uses(release: Release) -> list[str]:
    hits = []
    for rel in release.files("vllm_ascend/", ".py"):
        for node in ast.walk(release.tree(rel)):
            name = node.attr if isinstance(node, ast.Attribute) else node.id if isinstance(node, ast.Name) else None
            if name == "get_mem_pool_context":
                hits.append(f"{rel}:{node.lineno}")
        if "get_mem_pool_context" in release.text(rel) and not any(h.startswith(rel + ":") for h in hits):
            hits.append(f"{rel}: (in a string or comment)")
    return hits


def test_vllm_ascend_never_asks_the_connector_for_a_memory_pool(release: Release) -> None:
    assert len(release.files("vllm_ascend/", ".py")) > 100
    assert _mem_pool_context_uses(release) == []


def test_the_mem_pool_search_finds_a_call_when_there_is_one(release: Release) -> None:
    """The check above can fail: the same search on a copy of worker.py with the call added finds it."""
    text = release.text(WORKER).replace(
        "        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)\n",
        "        ensure_kv_transfer_initialized(self.vllm_config, kv_cache_config)\n"
        "        pool = get_kv_transfer_group().get_mem_pool_context()\n", 1)
    assert text != release.text(WORKER)
    mutated = copy.copy(release)
    mutated._text = {**release._text, WORKER: text}
    worker_tree = ast.parse(text)
    mutated.tree = lambda rel: worker_tree if rel == WORKER else release.tree(rel)  # type: ignore[method-assign]
    assert _mem_pool_context_uses(mutated) == [f"{WORKER}:{AT[release.version].mem_pool_probe}"]


# ----------------------------------------------------------------------------------------------------------------
# (e) plugin entry points, and what the [ascend] extra pins
# ----------------------------------------------------------------------------------------------------------------


def test_platform_plugin_entry_point(release: Release) -> None:
    # As built into the sdist's metadata ...
    ep = configparser.ConfigParser()
    ep.optionxform = str  # type: ignore[assignment,method-assign]
    ep.read_string(release.text("vllm_ascend.egg-info/entry_points.txt"))
    assert dict(ep["vllm.platform_plugins"]) == {"ascend": "vllm_ascend:register"}
    assert dict(ep["vllm.general_plugins"]) == {
        "ascend_kv_connector": "vllm_ascend:register_connector", "ascend_model": "vllm_ascend:register_model",
        "ascend_model_loader": "vllm_ascend:register_model_loader",
        "ascend_service_profiling": "vllm_ascend:register_service_profiling"}
    # ... and as setup.py declares it (what a source install writes).
    setup_call = [c for c in _calls(release.tree("setup.py")) if ast.unparse(c.func) == "setup"]
    assert len(setup_call) == 1
    eps = ast.literal_eval(next(k.value for k in setup_call[0].keywords if k.arg == "entry_points"))
    assert eps["vllm.platform_plugins"] == ["ascend = vllm_ascend:register"]
    assert setup_call[0].lineno == AT[release.version].setup
    # The target exists and returns the platform class path.
    register = _function(release.tree("vllm_ascend/__init__.py"), "register")
    assert register.lineno == AT[release.version].register and _param_names(register) == ()
    assert ast.unparse(register.body[-1]) == "return 'vllm_ascend.platform.NPUPlatform'"


def _matrix_row(release: Release, version: str) -> dict[str, str]:
    lines = release.lines("docs/source/community/versioning_policy.md")
    header_i = next(i for i, line in enumerate(lines) if line.startswith("| vLLM Ascend |"))
    header = [c.strip() for c in lines[header_i].strip("|").split("|")]
    for line in lines[header_i + 2:]:
        if not line.startswith("|"):
            break
        cells = [c.strip() for c in line.strip("|").split("|")]
        if cells[0] == f"v{version}":
            return dict(zip(header, cells))
    raise AssertionError(f"no row for v{version}")


def test_compatibility_matrix_and_requirements_match_the_ascend_extra(release_023: Release) -> None:
    release = release_023
    row = _matrix_row(release, VERSION)
    assert row == {"vLLM Ascend": "v0.23.0.post1", "vLLM": "v0.23.0", "Python": ">= 3.10, < 3.13",
                   "Stable CANN": "9.1.0", "PyTorch/torch_npu": "2.10.0 / 2.10.0.post4", "Triton Ascend": "3.2.2",
                   "Mooncake": "v0.3.11.post1"}
    pins = _requires_dist(release)
    assert {k: pins[k] for k in ("torch", "torch-npu", "triton-ascend")} == \
        {"torch": "2.10.0", "torch-npu": "2.10.0.post4", "triton-ascend": "3.2.2"}

    import tomllib

    pyproject = tomllib.loads((Path(__file__).resolve().parents[2] / "pyproject.toml").read_text())
    extra = {}
    for req in pyproject["project"]["optional-dependencies"]["ascend"]:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)==([^;\s]+)", req.strip())
        assert m, f"[ascend] entry {req!r} is not an exact pin"
        extra[m.group(1).lower().replace("_", "-")] = m.group(2)
    torch_pin, npu_pin = (v.strip() for v in row["PyTorch/torch_npu"].split("/"))
    assert extra["vllm-ascend"] == VERSION
    assert extra["torch"] == torch_pin == pins["torch"]
    assert extra["torch-npu"] == npu_pin == pins["torch-npu"]
    assert extra["mooncake-transfer-engine-npu"] == row["Mooncake"].lstrip("v")
    # vLLM itself is not in the extra: vllm==0.23.0 from PyPI requires torch==2.11.0, which cannot be installed
    # with torch==2.10.0; vllm-ascend installs vLLM 0.23.0 from source with VLLM_TARGET_DEVICE=empty.
    assert "vllm" not in extra and row["vLLM"] == "v0.23.0"
