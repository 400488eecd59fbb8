"""The shared secret (vllm_kvp2p/contract/auth.py, config): signed params and sealed side-channel frames. Pure, no I/O.
Every refusal is paired with the same input passing without the defence, so each check can fail."""

from __future__ import annotations

from collections import OrderedDict

import msgspec
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tests.support.prompts import prompt, remote, tokens
from vllm_kvp2p.contract.auth import MAX_NONCES, Authenticator, AuthError, ReplayGuard, Sealed
from vllm_kvp2p.contract.config import ConfigError, KVP2PConfig
from vllm_kvp2p.contract.protocol import RemotePrefill, prompt_digest
from vllm_kvp2p.lifecycle.admission import Admitted, Decoder, Refused, address_problem, judge
from vllm_kvp2p.lifecycle.consumer import ConsumerSchedule, Failure
from vllm_kvp2p.transfer.kv_groups import single_full_group

SECRET = b"0123456789abcdef-test-secret"
NOW = 1_800_000_000_000  # ms
BS = 16
PROMPT = 60


def auth(secret: bytes = SECRET, skew: float = 30.0) -> Authenticator:
    return Authenticator(secret, skew)


def issued(expires_ms: int = NOW + 120_000) -> RemotePrefill:
    made = remote([[10, 11, 12, 13]], PROMPT, BS, host="10.0.0.7", port=20000, remote_incarnation="inc1")
    return auth().sign_params(made, expires_ms)


def unchecked(params: dict) -> object:
    """The verdict on params without the secret's check (what D would do without the defence)."""
    return judge(params, prompt(PROMPT), Decoder(BS, single_full_group(BS)))


def test_signed_params_survive_the_json_round_trip_through_proxies() -> None:
    import json

    params = json.loads(json.dumps(issued().to_params()))
    remote = RemotePrefill.from_params(params)
    assert remote is not None and auth().params_problem(remote, NOW) == ""


@pytest.mark.parametrize(("change", "expected"), [
    ({"remote_host": "10.6.6.6"}, "signature does not match"),
    ({"remote_port": 20001}, "signature does not match"),
    ({"remote_block_ids": [[10, 11, 12, 14]]}, "signature does not match"),
    ({"remote_num_tokens": 59, "remote_prompt_digest": prompt_digest(tokens(59))}, "signature does not match"),
    ({"remote_prompt_digest": prompt_digest(tokens(PROMPT, seed=9))}, "signature does not match"),
    ({"tp_size": 2}, "signature does not match"),
    ({"remote_incarnation": "inc2"}, "signature does not match"),
    ({"expires_ms": NOW + 10**9}, "signature does not match"),
    ({"mac": ""}, "not signed"),
])
def test_any_change_to_signed_params_is_refused(change: dict, expected: str) -> None:
    tampered = RemotePrefill.from_params({**issued().to_params(), **change})
    assert tampered is not None
    assert expected in auth().params_problem(tampered, NOW)
    # Without the defence D would use them: they are valid params in every other respect.
    if "remote_prompt_digest" not in change or "remote_num_tokens" in change:
        assert isinstance(unchecked(tampered.to_params()), Admitted)


@pytest.mark.parametrize("mac", ["é" * 64, "\ud800" * 64, "A" * 64, "0" * 63, "0" * 65, "\u0660" * 64],
                         ids=["latin", "surrogate", "upper-hex", "short", "long", "arabic-digits"])
def test_a_malformed_signature_is_refused_without_an_exception(mac: str) -> None:
    """compare_digest raises TypeError for non-ASCII str: the format is checked first, whatever a client sends."""
    params = {**issued().to_params(), "mac": mac}
    verdict = judge(params, prompt(PROMPT), Decoder(BS, single_full_group(BS)),
                    lambda r: auth().params_problem(r, NOW))
    assert isinstance(verdict, Refused) and verdict.failure in (Failure.UNAUTHENTICATED, Failure.INVALID_PARAMS)
    assert not verdict.contact_p
    with pytest.raises(TypeError):  # the hole the format check closes
        import hmac

        hmac.compare_digest("é" * 64, "a" * 64)


