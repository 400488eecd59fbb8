"""Thin adapter around Mooncake's ``TransferEngine`` (one per worker process, P2PHANDSHAKE metadata, no etcd).

Facts about the engine this adapter exists to contain (measured with the 0.3.13.post1 wheel; see docs):
* any method called before ``initialize`` segfaults, so the engine object is never exposed before that;
* under P2PHANDSHAKE the engine picks its own RPC port; peers address it as ``host:get_rpc_port()``;
* more than ~2048 entries in flight to one peer fail and can leave that peer unusable: batches are capped;
* a descriptor crossing two registered regions fails; registering overlapping regions fails (-7);
* ``MC_TRANSFER_TIMEOUT`` (>= 5 s) bounds every blocking read and ``ASCEND_TRANSFER_TIMEOUT`` one ``ascend``
  transfer; both are read when the engine is constructed (set here from ``transfer_timeout``, transfer/timeouts.py);
* 0.3.11.post1 (the release vllm-ascend 0.23 pairs with) registers memory without a ``location`` argument and
  detects the memory kind itself; 0.3.13 takes it. The adapter passes it only where the engine accepts it.
"""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass

from vllm_kvp2p import os_threads
from vllm_kvp2p.log import get_logger
from vllm_kvp2p.transfer.descriptors import Descriptors
from vllm_kvp2p.transfer.timeouts import transport_timeouts

logger = get_logger(__name__)


class TransferEngineError(RuntimeError):
    """Mooncake refused to start, register or transfer."""


@dataclass(frozen=True)
class ReadStats:
    entries: int
    num_bytes: int
    seconds: float


def _takes_location(method: object) -> bool:
    """Whether a pybind11 registration method has the ``location`` parameter (its signature is its docstring)."""
    return "location" in (getattr(method, "__doc__", None) or "")


class MooncakeEngine:
    """One initialized Mooncake transfer engine and the regions registered with it."""

    def __init__(self, host: str, protocol: str, device_name: str = "", transfer_timeout: float = 30.0) -> None:
        # Read by TransferEngine's constructor; decided from transfer_timeout alone (transfer/timeouts.py).
        timeouts = transport_timeouts(transfer_timeout, protocol, os.environ)
        for warning in timeouts.warnings:
            logger.warning("%s", warning)
        os.environ.update(timeouts.env)
        self.transfer_timeout = timeouts.transfer_timeout_s
        os.environ.setdefault("MC_LOG_LEVEL", "WARNING")
        # Mooncake starts threads when its module loads (its Go metadata client's runtime) and in initialize:
        # they start here, under this name, and keep it (os_threads.py).
        with os_threads.named(os_threads.MOONCAKE):
            try:
                from mooncake.engine import TransferEngine
            except ImportError as exc:  # libibverbs1 missing is the usual cause on a fresh machine
                raise TransferEngineError(
                    f"cannot import mooncake.engine ({exc}); install the Mooncake wheel for this platform "
                    "(pip install -e '.[cpu]' or '.[ascend]' from this package's checkout) and Debian's libibverbs1"
                ) from exc
            engine = TransferEngine()
            rc = engine.initialize(host, "P2PHANDSHAKE", protocol, device_name)
        if rc != 0:
            raise TransferEngineError(
                f"Mooncake initialize(host={host!r}, protocol={protocol!r}, device={device_name!r}) returned {rc}"
            )
        self._engine = engine
        self.host = host
        self.protocol = protocol
        self.segment = f"{host}:{engine.get_rpc_port()}"
        self._regions: list[tuple[int, int]] = []
        self._lock = threading.Lock()
        logger.info("Mooncake engine up: segment %s, protocol %s, MC_TRANSFER_TIMEOUT %d s, "
                    "ASCEND_TRANSFER_TIMEOUT %s ms", self.segment, protocol, self.transfer_timeout,
                    timeouts.env["ASCEND_TRANSFER_TIMEOUT"])

    @property
    def regions(self) -> list[tuple[int, int]]:
        return list(self._regions)

    def register(self, regions: Sequence[tuple[int, int]], location: str = "*") -> None:
        """Register memory regions (address, length); each must be disjoint from those already registered."""
        if not regions:
            return
        t0 = time.perf_counter()
        addrs = [a for a, _ in regions]
        lens = [n for _, n in regions]
        if _takes_location(self._engine.batch_register_memory):
            rc = self._engine.batch_register_memory(addrs, lens, location)
        else:  # Mooncake <= 0.3.11: the engine finds the memory's location itself
            rc = self._engine.batch_register_memory(addrs, lens)
        if rc != 0:
            raise TransferEngineError(f"Mooncake batch_register_memory of {len(regions)} regions returned {rc}")
        self._regions.extend(regions)
        logger.info(
            "registered %d KV region(s), %.1f MiB, in %.1f ms",
            len(regions), sum(lens) / 2**20, (time.perf_counter() - t0) * 1e3,
        )

    def read(self, segment: str, descriptors: Descriptors) -> ReadStats:
        """One blocking batch read from ``segment`` into local memory; raises on failure."""
        t0 = time.perf_counter()
        rc = self._engine.batch_transfer_sync_read(
            segment, descriptors.local_addrs, descriptors.remote_addrs, descriptors.lengths
        )
        if rc != 0:
            raise TransferEngineError(
                f"batch_transfer_sync_read of {len(descriptors)} entries from {segment} returned {rc}"
            )
        return ReadStats(len(descriptors), descriptors.total_bytes, time.perf_counter() - t0)

    def close(self) -> None:
        """Unregister and drop the engine (tear-down takes ~1 s inside Mooncake)."""
        with self._lock:
            engine, self._engine = self._engine, None
        if engine is None:
            return
        if self._regions:
            engine.batch_unregister_memory([a for a, _ in self._regions])
            self._regions = []
        del engine
