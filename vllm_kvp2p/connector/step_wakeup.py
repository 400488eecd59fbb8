"""Ends an idle engine step's sleep as soon as a worker has news for the scheduler.

An engine step that schedules nothing sleeps ``idle_step_sleep`` (scheduler.py) so that the engine, kept stepping
by holds and pending loads, leaves the cores to the threads that move the KV. The news that should end the sleep (a
pull finished on D, a release on P) comes from the worker's threads, in the worker process (or in the engine-core
process at TP 1 with vLLM's in-process executor), and reaches the scheduler only with the next step's
``get_finished``: sleeping the full interval after it cost up to ``idle_step_sleep`` of TTFT per request.

So the scheduler half waits on a Unix datagram socket in Linux's abstract namespace, named after the engine id and
DP rank (nothing on disk, gone with the process), and every worker of that engine sends it one byte per piece of
news. The byte carries nothing: the news itself is still collected by ``get_finished``, so a lost, late or forged
byte only changes how long one idle step sleeps. Where the socket cannot be bound (not Linux, or another scheduler
of the same engine id in this network namespace) the wait is the plain sleep.
"""

from __future__ import annotations

import hashlib
import select
import socket
import time

from vllm_kvp2p.log import get_logger

logger = get_logger(__name__)


def address(engine_id: str, dp_rank: int) -> bytes:
    """The abstract socket name of one engine's scheduler (hashed: engine ids are free text)."""
    digest = hashlib.sha256(f"{engine_id}\0{dp_rank}".encode()).hexdigest()[:32]
    return b"\0vllm-kvp2p-step-" + digest.encode()


class StepWaiter:
    """The scheduler half's idle sleep, ended early by :class:`StepNotifier`."""

    def __init__(self, engine_id: str, dp_rank: int) -> None:
        self.engine_id = engine_id
        self._sock: socket.socket | None = None
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        try:
            sock.bind(address(engine_id, dp_rank))
            sock.setblocking(False)
            self._sock = sock
            # poll, not select: an engine process may hold more than select's 1024 descriptors.
            self._poll = select.poll()
            self._poll.register(sock, select.POLLIN)
        except OSError as exc:  # not Linux, or taken: plain sleeps, which are what this replaces
            sock.close()
            logger.debug("idle steps sleep the full idle_step_sleep: cannot bind the step wake-up socket (%s)", exc)

    @property
    def listening(self) -> bool:
        return self._sock is not None

    def wait(self, seconds: float) -> bool:
        """Sleep up to ``seconds``; True when news ended it early (all news so far consumed)."""
        if self._sock is None:
            time.sleep(seconds)
            return False
        if not self._poll.poll(seconds * 1000):
            return False
        for _ in range(1024):  # drain: one wake-up for all the news so far (bounded: datagrams are queued)
            try:
                self._sock.recv(16)
            except (BlockingIOError, InterruptedError):
                break
        return True

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None


class StepNotifier:
    """A worker's side: tells its engine's scheduler that the next ``get_finished`` has news."""

    def __init__(self, engine_id: str, dp_rank: int) -> None:
        self._address = address(engine_id, dp_rank)
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self._sock.setblocking(False)

    def notify(self) -> None:
        try:
            self._sock.sendto(b"!", self._address)
        except OSError:  # no scheduler listening, or its queue full (it wakes anyway): the sleep ends by itself
            pass

    def close(self) -> None:
        self._sock.close()
