"""Whether the proxy may send a request to an instance: one small state machine per instance, no I/O, no clock.

An instance that refused a connection, reset it, or timed out is *skipped* for a back-off (1 s, doubling per
failure in a row, at most 30 s). When the back-off is over it gets one *trial* request (a passive probe: the
requests themselves find out whether it is back); the proxy's probe loop also asks its ``/health`` every second
while it is skipped, so a restarted instance is used again within about a second. A success or a good probe
makes it *up* again.

What counts: transport failures to the instance itself. An HTTP error answer comes from a live instance, and a
pull that failed between a P and a D is not a reason to skip P (the pull report names that pair; P is fine).

The caller passes ``now`` (monotonic seconds) in, so the machine is tested without sleeping.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

FIRST_BACKOFF_S = 1.0
MAX_BACKOFF_S = 30.0


class Health(enum.Enum):
    UP = "up"
    SKIPPED = "skipped"  # failed recently; not chosen before ``retry_at``
    TRIAL = "trial"  # back-off over; one request is in flight to find out


@dataclass
class InstanceHealth:
    """The health of one instance (a field of its :class:`~vllm_kvp2p.proxy.instances.Instance` record)."""

    state: Health = Health.UP
    failures_in_a_row: int = 0
    retry_at: float = 0.0
    last_error: str | None = None
    #: Total transport failures seen, for /health.
    failures: int = 0

    def usable(self, now: float) -> bool:
        """May a new request go here? A skipped instance whose back-off is over becomes usable for one trial."""
        if self.state is Health.UP:
            return True
        return self.state is Health.SKIPPED and now >= self.retry_at

    def chosen(self, now: float) -> None:
        """A request was sent here: a skipped instance past its back-off is now on trial (one request only)."""
        if self.state is Health.SKIPPED and now >= self.retry_at:
            self.state = Health.TRIAL

    def failed(self, now: float, error: str) -> None:
        """A transport failure (refused, reset, timed out): skip for the back-off."""
        self.failures += 1
        self.failures_in_a_row += 1
        backoff = min(MAX_BACKOFF_S, FIRST_BACKOFF_S * 2 ** min(self.failures_in_a_row - 1, 16))
        self.state = Health.SKIPPED
        self.retry_at = now + backoff
        self.last_error = error

    def succeeded(self) -> None:
        """An answer came back (any HTTP status) or ``/health`` answered 200: up again."""
        self.state = Health.UP
        self.failures_in_a_row = 0
        self.retry_at = 0.0

    def abandoned(self, now: float) -> None:
        """The trial request ended without an outcome (the client went away): another request may try."""
        if self.state is Health.TRIAL:
            self.state = Health.SKIPPED
            self.retry_at = now

    def probed(self, now: float, ok: bool, error: str | None = None) -> None:
        """The probe loop's ``/health`` result for a skipped instance."""
        if ok:
            self.succeeded()
        elif self.state is not Health.UP:
            # Still down: keep skipping, without growing the back-off for every probe.
            self.state = Health.SKIPPED
            self.retry_at = max(self.retry_at, now + FIRST_BACKOFF_S)
            self.last_error = error or self.last_error

    def snapshot(self, now: float) -> dict[str, object]:
        """For the proxy's /health."""
        out: dict[str, object] = {"state": self.state.value, "failures": self.failures}
        if self.state is not Health.UP:
            out["retry_in_s"] = round(max(0.0, self.retry_at - now), 3)
            out["last_error"] = self.last_error
        return out
