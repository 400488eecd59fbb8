"""ZMQ transport for the side channel: a ROUTER server on each P worker, REQ clients on D workers.

Only bytes move here; :mod:`vllm_kvp2p.contract.protocol` defines what they mean and the server's handler decides what
to
answer. Every call is bounded by a timeout, and a socket that timed out is thrown away (a REQ socket that missed
a reply cannot be reused). With a shared secret (:class:`~vllm_kvp2p.contract.auth.Authenticator`) every frame both ways
is sealed; a request that fails to open reaches no handler (no registration, claim, release or table entry), is
answered with a plain error (:data:`UNAUTHENTICATED_REQUEST`) and counted in :attr:`SideChannelServer.dropped`;
the one exception is an unsealed :class:`~vllm_kvp2p.contract.protocol.Abandon`, which the params it names
authorise (their hold id and mac: the proxy has the params, not the secret) and which is answered unsealed.
A client that gets that error, or a reply that fails to open, raises :class:`Unauthenticated`: the peer is up,
only the secrets (or the clocks) do not agree.
"""

from __future__ import annotations

import socket
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import msgspec
import zmq

from vllm_kvp2p import os_threads
from vllm_kvp2p.contract import protocol
from vllm_kvp2p.contract.auth import Authenticator, AuthError, ReplayGuard
from vllm_kvp2p.contract.protocol import ErrorReply, Reply, Request
from vllm_kvp2p.log import get_logger
from vllm_kvp2p.os_threads import run_named

logger = get_logger(__name__)

#: Largest request frame P accepts: requests are a few hundred bytes; ZMQ drops the connection of a peer that
#: sends more, before any of it is buffered.
MAX_REQUEST_BYTES = 64 << 10
#: Largest reply D accepts, sealed. The largest real one is a registration: 23.8 KB for Llama-3.1-405B with an
#: EAGLE draft (254 planes), 21.1 KB for Nemotron-H-56B, 4.7 KB for DeepSeek-V3/R1; one at every bound of
#: protocol.py's types is 490 KB, a rank table of MAX_ENGINE_RANKS ranks 268 KB (benchmarks/bench_peer_messages.py).
#: ZMQ drops the connection of a bigger frame while reading its header, before it buffers any of it; D's pull
#: then fails at once (:class:`ReplyDropped`). Was 64 MiB: a reply of planes decoded to 0.93 GiB in 1.4 s, on a
#: pull thread of the process that holds the model; the costliest valid reply now decodes in ~5 ms to ~2 MiB.
MAX_REPLY_BYTES = 512 << 10
#: Deferred answers (a handler returned a Future) waiting at once; a request deferred beyond them gets an error. A
#: request whose handler returns a Future already waiting (the same request resent: vllm_kvp2p/prefill/hold_service.py
#: answers copies of one release with one Future) takes no second slot: it joins that answer's copies.
MAX_DEFERRED = 1024
#: Copies of one request waiting for one deferred answer: D's client sends a request at most 3 times, each on a
#: fresh socket, and waits on the newest. Beyond this the oldest copy is forgotten, unanswered (its sender gave up
#: on that socket), and counted ``dropped["resent_copy_dropped"]``: a peer resending one request 1,100 times holds
#: one slot and this many copies, not 1,100 slots (which filled the table and failed other readers' releases).
MAX_COPIES = 4


@dataclass(frozen=True)
class Unsealed:
    """What a server with a shared secret hands its handler for an unsealed
    :class:`~vllm_kvp2p.contract.protocol.Abandon`
    (the one request it takes unsealed): the handler knows its sender proved nothing but the params it names."""

    message: protocol.Abandon


def endpoint(host: str, port: int) -> str:
    """ZMQ's address of ``host:port``; an IPv6 address goes in brackets."""
    return f"tcp://[{host.strip('[]')}]:{port}" if ":" in host else f"tcp://{host}:{port}"


def _now_ms() -> int:
    return time.time_ns() // 1_000_000  # wall clock: it is compared with the peer's


class SideChannelError(RuntimeError):
    """A side-channel peer could not be reached or answered nonsense."""


