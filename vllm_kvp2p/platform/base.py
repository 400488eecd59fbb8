"""The interface every platform adapter implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any, Protocol

from vllm_kvp2p.transfer.interior import PartLayout
from vllm_kvp2p.transfer.layout import AttentionInterior


class KVArenaLike(Protocol):
    """What the connector needs of a KV arena."""

    base: int
    size: int

    def scope(self) -> AbstractContextManager[Any]: ...

    def contains(self, ptr: int, nbytes: int = 1) -> bool: ...


class KVPlatform(ABC):
    #: Short name, used in logs and the registration metadata.
    name: str
    #: Mooncake transport used when the operator does not choose one.
    default_protocol: str
    #: How this platform's attention backend lays out the inside of a KV block (not visible in the tensor's
    #: shape; a wrong guess moves the right bytes to the wrong tokens whenever P and D block sizes differ).
    attention_interior: AttentionInterior

    @abstractmethod
    def memory_location(self, tensor: Any) -> str:
        """Mooncake location string of the memory a KV tensor lives in ("cpu", "npu:0", ...)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until device work that wrote KV blocks (or reads them) has finished."""

    def attention_part_layouts(
        self, dtype: Any, block_size: int, head_size: int, kv_cache_dtype: str
    ) -> tuple[PartLayout, ...]:
        """How the attention kernel lays out each part (K, V) of a head's block for these settings (one entry per
        part of :attr:`attention_interior`); empty: plain token rows."""
        return ()

    def unsupported_setting(self, vllm_config: Any) -> str:
        """A setting of this platform's vLLM plugin that lays the KV cache out in a way this connector cannot move
        ("" if none): the connector refuses to start, naming it."""
        return ""

    #: Most memory regions one process may register (HCCL allows a few hundred); None: no limit known.
    max_registered_regions: int | None = None

    def kv_arena(self, size_bytes: int) -> KVArenaLike | None:
        """One contiguous region the whole KV cache can be allocated from (see :mod:`vllm_kvp2p.platform.arena`), or
        None
        when this platform or build has none (vLLM then allocates as usual and tensors are registered one by
        one, touching ones merged)."""
        return None

    #: Seconds vLLM's shared-memory readers may busy-poll after a message on this platform (None: vLLM's own
    #: 1 s). The connector keeps engines stepping while transfers are pending, so without a bound every worker
    #: spins a core for the whole time (see platform/worker_polling.py).
    default_worker_busy_poll: float | None = None

    def service_threads(self) -> AbstractContextManager[None]:
        """Scope in which the connector starts its own threads (side channel, pull loop, Mooncake's workers),
        so they can be placed apart from the model's compute threads."""
        return nullcontext()