def test_params_expire_after_their_expiry_plus_the_clock_skew() -> None:
    remote = issued(expires_ms=NOW)
    assert auth(skew=5).params_problem(remote, NOW + 5_000) == ""
    assert "expired 10.0 s ago" in auth(skew=5).params_problem(remote, NOW + 10_000)


def test_params_signed_with_another_secret_are_refused() -> None:
    other = Authenticator(b"another-secret-of-enough-bytes", 30).sign_params(issued(), NOW + 1000)
    assert "signature does not match" in auth().params_problem(other, NOW)


def test_unauthenticated_params_make_d_contact_no_one() -> None:
    forged = {**issued().to_params(), "remote_host": "10.6.6.6"}
    a = auth()
    schedule = ConsumerSchedule(BS, authenticate=lambda r: a.params_problem(r, NOW))
    assert schedule.matched_tokens("d1", forged, prompt(PROMPT), 0) == (PROMPT - 1, True)  # vLLM's policy ends it
    plan = schedule.on_alloc("d1", forged, PROMPT - 1, [[1, 2, 3, 4]], 0, prompt(PROMPT))
    assert plan is not None and not plan.contact_p and plan.error.startswith("unauthenticated kv_transfer_params")
    assert plan.failure is Failure.UNAUTHENTICATED
    assert schedule.on_finished("d2", forged, prompt(PROMPT)) is None  # no release to the forged address either
    # Without the defence the same params plan a pull from 10.6.6.6.
    open_schedule = ConsumerSchedule(BS)
    open_plan = open_schedule.on_alloc("d1", forged, PROMPT - 1, [[1, 2, 3, 4]], 0, prompt(PROMPT))
    assert open_plan is not None and open_plan.contact_p and not open_plan.error


def test_one_admission_checks_the_signature_once() -> None:
    """vLLM calls matched_tokens then on_alloc in one scheduler pass, and again in later passes: the HMAC is checked
    once per request."""
    params = issued().to_params()
    a, calls = auth(), []

    def authenticate(remote: RemotePrefill) -> str:
        calls.append(remote.remote_request_id)
        return a.params_problem(remote, NOW)

    schedule = ConsumerSchedule(BS, authenticate=authenticate)
    assert schedule.matched_tokens("d1", params, prompt(PROMPT), 0) == (PROMPT, True)
    plan = schedule.on_alloc("d1", params, PROMPT, [[1, 2, 3, 4]], 0, prompt(PROMPT))
    assert plan is not None and plan.contact_p and not plan.error
    assert len(calls) == 1
    schedule.take_plans()
    assert schedule.on_finished("d1", params, prompt(PROMPT)) is None  # d1 done: d2 is no follower of its hold
    # The verdict is the request's, kept until it ends (lifecycle/consumer.py's Admission): later passes do not
    # check again, and a plan is made of the params that verdict checked. Another request is checked on its own.
    forged = {**params, "remote_host": "10.6.6.6"}
    assert schedule.matched_tokens("d2", forged, prompt(PROMPT), 0) == (PROMPT - 1, True)
    schedule.take_plans()
    plan = schedule.on_alloc("d2", forged, PROMPT - 1, [[1, 2, 3, 4]], 0, prompt(PROMPT))
    assert plan is not None and plan.failure is Failure.UNAUTHENTICATED and not plan.contact_p
    assert len(calls) == 2
    assert schedule.matched_tokens("d3", params, prompt(PROMPT), 0) == (PROMPT, True)
    schedule.take_plans()
    plan = schedule.on_alloc("d3", params, PROMPT, [[5, 6, 7, 8]], 0, prompt(PROMPT))
    assert plan is not None and not plan.error and len(calls) == 3


# --------------------------------------------------------------------------- side-channel frames


def test_a_sealed_request_opens_once() -> None:
    a, guard = auth(), ReplayGuard(60_000)
    frame, nonce = a.seal_request(b"body", NOW)
    assert a.open_request(frame, NOW + 10, guard) == (b"body", nonce)
    with pytest.raises(AuthError, match="replayed nonce"):
        a.open_request(frame, NOW + 20, guard)


