"""P side at run time: one worker's :class:`ProducerLedger`, its clock and lock, and the side channel D talks to.

The ledger decides; this module only feeds it events (holds from vLLM's scheduler metadata, claims and releases
from the side channel, the passing of time) and logs what it reports.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from vllm_kvp2p.lifecycle.producer import ProducerLedger
from vllm_kvp2p.log import get_logger
from vllm_kvp2p.protocol import (
    Ack,
    Claim,
    ErrorReply,
    GetRegistration,
    RankRegistration,
    Registration,
    Release,
    Renew,
    Reply,
    Request,
)
from vllm_kvp2p.side_channel import SideChannelServer

logger = get_logger(__name__)


class HoldService:
    """Keeps P's finished prompts for decoders and answers them on ``host:port``."""

    def __init__(
        self,
        registration: RankRegistration,
        host: str,
        port: int,
        *,
        hold_timeout: float,
        lease_timeout: float,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.registration = registration
        self.ledger = ProducerLedger(hold_timeout, lease_timeout)
        self._clock = clock
        self._lock = threading.Lock()
        self._server = SideChannelServer(
            host, port, self._handle, setting=f"VLLM_KVP2P_SIDE_CHANNEL_PORT base + rank {registration.tp_rank}"
        )
        logger.info("KV hold service of rank %d listening on %s", registration.tp_rank, self._server.address)

    def hold(self, request_id: str, hold_id: str) -> None:
        with self._lock:
            self.ledger.hold(request_id, hold_id, self._clock())
            self._log_events()

    def take_freed(self) -> set[str]:
        """Requests whose blocks vLLM may free now (released by every reader, or expired)."""
        with self._lock:
            self.ledger.expire(self._clock())
            freed = self.ledger.take_freed()
            self._log_events()
        return set(freed)

    @property
    def active(self) -> int:
        with self._lock:
            return self.ledger.active

    def _handle(self, message: Request) -> Reply:
        with self._lock:
            now = self._clock()
            try:
                if isinstance(message, GetRegistration):
                    if message.tp_rank != self.registration.tp_rank:
                        return ErrorReply(
                            f"this is rank {self.registration.tp_rank}, asked for rank {message.tp_rank}"
                        )
                    return Registration(self.registration)
                if isinstance(message, Claim):
                    return self.ledger.claim(
                        message.request_id, message.hold_id, message.reader, message.expected_readers, now
                    )
                if isinstance(message, Renew):
                    return self.ledger.renew(message.request_id, message.hold_id, message.reader, now)
                if isinstance(message, Release):
                    self.ledger.release(
                        message.request_id, message.hold_id, message.reader, message.expected_readers, now
                    )
                    return Ack()
                return ErrorReply(f"unexpected message {type(message).__name__}")
            finally:
                self._log_events()

    def _log_events(self) -> None:
        for event in self.ledger.take_events():
            logger.info("KV hold %s: %s", event.request_id, event.what)

    def close(self) -> None:
        self._server.close()
