"""The interface every platform adapter implements."""

from __future__ import annotations

from abc import ABC, abstractmethod
from contextlib import AbstractContextManager, nullcontext
from typing import Any


class KVPlatform(ABC):
    #: Short name, used in logs and the registration metadata.
    name: str
    #: Mooncake transport used when the operator does not choose one.
    default_protocol: str

    @abstractmethod
    def memory_location(self, tensor: Any) -> str:
        """Mooncake location string of the memory a KV tensor lives in ("cpu", "npu:0", ...)."""

    @abstractmethod
    def synchronize(self) -> None:
        """Wait until device work that wrote KV blocks (or reads them) has finished."""

    def mem_pool_context(self) -> AbstractContextManager[None] | None:
        """Allocator scope inside which vLLM allocates the KV cache (a single registrable arena), or None to let
        vLLM allocate as usual and register tensor by tensor."""
        return None

    def service_threads(self) -> AbstractContextManager[None]:
        """Scope in which the connector starts its own threads (side channel, pull loop, Mooncake's workers),
        so they can be placed apart from the model's compute threads."""
        return nullcontext()