@pytest.mark.parametrize("how", ["plain", "other-secret", "changed-body", "stale", "future", "reply-as-request",
                                 "garbage"])
def test_frames_that_must_not_open(how: str) -> None:
    a, guard = auth(skew=5), ReplayGuard(10_000)
    frame, _ = a.seal_request(b"body", NOW)
    sealed = msgspec.msgpack.decode(frame, type=Sealed)
    frames = {
        "plain": b"\x81\xa4type\xa7release",
        "other-secret": Authenticator(b"another-secret-of-enough-bytes", 5).seal_request(b"body", NOW)[0],
        "changed-body": msgspec.msgpack.encode(msgspec.structs.replace(sealed, body=b"bodz")),
        "stale": a.seal_request(b"body", NOW - 6_000)[0],
        "future": a.seal_request(b"body", NOW + 6_000)[0],
        "reply-as-request": a.seal_reply(b"body", b"", NOW),
        "garbage": b"\xff" * 64,
    }
    with pytest.raises(AuthError):
        a.open_request(frames[how], NOW, guard)
    assert len(guard) == 0  # nothing remembered for a frame that did not open


def test_a_reply_is_bound_to_its_request() -> None:
    a = auth()
    _, nonce1 = a.seal_request(b"q1", NOW)
    _, nonce2 = a.seal_request(b"q2", NOW)
    reply = a.seal_reply(b"answer", nonce1, NOW)
    assert a.open_reply(reply, nonce1, NOW) == b"answer"
    with pytest.raises(AuthError, match="bad MAC"):
        a.open_reply(reply, nonce2, NOW)  # an old reply replayed to a later request


def test_replay_guard_is_bounded_and_never_forgets_into_a_replay() -> None:
    guard = ReplayGuard(window_ms=60_000, capacity=100)
    nonces = [i.to_bytes(16, "big") for i in range(300)]
    for i, n in enumerate(nonces):
        assert guard.check_and_remember(n, NOW + i, NOW + i) == ""
    assert len(guard) == 100
    # The first 200 were forgotten while inside the window: they (and anything as old) are refused, not replayed.
    assert guard.check_and_remember(nonces[0], NOW, NOW + 300) != ""
    assert guard.check_and_remember(nonces[299], NOW + 299, NOW + 300) == "replayed nonce"
    assert guard.check_and_remember(b"n" * 16, NOW + 300, NOW + 300) == ""
    # Old entries leave once they are out of the window.
    assert guard.check_and_remember(b"m" * 16, NOW + 100_000, NOW + 100_000) == ""
    assert len(guard) == 1
    assert MAX_NONCES >= 1 << 16


class ArrivalOrderGuard:
    """The replay guard before: nonces forgotten in arrival order, the floor raised to the forgotten one's stamp."""

    def __init__(self, window_ms: int, capacity: int) -> None:
        self.window_ms, self.capacity = window_ms, capacity
        self._seen: OrderedDict[bytes, int] = OrderedDict()
        self._floor_ms = -1

    def check_and_remember(self, nonce: bytes, ts_ms: int, now_ms: int) -> str:
        while self._seen and next(iter(self._seen.values())) < now_ms - self.window_ms:
            self._seen.popitem(last=False)
        if ts_ms <= self._floor_ms:
            return "timestamp older than the replay window still remembers"
        if nonce in self._seen:
            return "replayed nonce"
        self._seen[nonce] = ts_ms
        while len(self._seen) > self.capacity:
            self._floor_ms = max(self._floor_ms, self._seen.popitem(last=False)[1])
        return ""


