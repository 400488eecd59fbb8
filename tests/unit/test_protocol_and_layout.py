"""Typed messages round-trip; block geometry comes from real shapes and strides."""

from __future__ import annotations

import pytest

from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.protocol import Claim, ClaimReply, ClaimStatus, GetRegistration, Release, RemotePrefill
from vllm_kvp2p.transfer.descriptors import PlaneGeometry
from vllm_kvp2p.transfer.layout import LayoutError, TensorView, coalesce_regions, planes_of


@pytest.mark.parametrize("msg", [GetRegistration(1), Claim("r", "h", "d:0", 2), Release("r", "h", "d:0", 1, True)])
def test_requests_round_trip(msg) -> None:
    assert protocol.decode_request(protocol.encode(msg)) == msg


def test_reply_round_trip_and_no_pickle() -> None:
    reply = ClaimReply(ClaimStatus.GRANTED, 3.0)
    data = protocol.encode(reply)
    assert protocol.decode_reply(data) == reply
    import msgspec

    with pytest.raises(msgspec.DecodeError):
        protocol.decode_request(b"\x80\x04K\x01.")  # a pickle is not a message


def test_transfer_params_round_trip_and_reject_garbage() -> None:
    rp = RemotePrefill("e", "r", "h", 1, [[1, 2]], "hold", 40, 16, tp_size=2)
    params = rp.to_params()
    assert params["do_remote_prefill"] is True and params["remote_request_id"] == "r"
    params["remote_prefill_cached_tokens"] = 0  # vLLM adds keys of its own
    assert RemotePrefill.from_params(params) == rp
    assert RemotePrefill.from_params({"do_remote_prefill": True}) is None


def test_cpu_layout_one_plane_per_layer() -> None:
    # (num_blocks, kv_heads, block_size, head_k + head_v), float32
    view = TensorView(1000, (10, 2, 16, 128), (4096, 2048, 128, 1), 4)
    assert planes_of(view, 10) == [PlaneGeometry(1000, 16384, 16384, 10)]


def test_leading_kv_axis_gives_two_planes() -> None:
    view = TensorView(0, (2, 10, 16, 4, 8), (10 * 512, 512, 32, 8, 1), 2)
    assert planes_of(view, 10) == [PlaneGeometry(0, 1024, 1024, 10), PlaneGeometry(10240, 1024, 1024, 10)]


def test_padded_blocks_are_not_dense_but_addressable() -> None:
    view = TensorView(0, (10, 4, 8), (64, 8, 1), 2)  # 32 elements used of a 64-element block stride
    (plane,) = planes_of(view, 10)
    assert plane.block_stride == 128 and plane.block_bytes == 64 and not plane.dense


def test_page_strided_k_and_v_views_are_two_interleaved_planes() -> None:
    """vllm-ascend 0.30.0rc2's dense attention: one buffer per layer whose page holds a block's K then its V, and K
    and V handed over as views with twice the block's bytes as block stride (model_runner_v1.py:5737)."""
    block, heads, head, size = 16, 2, 8, 2  # (num_blocks, block_size, kv_heads, head) per view, bfloat16
    per_block = block * heads * head
    k = TensorView(4096, (10, block, heads, head), (2 * per_block, heads * head, head, 1), size)
    v = TensorView(4096 + per_block * size, k.shape, k.strides, size)
    (pk,), (pv,) = planes_of(k, 10), planes_of(v, 10)
    assert pk == PlaneGeometry(4096, 2 * per_block * size, per_block * size, 10) and not pk.dense
    assert pv.base_addr == pk.base_addr + pk.block_bytes and pv.block_stride == pk.block_stride
    k_blocks = {pk.base_addr + b * pk.block_stride for b in range(10)}
    v_blocks = {pv.base_addr + b * pv.block_stride for b in range(10)}
    assert not k_blocks & v_blocks and max(v_blocks) + pv.block_bytes == k.data_ptr + 10 * pk.block_stride


def test_non_contiguous_block_is_refused() -> None:
    view = TensorView(0, (10, 4, 8), (32, 1, 4), 2)  # transposed inner dims
    with pytest.raises(LayoutError, match="not contiguous"):
        planes_of(view, 10)


def test_missing_block_dim_is_refused() -> None:
    with pytest.raises(LayoutError, match="num_blocks=7"):
        planes_of(TensorView(0, (10, 4), (4, 1), 2), 7)


def test_coalesce_merges_touching_regions_only() -> None:
    a = TensorView(0, (10, 4), (4, 1), 2)  # bytes [0, 80)
    b = TensorView(80, (10, 4), (4, 1), 2)  # touches a
    c = TensorView(1000, (10, 4), (4, 1), 2)
    assert coalesce_regions([c, a, b]) == [(0, 160), (1000, 80)]


# ---------------------------------------------------------------- block interiors (transfer/layout.py)


def _view(shape: tuple[int, ...]) -> TensorView:
    from vllm_kvp2p.transfer.layout import TensorView

    strides, step = [], 1
    for n in reversed(shape):
        strides.insert(0, step)
        step *= n
    return TensorView(1 << 20, shape, tuple(strides), 2)


def test_each_platforms_block_interior_is_read_as_its_kernel_writes_it() -> None:
    import pytest

    from vllm_kvp2p.transfer.interior import PartLayout
    from vllm_kvp2p.transfer.layout import AttentionInterior, LayoutError, block_shape_of

    columns = PartLayout(group=1, tile=1, element_bytes=2)
    cpu = block_shape_of(_view((40, 4, 32, 128)), 40, 32, 4, head_size=64,
                         interior=AttentionInterior.HEAD_MAJOR_KV_HALVES, part_layouts=(columns, PartLayout()))
    assert (cpu.head_major, cpu.num_heads, cpu.parts, cpu.num_tokens, cpu.inner_bytes) == (True, 4, 2, 32, 128)
    npu = block_shape_of(_view((40, 128, 8, 128)), 40, 128, 8, head_size=128, interior=AttentionInterior.TOKEN_MAJOR)
    assert (npu.head_major, npu.num_heads, npu.parts, npu.inner_bytes) == (False, 8, 1, 256)
    for mla in ((40, 16, 576), (40, 1, 16, 576), (40, 16, 1, 576)):  # CPU 0.32, CPU MLA view, vllm-ascend nope
        shape = block_shape_of(_view(mla), 40, 16, 1, head_size=576, interior=AttentionInterior.LATENT_ROWS)
        assert (shape.num_heads, shape.num_tokens, shape.inner_bytes, shape.all_rows) == (1, 16, 1152, True)
    with pytest.raises(LayoutError, match="is not"):  # a CPU-shaped tensor on a platform that says token-major
        block_shape_of(_view((40, 4, 32, 128)), 40, 32, 4, head_size=64, interior=AttentionInterior.TOKEN_MAJOR)
    with pytest.raises(LayoutError, match="is not"):  # K and V of unequal sizes: not what vLLM's CPU kernel writes
        block_shape_of(_view((40, 4, 32, 96)), 40, 32, 4, head_size=64,
                       interior=AttentionInterior.HEAD_MAJOR_KV_HALVES)