class ReplyDropped(zmq.ZMQError):
    """P's connection closed while D waited for its reply: ZMQ drops a reply over :data:`MAX_REPLY_BYTES` that
    way (its header says so before any of it is read), and a P that stopped or dropped D's request too."""

    def __init__(self, endpoint: str) -> None:
        super().__init__(msg=f"{endpoint} closed the connection before its reply arrived: a reply over D's "
                             f"{MAX_REPLY_BYTES >> 10} KiB bound (side_channel.MAX_REPLY_BYTES; a real registration "
                             f"is under 32 KiB), a request over P's {MAX_REQUEST_BYTES >> 10} KiB, or P stopped")


class PeerError(SideChannelError):
    """The peer answered with an error (:class:`~vllm_kvp2p.contract.protocol.ErrorReply`): it is up, but did not
    handle this
    request (a P of an older release also answers a release this way while its table of deferred answers is full:
    "try again"). Not a peer that did not answer."""


class BadReply(SideChannelError):
    """The peer answered, but with a reply this side cannot decode: not the protocol's, or over a bound of its
    types. It is up: what differs is its version or its honesty. (A reply over the frame bound is dropped by ZMQ
    unread, which looks like a peer that stopped: :class:`ReplyDropped`.)"""


class PeerRefused(SideChannelError):
    """Nothing listens at the peer's address (connection refused): the process is gone, not slow."""


class Unauthenticated(SideChannelError):
    """The peer answered, but the shared-secret authentication failed: it refused this request's (the secret
    differs, this client has none, or the clocks differ by more than clock_skew), or its reply failed to open
    here (it has no secret or another one, or the clocks differ). The peer is up: retrying cannot help."""


#: How a server's plain error reply to a request that failed authentication begins (clients recognise it).
UNAUTHENTICATED_REQUEST = "unauthenticated request"


#: How long the plain TCP probe that tells a dead peer from a slow one may take.
PROBE_TIMEOUT_S = 0.5
#: REQ sockets a client keeps open (one per P rank endpoint; the least recently used is closed beyond it).
MAX_SOCKETS = 256


def probe(host: str, port: int, timeout: float = PROBE_TIMEOUT_S) -> bool | None:
    """Whether something accepts TCP connections at ``host:port``: False when refused (a dead process: the
    kernel answers at once), None when unknown within ``timeout`` (a cut-off host; a frozen process still
    accepts). ZMQ's REQ sockets hide refusals and reconnect silently, so this is asked separately."""
    try:
        with socket.create_connection((host.strip("[]"), port), timeout=timeout):
            return True
    except ConnectionRefusedError:
        return False
    except OSError:
        return None