@pytest.mark.parametrize("guard_class", [ArrivalOrderGuard, ReplayGuard])
def test_one_frame_stamped_ahead_cannot_lock_out_synced_peers(guard_class: type) -> None:
    """A peer whose clock is 29 s ahead (within clock_skew 30 s: accepted) sends one frame; capacity-many frames of
    synced peers follow. Forgotten in arrival order, the ahead frame lifted the floor 29 s into the future and
    every synced peer was refused for 29 s; forgotten oldest stamp first, the floor stays behind now."""
    a = auth(skew=30)
    guard = guard_class(2 * a.skew_ms, capacity=100)
    ahead, _ = a.seal_request(b"ahead", NOW + 29_000)
    a.open_request(ahead, NOW, guard)
    fresh = [a.seal_request(b"q", NOW + i)[0] for i in range(100)]
    for i, frame in enumerate(fresh):
        a.open_request(frame, NOW + i, guard)
    synced, _ = a.seal_request(b"synced", NOW + 101)
    if guard_class is ArrivalOrderGuard:  # the attack, on the old logic
        with pytest.raises(AuthError, match="older than the replay window"):
            a.open_request(synced, NOW + 101, guard)
        assert guard._floor_ms == NOW + 29_000
        return
    assert a.open_request(synced, NOW + 101, guard)[0] == b"synced"
    assert guard._floor_ms <= NOW + 101 and len(guard) == 100
    # A forgotten nonce (the oldest synced frames made room) is still refused, and so is the remembered one.
    with pytest.raises(AuthError, match="older than the replay window"):
        a.open_request(fresh[0], NOW + 102, guard)
    with pytest.raises(AuthError, match="replayed nonce"):
        a.open_request(ahead, NOW + 102, guard)


def test_a_window_full_of_frames_stamped_ahead_never_lifts_the_floor_past_now() -> None:
    guard = ReplayGuard(window_ms=60_000, capacity=3)
    for i in range(3):
        assert guard.check_and_remember(bytes([i]) * 16, NOW + 20_000 + i, NOW) == ""
    # Another frame stamped ahead: forgetting any would lift the floor past now, so it is refused.
    assert guard.check_and_remember(b"a" * 16, NOW + 5, NOW) == "replay window full (of frames stamped ahead of " \
        "this clock)"
    # A synced peer's frame is the oldest: accepted and forgotten at once, the floor rising to its stamp (not past
    # now), so it is still never accepted twice.
    assert guard.check_and_remember(b"s" * 16, NOW, NOW) == ""
    assert guard._floor_ms == NOW and len(guard) == 3
    assert guard.check_and_remember(b"s" * 16, NOW, NOW + 1) != ""
    assert guard.check_and_remember(b"t" * 16, NOW + 1, NOW + 1) == ""
    # Once this clock reaches the oldest of those ahead, it is forgotten in turn, and never accepted again.
    assert guard.check_and_remember(b"u" * 16, NOW + 20_000, NOW + 20_000) == ""
    assert guard._floor_ms == NOW + 20_000
    assert guard.check_and_remember(b"\x00" * 16, NOW + 20_000, NOW + 20_001) != ""


@settings(max_examples=300, deadline=None, database=None)
@given(capacity=st.integers(1, 6), events=st.lists(
    st.tuples(st.integers(0, 15), st.integers(-80, 80), st.integers(-20, 30)), max_size=120))
def test_no_frame_is_ever_accepted_twice(capacity: int, events: list[tuple[int, int, int]]) -> None:
    """Whatever the order, the stamps (past, future, beyond the window) and the clock (even stepping back): a
    frame (a nonce and the stamp its MAC binds) opens at most once, the table stays within capacity, and the floor
    never passes the latest now."""
    guard = ReplayGuard(window_ms=50, capacity=capacity)
    stamps: dict[bytes, int] = {}
    accepted: set[bytes] = set()
    now = latest = NOW
    for which, offset, step in events:
        now += step
        latest = max(latest, now)
        nonce = bytes([which]) * 16
        if guard.check_and_remember(nonce, stamps.setdefault(nonce, now + offset), now) == "":
            assert nonce not in accepted
            accepted.add(nonce)
        assert len(guard) <= capacity and guard._floor_ms <= latest


@settings(max_examples=200, deadline=None, database=None)
@given(capacity=st.integers(1, 6), events=st.lists(st.tuples(st.integers(-80, 80), st.integers(1, 30)),
                                                    max_size=120))
