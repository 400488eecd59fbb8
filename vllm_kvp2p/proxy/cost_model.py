"""What the proxy measures for its placement decisions (pure: every time is passed in, nothing reads a clock).

Two things, each one record:

* :class:`InstanceWork`, per instance: the prefill work assigned to it and not yet done (tokens and prefills),
  the prefill work assigned to it lately (a sum that decays with the share window, so that ``recent / window`` is
  the share of its time its prefills take), and the requests decoding there. The proxy adds work when it places a
  request and takes it off when it sees the prefill end (P's answer; D's first streamed token); the decision reads
  it through :meth:`InstanceWork.load`.
* :class:`Calibration`, for the whole proxy: the cost model fitted to what the proxy observed. A prefill's time
  against the prompt tokens queued ahead of it and its own (P's answer time, or a local request's first streamed
  token); a decode step's time against the running decodes (a stream's time per token, with the time its instance
  spent prefilling meanwhile taken out); what the second hop adds (a P/D stream's first token after D was asked).
  Each fit forgets old observations geometrically, so the model follows a changing machine. It counts as
  calibrated once it saw :data:`MIN_OBSERVATIONS` of prefill and of decode; the hop starts at the prefill's fixed
  cost (a second API-server entry and one step) until a P/D stream measures it.

One model for all instances: the fleets this is built for run one model on identical devices. A fleet of mixed
devices would want a fit per instance (docs/routing.md lists it as not done).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

from vllm_kvp2p.proxy.disaggregation import CostModel, InstanceLoad

#: Observations of each kind before the model replaces the token threshold.
MIN_OBSERVATIONS = 4
#: Each new observation's weight against the past (a forgetting factor of 1 - this).
LEARNING_RATE = 0.05
#: The window a prefill counts against its instance's decodes, ms (a decode's TPOT averages over about this).
DEFAULT_SHARE_WINDOW_MS = 2000.0
#: Before any observation (never used to decide: the threshold decides until calibrated), a small model on one core.
PRIOR = CostModel(prefill_base_ms=20.0, prefill_ms_per_token=0.1, step_ms=10.0, step_ms_per_decode=0.0,
                  hop_ms=20.0, share_window_ms=DEFAULT_SHARE_WINDOW_MS, calibrated=False)
#: Observations outside these are dropped (a stalled request, a clock step): they would wreck a fit.
MAX_OBSERVED_MS = 600_000.0
#: The TPOTs a stream measured on an instance that count for it, ms (older ones say nothing of its load now), how
#: many are kept, and how many it takes before they count at all.
OBSERVED_TPOT_WINDOW_MS = 10_000.0
OBSERVED_TPOTS_KEPT = 64
MIN_OBSERVED_TPOTS = 4


class LinearFit:
    """``y = a + b * x`` by least squares with exponential forgetting; ``b`` kept >= 0 (cost grows with work)."""

    def __init__(self, a: float, b: float, rate: float = LEARNING_RATE) -> None:
        self.prior_a, self.prior_b, self.rate = a, b, rate
        self.n = 0
        self._sw = self._sx = self._sy = self._sxx = self._sxy = 0.0

    def add(self, x: float, y: float) -> None:
        if not (math.isfinite(x) and math.isfinite(y)) or x < 0 or not 0 <= y <= MAX_OBSERVED_MS:
            return
        keep = 1.0 - self.rate
        self._sw = self._sw * keep + 1.0
        self._sx = self._sx * keep + x
        self._sy = self._sy * keep + y
        self._sxx = self._sxx * keep + x * x
        self._sxy = self._sxy * keep + x * y
        self.n += 1

    @property
    def coefficients(self) -> tuple[float, float]:
        """(a, b); the prior until there are observations, the mean alone while the x seen do not vary."""
        if self.n == 0:
            return self.prior_a, self.prior_b
        mx, my = self._sx / self._sw, self._sy / self._sw
        var = self._sxx / self._sw - mx * mx
        if var <= 1e-9 * max(1.0, mx * mx):  # one x so far: the slope is unknown, keep the prior's
            b = self.prior_b
        else:
            b = max(0.0, (self._sxy / self._sw - mx * my) / var)
        return max(0.0, my - b * mx), b


@dataclass
class Calibration:
    """The cost model, fitted to what the proxy observed (module doc)."""

    share_window_ms: float = DEFAULT_SHARE_WINDOW_MS
    prefill: LinearFit = field(default_factory=lambda: LinearFit(PRIOR.prefill_base_ms, PRIOR.prefill_ms_per_token))
    step: LinearFit = field(default_factory=lambda: LinearFit(PRIOR.step_ms, PRIOR.step_ms_per_decode))
    hop: LinearFit = field(default_factory=lambda: LinearFit(PRIOR.hop_ms, 0.0))

    def prefill_took(self, tokens_ahead: int, elapsed_ms: float) -> None:
        """A prefill ended ``elapsed_ms`` after it was placed, with ``tokens_ahead`` tokens (its own included)
        queued on its instance then."""
        self.prefill.add(tokens_ahead, elapsed_ms)

    def decode_took(self, decodes: int, tokens: int, span_ms: float, prefill_ms_meanwhile: float) -> None:
        """A stream's ``tokens`` after its first came within ``span_ms``, while its instance ran ``decodes`` and
        spent about ``prefill_ms_meanwhile`` prefilling: one step is the rest divided by the tokens."""
        if tokens >= 1 and span_ms > 0:
            self.step.add(max(1, decodes), max(0.0, span_ms - prefill_ms_meanwhile) / tokens)

    def hop_took(self, ms: float) -> None:
        """A P/D stream's first token came ``ms`` after D was asked (D's entry, the pull, D's first step)."""
        self.hop.add(0, ms)

    def model(self) -> CostModel:
        base, per_token = self.prefill.coefficients
        step, per_decode = self.step.coefficients
        hop = self.hop.coefficients[0] if self.hop.n else base  # module doc: a second entry and one step
        return CostModel(prefill_base_ms=base, prefill_ms_per_token=per_token, step_ms=step,
                         step_ms_per_decode=per_decode, hop_ms=hop, share_window_ms=self.share_window_ms,
                         calibrated=self.prefill.n >= MIN_OBSERVATIONS and self.step.n >= MIN_OBSERVATIONS)

    def snapshot(self) -> dict[str, float | int | bool]:
        m = self.model()
        return {"calibrated": m.calibrated, "prefill_base_ms": round(m.prefill_base_ms, 3),
                "prefill_ms_per_token": round(m.prefill_ms_per_token, 5), "step_ms": round(m.step_ms, 3),
                "step_ms_per_decode": round(m.step_ms_per_decode, 4), "hop_ms": round(m.hop_ms, 3),
                "prefill_observations": self.prefill.n, "decode_observations": self.step.n,
                "hop_observations": self.hop.n}