class SideChannelServer:
    """Answers side-channel requests on ``tcp://host:port`` from a daemon thread. A handler answers at once (a
    :class:`Reply`) or later (a ``Future`` of one, set from any thread): the thread meanwhile serves other
    requests and sends that answer when it is set (at most :data:`MAX_DEFERRED` answers waiting; a handler that
    returns the same Future for copies of one request has them share one, each copy answered)."""

    def __init__(
        self, host: str, port: int, handler: Callable[[Request | Unsealed], Reply | Future[Reply]], *,
        setting: str = "",
        auth: Authenticator | None = None,
    ) -> None:
        self.address = endpoint(host, port)
        self._handler = handler
        self._auth = auth
        self._replays = ReplayGuard(2 * auth.skew_ms) if auth is not None else None
        self.dropped: Counter[str] = Counter()  # requests not handled, by reason (read by the metrics)
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        # Only for an IPv6 address: with it an IPv4 one would be bound as an IPv4-mapped IPv6 socket.
        self._sock.setsockopt(zmq.IPV6, int(":" in host))
        self._sock.setsockopt(zmq.MAXMSGSIZE, MAX_REQUEST_BYTES)
        try:
            self._sock.bind(self.address)
        except zmq.ZMQError as exc:
            self._sock.close()
            self._ctx.term()
            hint = f" (set by {setting})" if setting else ""
            raise SideChannelError(
                f"cannot listen on side-channel port {port} at {host}{hint}: {exc}. "
                "Another instance or rank uses it: give each instance on a host its own VLLM_KVP2P_SIDE_CHANNEL_PORT "
                "(kv_connector_extra_config side_channel_port), leaving dp_size * pp_size * tp_size ports between them."
            ) from exc
        # Each deferred answer and the requests waiting for it, oldest first: (peer identity, nonce to seal with).
        self._deferred: dict[Future[Reply], list[tuple[bytes, bytes]]] = {}
        self._wake_r, self._wake_w = socket.socketpair()  # a byte written when a deferred answer is set
        for end in (self._wake_r, self._wake_w):
            end.setblocking(False)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=run_named(os_threads.SIDE_CHANNEL, self._serve),
                                        name=f"kvp2p-side-channel:{port}", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        poller.register(self._wake_r, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(100))
            if self._wake_r in ready or self._wake_r.fileno() in ready:
                try:
                    self._wake_r.recv(4096)
                except OSError:
                    pass
            if self._deferred:
                self._send_deferred()
            if self._sock not in ready:
                continue
            try:
                frames = self._sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                continue
            if len(frames) < 2:
                continue
            identity, payload = frames[0], frames[-1]
            answer = self._answer(payload)
            if isinstance(answer, bytes):
                self._send(identity, answer)
            else:
                self._wait_for(answer[0], identity, answer[1])
        self._sock.close()
        self._ctx.term()
        self._wake_r.close()
        self._wake_w.close()

    def _send(self, identity: bytes, data: bytes) -> None:
        try:
            self._sock.send_multipart([identity, b"", data], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            logger.warning("side channel %s could not reply: %s", self.address, exc)

    def _wake(self, _: Future[Reply]) -> None:
        try:
            self._wake_w.send(b"\0")
        except OSError:  # full (the thread has bytes to read already) or closed (the server stopped)
            pass

    def _wait_for(self, future: Future[Reply], identity: bytes, nonce: bytes) -> None:
        """File a request under its deferred answer: a new slot, or one more copy of a request already waiting."""
        copies = self._deferred.get(future)
        if copies is None:
            self._deferred[future] = [(identity, nonce)]
            future.add_done_callback(self._wake)
            return
        copies.append((identity, nonce))
        if len(copies) > MAX_COPIES:
            del copies[0]
            self.dropped["resent_copy_dropped"] += 1

    def _send_deferred(self) -> None:
        for future in [f for f in self._deferred if f.done()]:
            try:
                reply = future.result()
            except Exception as exc:  # noqa: BLE001 - as a handler that raised
                logger.error("side-channel deferred answer failed: %s: %s", type(exc).__name__, exc)
                self.dropped["handler_error"] += 1
                reply = _error(f"{type(exc).__name__}: {exc}")
            for identity, nonce in self._deferred.pop(future):
                self._send(identity, self._sealed(reply, nonce))

    def _answer(self, payload: bytes) -> bytes | tuple[Future[Reply], bytes]:
        """The reply frame for one request frame, or the handler's deferred answer and the nonce to seal it with."""
        nonce = b""
        if self._auth is not None:
            assert self._replays is not None
            try:
                payload, nonce = self._auth.open_request(payload, _now_ms(), self._replays)
            except AuthError as exc:
                abandon = _plain_abandon(payload)
                if abandon is not None:  # authorised by the params it names (protocol.Abandon), answered unsealed
                    return self._plain_answer(abandon)
                self.dropped["unauthenticated"] += 1
                count = self.dropped["unauthenticated"]
                if count in (1, 10, 100, 1000) or count % 10000 == 0:  # a flood must not flood the log
                    logger.warning("side channel %s dropped %d unauthenticated request(s), latest: %s (peers need "
                                   "the same VLLM_KVP2P_SECRET and clocks within clock_skew)", self.address, count, exc)
                return protocol.encode(ErrorReply(f"{UNAUTHENTICATED_REQUEST}: {exc}"))
        try:
            message = protocol.decode_request(payload)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self.dropped["undecodable"] += 1
            reply: Reply | Future[Reply] = ErrorReply(f"undecodable request: {str(exc)[:200]}")
        else:
            try:
                reply = self._handler(message)
            except Exception as exc:  # a handler bug must not kill the server thread
                logger.exception("side-channel handler failed on %s", type(message).__name__)
                self.dropped["handler_error"] += 1
                reply = _error(f"{type(exc).__name__}: {exc}")
        if isinstance(reply, Future):
            if reply in self._deferred or len(self._deferred) < MAX_DEFERRED:  # a copy takes no slot of its own
                return reply, nonce
            self.dropped["deferred_full"] += 1
            reply = ErrorReply(f"{MAX_DEFERRED} requests already waiting for their answers: try again")
        return self._sealed(reply, nonce)

    def _plain_answer(self, abandon: protocol.Abandon) -> bytes:
        """An unsealed :class:`~vllm_kvp2p.contract.protocol.Abandon` (its sender has the params, not the secret):
        handled
        at once, answered unsealed."""
        try:
            reply = self._handler(Unsealed(abandon))
        except Exception as exc:  # a handler bug must not kill the server thread
            logger.exception("side-channel handler failed on an unsealed Abandon")
            self.dropped["handler_error"] += 1
            reply = _error(f"{type(exc).__name__}: {exc}")
        if isinstance(reply, Future):  # an abandon is never deferred; a handler that did is a bug
            reply = _error("an abandon's answer was deferred")
        return protocol.encode(reply)

    def _sealed(self, reply: Reply, nonce: bytes) -> bytes:
        data = protocol.encode(reply)
        return self._auth.seal_reply(data, nonce, _now_ms()) if self._auth is not None else data

    def close(self) -> None:
        self._stop.set()
        self._thread.join(timeout=5)


class SideChannelClient:
    """Blocking request/reply to P workers, one cached REQ socket per endpoint. Not thread-safe: one per thread.

    Every request is idempotent (a repeated claim with the same claim id gets the same lease back, a repeated
    release is ignored), so a request that gets no answer is sent again on a fresh socket, up to ``attempts`` times
    within ``timeout``: a message stuck on a dead connection then costs a fraction of the budget instead of the
    whole transfer.
    """

    def __init__(self, timeout: float, attempts: int = 3, *, auth: Authenticator | None = None) -> None:
        self.attempts = max(1, attempts)
        self.timeout = timeout
        self._auth = auth
        self._ctx = zmq.Context()
        self._socks: OrderedDict[str, zmq.Socket] = OrderedDict()  # most recently used last, MAX_SOCKETS at most
        # Each socket's disconnections: how a reply over MAX_REPLY_BYTES shows (ZMQ drops it and the connection).
        self._monitors: dict[str, zmq.Socket] = {}

    @property
    def open_sockets(self) -> int:
        return len(self._socks)

    def request(self, host: str, port: int, message: Request, timeout: float | None = None,
                meanwhile: Callable[[], None] | None = None) -> Reply:
        """``timeout`` (at most the client's own) bounds this call: all attempts and probes together.
        ``meanwhile`` runs once, right after the message first went out (work that overlaps P's answer)."""
        address = endpoint(host, port)
        budget = self.timeout if timeout is None else min(timeout, self.timeout)
        deadline = time.monotonic() + budget
        # The first attempt is short: a peer that just died may still accept the connection for a moment, and
        # the probe after a missed answer then tells it at once. A slow peer only gets the message resent.
        first_ms = int(min(budget, PROBE_TIMEOUT_S) * 1000) if self.attempts > 1 else int(budget * 1000)
        rest_ms = max(100, (int(budget * 1000) - first_ms) // max(1, self.attempts - 1))
        error: Exception | None = None
        if address not in self._socks:
            self._refuse_if_dead(host, port, address, deadline)
        pending = [meanwhile] if meanwhile is not None else []

        def once() -> None:  # after the first send that went out, whichever attempt that was
            if pending:
                pending.pop()()

        tried = 0
        for attempt in range(self.attempts):
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms < 50 and tried:
                break
            tried += 1
            try:
                return self._once(address, message, max(50, min(first_ms if attempt == 0 else rest_ms, left_ms)),
                                  once)
            except zmq.ZMQError as exc:
                self._drop(address)
                error = exc
                self._refuse_if_dead(host, port, address, deadline)
        if isinstance(error, ReplyDropped):
            raise SideChannelError(f"no reply from {address} in {tried} attempts: {error}") from error
        raise SideChannelError(
            f"no answer from {address} in {tried} attempts within {budget * 1000:.0f} ms: {error}"
        ) from error

    @staticmethod
    def _refuse_if_dead(host: str, port: int, address: str, deadline: float) -> None:
        """A new connection, or an attempt that got no answer: if nothing listens there, say so now instead of
        waiting out the other attempts. The probe takes its time from the request's budget."""
        left = deadline - time.monotonic()
        if left > 0.01 and probe(host, port, min(PROBE_TIMEOUT_S, left)) is False:
            raise PeerRefused(f"connection refused by {address}: no side channel listens there (P is not running)")

    def _once(self, endpoint: str, message: Request, timeout_ms: int,
              meanwhile: Callable[[], None] | None = None) -> Reply:
        sock = self._socks.get(endpoint)
        if sock is not None:
            self._socks.move_to_end(endpoint)
        else:
            while len(self._socks) >= MAX_SOCKETS:  # each is a descriptor and a reconnecting ZMQ pipe
                self._drop(next(iter(self._socks)))
            sock = self._ctx.socket(zmq.REQ)
            for opt, value in ((zmq.LINGER, 0), (zmq.IPV6, int("[" in endpoint)), (zmq.MAXMSGSIZE, MAX_REPLY_BYTES)):
                sock.setsockopt(opt, value)
            monitor = self._monitors[endpoint] = sock.get_monitor_socket(zmq.EVENT_DISCONNECTED)
            monitor.setsockopt(zmq.LINGER, 0)
            sock.connect(endpoint)
            self._socks[endpoint] = sock
        monitor = self._monitors[endpoint]
        while monitor.poll(0):  # a connection closed before this request is not this request's
            monitor.recv_multipart()
        for opt in (zmq.RCVTIMEO, zmq.SNDTIMEO):
            sock.setsockopt(opt, timeout_ms)
        data = protocol.encode(message)
        nonce = b""
        if self._auth is not None:
            data, nonce = self._auth.seal_request(data, _now_ms())
        sock.send(data)
        if meanwhile is not None:
            meanwhile()
        poller = zmq.Poller()
        poller.register(sock, zmq.POLLIN)
        poller.register(monitor, zmq.POLLIN)
        ready = dict(poller.poll(timeout_ms))
        if sock not in ready:
            raise ReplyDropped(endpoint) if monitor in ready else zmq.Again()
        data = sock.recv(zmq.NOBLOCK)
        if self._auth is not None:
            try:
                data = self._auth.open_reply(data, nonce, _now_ms())
            except AuthError as exc:
                self._drop(endpoint)
                said = _plain_error(data)
                if said.startswith(UNAUTHENTICATED_REQUEST):
                    raise Unauthenticated(f"{endpoint} refused this request's authentication ({said}): the "
                                          "shared secret differs between P and D, or their clocks by more than "
                                          "clock_skew") from exc
                raise Unauthenticated(f"the reply from {endpoint} failed authentication here ({exc}"
                                      f"{'; it says: ' + said if said else ''}): P has no shared secret or another "
                                      "one, or the clocks differ by more than clock_skew") from exc
        try:
            reply = protocol.decode_reply(data)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            self._drop(endpoint)
            raise BadReply(f"undecodable reply from {endpoint}: {exc}") from exc
        if isinstance(reply, ErrorReply):
            if reply.message.startswith(UNAUTHENTICATED_REQUEST):
                raise Unauthenticated(f"{endpoint} requires the shared secret and this client has none "
                                      f"({reply.message[:200]}): set the same VLLM_KVP2P_SECRET on every P and D")
            raise PeerError(f"{endpoint} answered with an error: {reply.message[:500]}")
        return reply

    def _drop(self, endpoint: str) -> None:
        sock = self._socks.pop(endpoint, None)
        monitor = self._monitors.pop(endpoint, None)
        if sock is not None:
            sock.disable_monitor()
            sock.close(linger=0)
        if monitor is not None:
            monitor.close(linger=0)

    def close(self) -> None:
        for endpoint in list(self._socks):
            self._drop(endpoint)
        self._ctx.term()


def _error(text: str) -> ErrorReply:
    """A server's own error, cut to what a client decodes (protocol.MAX_REASON_LENGTH)."""
    return ErrorReply(text[: protocol.MAX_REASON_LENGTH])


def _plain_abandon(data: bytes) -> protocol.Abandon | None:
    """The frame as an unsealed :class:`~vllm_kvp2p.contract.protocol.Abandon`, else None (nothing else is taken
    unsealed)."""
    try:
        return protocol.decode_abandon(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return None


def _plain_error(data: bytes) -> str:
    """What an unsealed error reply says (a P without the secret, or one that refused ours), else ""."""
    try:
        reply = protocol.decode_reply(data)
    except (msgspec.DecodeError, msgspec.ValidationError):
        return ""
    return reply.message[:200] if isinstance(reply, ErrorReply) else ""
