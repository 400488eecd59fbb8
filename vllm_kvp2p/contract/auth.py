"""The optional shared secret: signed ``kv_transfer_params`` and an authenticated side channel. Pure: the clock
is passed in, nothing here does I/O.

With a secret (``VLLM_KVP2P_SECRET`` or ``VLLM_KVP2P_SECRET_FILE``, see vllm_kvp2p/contract/config.py):

* P signs the params it issues (:meth:`Authenticator.sign_params`): HMAC-SHA256 over every field D uses, P's
  incarnation and an expiry. D checks them (:meth:`Authenticator.params_problem`) before it plans anything, so
  params a client made up, changed or kept too long never make D contact an address.
* Every side-channel frame, both ways, is sealed (:class:`Sealed`): HMAC-SHA256 over a timestamp, a random nonce
  and the message. P opens requests only within ``clock_skew`` of its clock and never twice (nonces are kept
  for the window, see :class:`ReplayGuard`); a reply is bound to the nonce of the request it answers, so replies
  cannot be replayed or moved to another request either.

Each use has its own key, derived from the secret with HMAC (a key for params cannot open a frame, a request
cannot pass for a reply). Only the standard library's ``hmac``, ``hashlib`` and ``secrets``.
"""

from __future__ import annotations

import hashlib
import heapq
import hmac
import re
import secrets

import msgspec

from vllm_kvp2p.contract.protocol import RemotePrefill

MIN_SECRET_BYTES = 16
NONCE_BYTES = 16
MAC_BYTES = 32
_HEX_MAC = re.compile(r"[0-9a-f]{64}")
MAX_NONCES = 1 << 16  # replay-window memory of one side channel (messages within 2 * clock_skew)


class AuthError(ValueError):
    """A frame or params failed authentication; the message says why (for the log and the metrics)."""


class Sealed(msgspec.Struct, frozen=True, array_like=True):
    """One authenticated side-channel frame."""

    ts_ms: int  # sender's wall clock, milliseconds since the epoch
    nonce: bytes
    body: bytes  # the msgpack-encoded protocol message
    mac: bytes


_sealed_decoder = msgspec.msgpack.Decoder(Sealed)
_encoder = msgspec.msgpack.Encoder()


def _subkey(secret: bytes, purpose: str) -> bytes:
    return hmac.new(secret, b"vllm-kvp2p/v1/" + purpose.encode(), hashlib.sha256).digest()


class ReplayGuard:
    """Nonces of the frames accepted within the window, and a floor: a frame stamped at or before the floor is
    refused. Invariant: every frame ever accepted is either remembered or stamped at or before the floor, so no
    frame opens twice, however much is forgotten.

    Frames are forgotten oldest timestamp first (a heap), when they leave the window or to make room
    (``capacity``), and the floor becomes the forgotten frame's timestamp. So the floor only ever rises to a
    timestamp at or before this clock's ``now_ms``: a frame stamped in the future (a peer's clock ahead, within
    ``clock_skew``) is forgotten last, and cannot lift the floor past now and lock out every synced peer, as one
    such frame forgotten in arrival order did. When the table is full, the oldest of its frames and the new one is
    forgotten (the new one itself, accepted, if it is the oldest); if even that one is stamped after now, the new
    frame is refused ("replay window full") rather than let the floor pass now. That takes ``capacity`` frames
    stamped ahead, all from holders of the secret, refuses only frames stamped ahead too, and lasts at most until
    now reaches the oldest of them. O(log capacity) per frame."""

    def __init__(self, window_ms: int, capacity: int = MAX_NONCES) -> None:
        self.window_ms = window_ms
        self.capacity = max(1, capacity)
        self._by_age: list[tuple[int, bytes]] = []  # (timestamp, nonce) of the remembered frames, a min-heap
        self._nonces: set[bytes] = set()  # the same frames' nonces, for the replay check
        self._floor_ms = -1  # refuse timestamps <= this (frames forgotten, so perhaps accepted before)

    def check_and_remember(self, nonce: bytes, ts_ms: int, now_ms: int) -> str:
        while self._by_age and self._by_age[0][0] < now_ms - self.window_ms:
            self._forget_oldest()
        if ts_ms <= self._floor_ms:
            return "timestamp older than the replay window still remembers"
        if nonce in self._nonces:
            return "replayed nonce"
        if len(self._nonces) >= self.capacity and min(self._by_age[0][0], ts_ms) > now_ms:
            return "replay window full (of frames stamped ahead of this clock)"
        heapq.heappush(self._by_age, (ts_ms, nonce))
        self._nonces.add(nonce)
        while len(self._nonces) > self.capacity:
            self._forget_oldest()  # stamped at or before now (checked above): perhaps the new frame itself
        return ""

    def _forget_oldest(self) -> None:
        ts_ms, nonce = heapq.heappop(self._by_age)
        self._nonces.discard(nonce)
        self._floor_ms = max(self._floor_ms, ts_ms)

    def __len__(self) -> int:
        return len(self._nonces)


