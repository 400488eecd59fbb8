"""ZMQ transport for the side channel: a ROUTER server on each P worker, REQ clients on D workers.

Only bytes move here; :mod:`vllm_kvp2p.protocol` defines what they mean and the server's handler decides what to
answer. Every call is bounded by a timeout, and a socket that timed out is thrown away (a REQ socket that missed
a reply cannot be reused).
"""

from __future__ import annotations

import threading
from collections.abc import Callable

import msgspec
import zmq

from vllm_kvp2p import protocol
from vllm_kvp2p.log import get_logger
from vllm_kvp2p.protocol import ErrorReply, Reply, Request

logger = get_logger(__name__)


class SideChannelError(RuntimeError):
    """A side-channel peer could not be reached or answered nonsense."""


class SideChannelServer:
    """Answers side-channel requests on ``tcp://host:port`` from a daemon thread."""

    def __init__(self, host: str, port: int, handler: Callable[[Request], Reply], *, setting: str = "") -> None:
        self.address = f"tcp://{host}:{port}"
        self._handler = handler
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            hint = f" (set by {setting})" if setting else ""
            raise SideChannelError(
                f"cannot listen on side-channel port {port} at {host}{hint}: {exc}. "
                "Another instance or rank uses it: give each instance on a host its own VLLM_KVP2P_SIDE_CHANNEL_PORT "
                "(kv_connector_extra_config side_channel_port), leaving tp_size * dp_size ports between them."
            ) from exc
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name=f"kvp2p-side-channel:{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            if len(frames) < 2:
                continue
            identity, payload = frames[0], frames[-1]
            reply = self._answer(payload)
            try:
                self._sock.send_multipart([identity, b"", protocol.encode(reply)], zmq.NOBLOCK)
            except zmq.ZMQError as exc:
                logger.warning("side channel %s could not reply: %s", self.address, exc)
        self._sock.close()
        self._ctx.term()

    def _answer(self, payload: bytes) -> Reply:
        try:
            message = protocol.decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            return ErrorReply(f"undecodable request: {exc}")
        try:
            return self._handler(message)
        except Exception as exc:  # a handler bug must not kill the server thread
            logger.exception("side-channel handler failed on %r", message)
            return ErrorReply(f"{type(exc).__name__}: {exc}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class SideChannelClient:
    """Blocking request/reply to P workers, one cached REQ socket per endpoint. Not thread-safe: one per thread.

    Every request is idempotent (a repeated claim refreshes the same lease, a repeated release is ignored), so a
    request that gets no answer is sent again on a fresh socket, up to ``attempts`` times within ``timeout``: a
    message stuck on a dead connection then costs a fraction of the budget instead of the whole transfer.
    """

    def __init__(self, timeout: float, attempts: int = 3) -> None:
        self.attempts = max(1, attempts)
        self.timeout_ms = max(100, int(timeout * 1000 / self.attempts))
        self._ctx = zmq.Context()
        self._socks: dict[str, zmq.Socket] = {}

    def request(self, host: str, port: int, message: Request) -> Reply:
        endpoint = f"tcp://{host}:{port}"
        error: Exception | None = None
        for _ in range(self.attempts):
            try:
                return self._once(endpoint, message)
            except zmq.ZMQError as exc:
                self._drop(endpoint)
                error = exc
        raise SideChannelError(
            f"no answer from {endpoint} in {self.attempts} attempts of {self.timeout_ms} ms: {error}"
        ) from error

    def _once(self, endpoint: str, message: Request) -> Reply:
        sock = self._socks.get(endpoint)
        if sock is None:
            sock = self._ctx.socket(zmq.REQ)
            for opt, value in ((zmq.LINGER, 0), (zmq.RCVTIMEO, self.timeout_ms), (zmq.SNDTIMEO, self.timeout_ms)):
                sock.setsockopt(opt, value)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        sock.send(protocol.encode(message))
        data = sock.recv()
        try:
            reply = protocol.decode_reply(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._drop(endpoint)
            raise SideChannelError(f"undecodable reply from {endpoint}: {exc}") from exc
        if isinstance(reply, ErrorReply):
            raise SideChannelError(f"{endpoint} answered with an error: {reply.message}")
        return reply

    def _drop(self, endpoint: str) -> None:
        sock = self._socks.pop(endpoint, None)
        if sock is not None:
            sock.close(linger=0)

    def close(self) -> None:
        for endpoint in list(self._socks):
            self._drop(endpoint)
        self._ctx.term()
