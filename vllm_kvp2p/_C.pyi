"""Type stub for the C++ extension module vllm_kvp2p._C (csrc/).
Use vllm_kvp2p.transfer.native instead of importing it."""

from collections.abc import Sequence
from typing import Protocol

class _Plane(Protocol):
    @property
    def base_addr(self) -> int: ...
    @property
    def block_stride(self) -> int: ...
    @property
    def block_bytes(self) -> int: ...
    @property
    def num_blocks(self) -> int: ...

HAS_NPU: bool

def build_descriptors(
    local_planes: Sequence[_Plane],
    remote_planes: Sequence[_Plane],
    local_ids: Sequence[int],
    remote_ids: Sequence[int],
) -> tuple[list[int], list[int], list[int]]:
    """Same output as vllm_kvp2p.transfer.descriptors.build_descriptors_py, as (local_addrs, remote_addrs, lengths).

    Raises ValueError under the reference's conditions, TypeError/OverflowError outside 64-bit integers.
    """