@dataclass
class InstanceWork:
    """The work the proxy gave one instance (module doc)."""

    queued_tokens: int = 0
    queued_prefills: int = 0
    decodes: int = 0
    #: Prefill tokens assigned lately, decayed to ``_at`` (ms on the proxy's clock).
    _recent_tokens: float = 0.0
    _at: float = 0.0
    #: Every prefill token ever assigned (a stream's prefill-meanwhile is the difference of two readings).
    assigned_tokens: int = 0
    #: (when, TPOT) of the streams decoded here lately, as the proxy measured them: what the objectives bind.
    _tpots: deque[tuple[float, float]] = field(default_factory=lambda: deque(maxlen=OBSERVED_TPOTS_KEPT))

    def tpot_seen(self, now_ms: float, tpot_ms: float) -> None:
        if math.isfinite(tpot_ms) and 0 <= tpot_ms <= MAX_OBSERVED_MS:
            self._tpots.append((now_ms, tpot_ms))

    def observed_tpot_ms(self, now_ms: float) -> float | None:
        """The 90th percentile of the TPOTs measured here within the last :data:`OBSERVED_TPOT_WINDOW_MS` (a
        prediction is a mean; an objective binds each request), or None with fewer than
        :data:`MIN_OBSERVED_TPOTS` of them."""
        recent = sorted(t for at, t in self._tpots if now_ms - at <= OBSERVED_TPOT_WINDOW_MS)
        if len(recent) < MIN_OBSERVED_TPOTS:
            return None
        return recent[min(len(recent) - 1, int(0.9 * len(recent)))]

    def _decay(self, now_ms: float, window_ms: float) -> None:
        if now_ms > self._at:
            keep = math.exp(-(now_ms - self._at) / window_ms)
            self._recent_tokens *= keep
            self._at = now_ms

    def prefill_placed(self, tokens: int, now_ms: float, window_ms: float) -> None:
        self._decay(now_ms, window_ms)
        self.queued_tokens += tokens
        self.queued_prefills += 1
        self._recent_tokens += tokens
        self.assigned_tokens += tokens

    def prefill_ended(self, tokens: int) -> None:
        """Its prefill of ``tokens`` ended (or failed, or was cancelled): never below zero."""
        self.queued_tokens = max(0, self.queued_tokens - tokens)
        self.queued_prefills = max(0, self.queued_prefills - 1)

    def load(self, cost: CostModel, now_ms: float, *, usable: bool, can_prefill_for_others: bool, can_decode: bool,
             cached_tokens: int, outstanding: int, retry_at: float) -> InstanceLoad:
        self._decay(now_ms, cost.share_window_ms)
        return InstanceLoad(
            usable=usable, can_prefill_for_others=can_prefill_for_others, can_decode=can_decode,
            cached_tokens=cached_tokens,
            backlog_ms=self.queued_prefills * cost.prefill_base_ms + self.queued_tokens * cost.prefill_ms_per_token,
            # Only the per-token part takes engine steps from the decodes; a request's fixed cost is mostly its way
            # through the API server (it counts in TTFT: backlog_ms).
            recent_prefill_ms=self._recent_tokens * cost.prefill_ms_per_token,
            decodes=self.decodes, outstanding=outstanding, retry_at=retry_at,
            observed_tpot_ms=self.observed_tpot_ms(now_ms))

    def snapshot(self) -> dict[str, int]:
        return {"queued_prefill_tokens": self.queued_tokens, "queued_prefills": self.queued_prefills,
                "decodes": self.decodes}