class Authenticator:
    """Signs and checks params, seals and opens side-channel frames, with one shared secret."""

    def __init__(self, secret: bytes, clock_skew: float) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"the shared secret has {len(secret)} bytes; at least {MIN_SECRET_BYTES} are needed")
        self._params_key = _subkey(secret, "params")
        self._request_key = _subkey(secret, "side-channel/request")
        self._reply_key = _subkey(secret, "side-channel/reply")
        self.skew_ms = int(clock_skew * 1000)

    # ------------------------------------------------------------------ kv_transfer_params

    def sign_params(self, remote: RemotePrefill, expires_ms: int) -> RemotePrefill:
        unsigned = msgspec.structs.replace(remote, expires_ms=expires_ms, mac="")
        return msgspec.structs.replace(unsigned, mac=self._params_mac(unsigned))

    def params_problem(self, remote: RemotePrefill, now_ms: int) -> str:
        """Why D must not use these params ("" if they are P's, unchanged and not expired)."""
        if not remote.mac:
            return "kv_transfer_params are not signed (this D has a shared secret)"
        if not _HEX_MAC.fullmatch(remote.mac):  # before comparing: compare_digest refuses non-ASCII text
            return "kv_transfer_params signature is malformed (not 64 hex digits)"
        expected = self._params_mac(msgspec.structs.replace(remote, mac=""))
        if not hmac.compare_digest(expected.encode(), remote.mac.encode()):
            return "kv_transfer_params signature does not match (changed, or signed with another secret)"
        if now_ms > remote.expires_ms + self.skew_ms:
            return (f"kv_transfer_params expired {(now_ms - remote.expires_ms) / 1000:.1f} s ago "
                    f"(clock_skew allows {self.skew_ms / 1000:g} s)")
        return ""

    def _params_mac(self, unsigned: RemotePrefill) -> str:
        # msgpack of the struct: every field in declaration order, so nothing D uses is left out.
        return hmac.new(self._params_key, _encoder.encode(unsigned), hashlib.sha256).hexdigest()

    # ------------------------------------------------------------------ side channel

    def seal_request(self, body: bytes, now_ms: int) -> tuple[bytes, bytes]:
        """The frame to send, and its nonce (to open the reply with)."""
        nonce = secrets.token_bytes(NONCE_BYTES)
        return self._seal(self._request_key, b"", body, now_ms, nonce), nonce

    def open_request(self, frame: bytes, now_ms: int, guard: ReplayGuard) -> tuple[bytes, bytes]:
        """The request's body and nonce; raises :class:`AuthError` (with no other effect) if it fails."""
        sealed = self._open(self._request_key, b"", frame, now_ms)
        problem = guard.check_and_remember(sealed.nonce, sealed.ts_ms, now_ms)
        if problem:
            raise AuthError(problem)
        return sealed.body, sealed.nonce

    def seal_reply(self, body: bytes, request_nonce: bytes, now_ms: int) -> bytes:
        return self._seal(self._reply_key, request_nonce, body, now_ms, secrets.token_bytes(NONCE_BYTES))

    def open_reply(self, frame: bytes, request_nonce: bytes, now_ms: int) -> bytes:
        return self._open(self._reply_key, request_nonce, frame, now_ms).body

    def _seal(self, key: bytes, bound_to: bytes, body: bytes, now_ms: int, nonce: bytes) -> bytes:
        return _encoder.encode(Sealed(now_ms, nonce, body, _frame_mac(key, bound_to, now_ms, nonce, body)))

    def _open(self, key: bytes, bound_to: bytes, frame: bytes, now_ms: int) -> Sealed:
        try:
            sealed = _sealed_decoder.decode(frame)
        except (msgspec.DecodeError, msgspec.ValidationError):
            raise AuthError("not a sealed frame (the peer has no shared secret, or another protocol)") from None
        if len(sealed.nonce) != NONCE_BYTES or len(sealed.mac) != MAC_BYTES:
            raise AuthError("malformed sealed frame")
        if not hmac.compare_digest(sealed.mac, _frame_mac(key, bound_to, sealed.ts_ms, sealed.nonce, sealed.body)):
            raise AuthError("bad MAC (another secret, or a changed frame)")
        if abs(now_ms - sealed.ts_ms) > self.skew_ms:
            raise AuthError(f"timestamp {abs(now_ms - sealed.ts_ms) / 1000:.1f} s off this clock (clock_skew "
                            f"{self.skew_ms / 1000:g} s)")
        return sealed


def _frame_mac(key: bytes, bound_to: bytes, ts_ms: int, nonce: bytes, body: bytes) -> bytes:
    return hmac.new(key, _encoder.encode((bound_to, ts_ms, nonce, body)), hashlib.sha256).digest()
