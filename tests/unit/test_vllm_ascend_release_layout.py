"""The KV layout vllm-ascend's released attention backends give (their ``get_kv_cache_shape``, compiled from each
release) is what ``platform/npu.py`` declares, so blocks of different sizes slice as token runs; and its NZ KV
cache, which this connector cannot move as it lies, is refused at start-up."""

from __future__ import annotations

import ast

from tests.unit.vllm_ascend_ast import _class, _shape_function
from tests.unit.vllm_ascend_sdist import MODEL_RUNNER, V023, Release


def test_npu_kv_blocks_are_what_the_npu_platform_declares(release: Release) -> None:
    """platform/npu.py declares vllm-ascend's KV blocks token-major rows (AttentionInterior.TOKEN_MAJOR), so a P
    block of another block size is a contiguous run of tokens of a D block. Read off the release: its attention
    backend's shape is (2, blocks, block_size, kv_heads, head) and the runner views K and V each as
    ``kv_cache_shape[1:]``; MLA's nope and rope as (blocks, block_size, kv_heads, dim), one latent row per token.
    (0.30.0rc2: with VLLM_KV_CACHE_LAYOUT unset; LBHNC/HND make it head-major, test_vllm_ascend_release_030.py.)"""
    from vllm_kvp2p.platform.npu import NpuPlatform
    from vllm_kvp2p.transfer.descriptors import PlaneGeometry
    from vllm_kvp2p.transfer.layout import AttentionInterior, TensorView, block_shape_of
    from vllm_kvp2p.transfer.slicing import build_sliced_descriptors, token_chunks

    attention = _shape_function(release, "vllm_ascend/attention/attention_v1.py", "AscendAttentionBackend")
    mla = _shape_function(release, "vllm_ascend/attention/mla_v1.py", "AscendMLABackend")
    assert attention(100, 128, 8, 128) == (2, 100, 128, 8, 128)
    assert tuple(mla(100, 128, 1, 576)) == (100, 128, 1, 576)
    runner = release.text(MODEL_RUNNER)
    assert "k_shape = kv_cache_shape[1:]" in runner  # K and V: each [blocks, block_size, kv_heads, head]
    assert "mla_num_blocks, mla_block_size, num_kv_heads, _ = kv_cache_shape" in runner

    def view(shape: tuple[int, ...]) -> TensorView:
        strides = [1] * len(shape)
        for i in range(len(shape) - 2, -1, -1):
            strides[i] = strides[i + 1] * shape[i + 1]
        return TensorView(1 << 30, shape, tuple(strides), 2)  # bfloat16

    platform = NpuPlatform()
    assert platform.attention_interior is AttentionInterior.TOKEN_MAJOR
    p_shape = block_shape_of(view(attention(100, 128, 8, 128)[1:]), 100, 128, 8, head_size=128,
                             interior=platform.attention_interior)
    d_shape = block_shape_of(view(attention(100, 256, 8, 128)[1:]), 100, 256, 8, head_size=128,
                             interior=platform.attention_interior)
    assert (p_shape.head_major, p_shape.num_heads, p_shape.inner_bytes, p_shape.all_rows) == (False, 8, 256, True)
    # Two P blocks of 128 tokens into one D block of 256, all heads: one run each, in token order.
    p_plane = PlaneGeometry(1 << 30, p_shape.block_bytes, p_shape.block_bytes, 100)
    d_plane = PlaneGeometry(1 << 40, d_shape.block_bytes, d_shape.block_bytes, 100)
    runs = build_sliced_descriptors([d_plane], [d_shape], [p_plane], [p_shape],
                                    token_chunks([7], 256, [3, 9], 128, 0), 0, 0, 8)
    assert runs.lengths == [p_shape.block_bytes] * 2
    assert runs.local_addrs == [d_plane.base_addr + 7 * d_shape.block_bytes,
                                d_plane.base_addr + 7 * d_shape.block_bytes + p_shape.block_bytes]
    for dim in (512, 64):  # MLA nope and rope
        latent = block_shape_of(view((100, 128, 1, dim)), 100, 128, 1, head_size=576,
                                interior=AttentionInterior.LATENT_ROWS)
        assert (latent.num_heads, latent.inner_bytes, latent.all_rows) == (1, dim * 2, True)


def test_vllm_ascends_nz_kv_cache_is_refused(release: Release) -> None:
    """vllm-ascend's ``enable_kv_nz`` (MLA on a D node only) keeps D's cache in the NZ (fractal) format and has its
    own connector reformat what it receives; this connector moves blocks as they lie, so it refuses the setting at
    start-up instead of decoding from ND bytes read as NZ."""
    from types import SimpleNamespace

    from vllm_kvp2p.platform.npu import NpuPlatform

    config = release.tree("vllm_ascend/ascend_config.py")
    if release.version == V023:
        assert 'additional_config.get("enable_kv_nz", False)' in release.text("vllm_ascend/ascend_config.py")
    else:  # a field of the (pydantic) AscendConfig built from --additional-config's keys
        fields = {ast.unparse(n.target): ast.unparse(n.value) for n in _class(config, "AscendConfig").body
                  if isinstance(n, ast.AnnAssign) and n.value is not None}
        assert fields["enable_kv_nz"] == "False"
    nz = SimpleNamespace(additional_config={"enable_kv_nz": True})
    assert "enable_kv_nz" in NpuPlatform().unsupported_setting(nz)
    assert NpuPlatform().unsupported_setting(SimpleNamespace(additional_config={})) == ""
    assert NpuPlatform().unsupported_setting(SimpleNamespace(additional_config=None)) == ""