def test_a_synced_peer_is_never_refused_whatever_else_was_accepted(
        capacity: int, events: list[tuple[int, int]]) -> None:
    """Frames stamped anyhow (up to 80 ms ahead) in between: a synced peer's fresh frame, stamped at a now later
    than every one before, always opens (with the old guard, one frame stamped ahead and forgotten refused it)."""
    guard = ReplayGuard(window_ms=50, capacity=capacity)
    now = NOW
    for i, (offset, step) in enumerate(events):
        now += step
        assert guard.check_and_remember(b"s" + i.to_bytes(15, "big"), now, now) == ""  # a synced peer's frame
        guard.check_and_remember(b"o" + i.to_bytes(15, "big"), now + offset, now)  # anyone's, stamped anyhow


# --------------------------------------------------------------------------- settings


def test_secret_from_the_environment_or_a_file(tmp_path) -> None:
    assert KVP2PConfig.from_sources({}, {}).secret == b""
    assert KVP2PConfig.from_sources({}, {"VLLM_KVP2P_SECRET": " s3cret-of-16-bytes \n"}).secret == b"s3cret-of-16-bytes"
    path = tmp_path / "secret"
    path.write_bytes(b"from-a-file-0123456789\n")
    assert KVP2PConfig.from_sources({"secret_file": str(path)}, {}).secret == b"from-a-file-0123456789"
    assert KVP2PConfig.from_sources({}, {"VLLM_KVP2P_SECRET_FILE": str(path)}).secret == b"from-a-file-0123456789"


def test_the_secret_is_never_in_the_config_repr_or_the_extra_config(tmp_path) -> None:
    config = KVP2PConfig.from_sources({}, {"VLLM_KVP2P_SECRET": "do-not-log-this-value"})
    assert "do-not-log-this-value" not in repr(config)
    with pytest.raises(ConfigError, match="must not hold the secret"):
        KVP2PConfig.from_sources({"secret": "on-the-command-line"}, {})


@pytest.mark.parametrize(("extra", "env", "message"), [
    ({}, {"VLLM_KVP2P_SECRET": "short"}, "VLLM_KVP2P_SECRET: the secret has 5 bytes, at least 16"),
    ({"secret_file": "/nonexistent/kvp2p-secret"}, {}, "secret_file='/nonexistent/kvp2p-secret': cannot read it"),
    ({"secret_file": "/etc/hostname"}, {"VLLM_KVP2P_SECRET": "x" * 20}, "both VLLM_KVP2P_SECRET and secret_file"),
    ({"clock_skew": 0}, {}, "clock_skew=0.0"),
    ({"pull_timeout": 1, "side_channel_timeout": 5}, {}, "pull_timeout=1.0: allowed values are >= side_channel"),
    ({"peer_ports": "20000"}, {}, "peer_ports='20000': expected LOW-HIGH"),
    ({"peer_ports": "30000-20000"}, {}, "peer_ports='30000-20000'"),
])
def test_bad_security_settings_are_named(extra: dict, env: dict, message: str) -> None:
    with pytest.raises(ConfigError) as info:
        KVP2PConfig.from_sources(extra, env)
    assert message in str(info.value)


def test_peer_ports_bound_what_params_may_name() -> None:
    config = KVP2PConfig.from_sources({"peer_ports": "14600-14700"}, {})
    ranges = config.peer_port_ranges()
    params = {**issued().to_params(), "remote_port": 14690, "tp_size": 8}
    remote_params = RemotePrefill.from_params(params)
    assert "ports 14690..14697 not inside the allowed side-channel ports (14600..14696" in address_problem(
        remote_params, ((14600, 14696),))
    assert address_problem(remote_params, ranges) == ""
    # The default: every port a side channel may use, never Mooncake's RPC range.
    default = KVP2PConfig().peer_port_ranges()
    assert address_problem(RemotePrefill.from_params({**params, "remote_port": 15500}), default)
    assert address_problem(RemotePrefill.from_params({**params, "remote_port": 80}), default)
