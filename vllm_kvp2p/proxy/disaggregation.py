"""Whether a request is disaggregated, and where: the proxy's one placement decision (pure, no I/O, no clock).

For each request the proxy chooses a decode instance (D) and who computes the prompt: another instance (P, with
the pull that follows: P/D) or D itself (the request goes to D without ``kv_transfer_params``, and vLLM prefills
it as an ordinary request). ``--disaggregate`` (:class:`Mode`):

* ``always``: P/D for every request (P never equals D); the default with dedicated ``--prefill``/``--decode``
  instances, because an operator who gave instances fixed roles decided at deployment.
* ``never``: every request computed where it decodes (the proxy of ordinary instances).
* ``auto``: per request, below; the default with ``--kv-both`` instances (each may prefill for another and
  decode), where nothing was decided at deployment.

``auto`` with objectives (``--slo ttft=300ms,tpot=15ms``) predicts, for each candidate placement, from the
measured state of every instance (:class:`InstanceLoad`) and a cost model calibrated from what the proxy observed
(:class:`CostModel`, :mod:`cost_model`):

* the request's TTFT: the prefill work already queued on the instance that computes it, plus its own uncached
  tokens, plus, when P is not D, what the second hop adds (D's entry, the pull, D's first step);
* the TPOT of the decodes each placement touches: a decode step at that instance's batch, stretched by the share
  of that instance's time its prefills take (``step / (1 - share)``): a local prefill stretches D's decodes (the
  request's own included), a prefill on P stretches P's decodes when P also decodes (``kv_both``).

Each placement's *score* is the largest of those figures divided by its objective: at or under 1 it meets every
objective the proxy can predict. Among the placements that do, D computing the prompt wins (no second hop, no
hold, no second engine's work), then the least prefill work (a cached prefix), then the lowest score. When none
does (the fleet is loaded) and TPOT is what fails, the roles split: the prompt is prefilled on the instance with
the fewest decodes and decoded on the one prefilling least (:func:`_split_roles`), which under load settles the
instances into prefill and decode roles; when TTFT is what fails, the placement with the lowest score (splitting
would leave the prompts fewer instances to prefill on). So a short prompt or an idle fleet stays
local (no second hop), a long prompt under a tight TPOT goes to the instance whose decodes it hurts least, and
with ``kv_both`` instances the prefill:decode split follows the load: an instance busy prefilling stops being
chosen as D (its decodes would be stretched) and the others stop prefilling (theirs would).

Without objectives, or before the cost model has seen a request of each kind, a token threshold decides as
llm-d's ``prefix-based-pd-decider`` does: P/D when D lacks at least ``threshold`` of the prompt's tokens.
Every :class:`Decision` carries a ``reason`` from :data:`REASONS`, which the proxy counts per path.
"""

from __future__ import annotations

import enum
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass

#: The token threshold's default: P/D when D lacks at least this many prompt tokens. Measured (docs/performance.md
#: section 20): on two cores, 1,024 kept 960-token prompts local and beat 64 and 256 by up to 5x where TTFT counts,
#: at no loss where TPOT does; llm-d's sample 16 sends nearly every prompt to P, whose queue then sets the TTFT.
DEFAULT_THRESHOLD_TOKENS = 1024
#: Bounds on an objective, ms: parse errors past them rather than a decision that cannot mean anything.
MAX_OBJECTIVE_MS = 3_600_000.0

#: Why a placement was chosen (the proxy's counters are labelled by path and one of these).
REASONS = (
    "mode_always",  # --disaggregate always (the proxy's routing picks P and D)
    "mode_never",  # --disaggregate never (the proxy's routing picks D)
    "no_prefill_instance",  # auto, but no instance other than D may prefill for it (or none is usable)
    "unknown_prompt",  # auto, but the prompt's tokens are unknown: computed where it decodes
    "threshold",  # auto without objectives (or not yet calibrated): D lacks >= threshold tokens -> P/D
    "slo_met",  # auto with objectives: the best placement meets every predicted objective
    "slo_best_effort",  # auto with objectives: none meets them all; the least damaging one
)


class Mode(enum.Enum):
    ALWAYS = "always"
    NEVER = "never"
    AUTO = "auto"


class ObjectivesError(ValueError):
    """An unusable ``--slo`` (or per-request objectives): the message names the setting and the value."""


@dataclass(frozen=True)
class Objectives:
    """The operator's latency objectives, ms."""

    ttft_ms: float
    tpot_ms: float

    @classmethod
    def parse(cls, text: str, *, setting: str = "--slo") -> Objectives:
        """``ttft=300ms,tpot=15ms`` (units ``ms`` or ``s``; ms when none). Both are required."""
        found: dict[str, float] = {}
        for part in text.split(","):
            key, sep, value = part.strip().partition("=")
            key = key.strip().lower()
            if not sep or key not in ("ttft", "tpot"):
                raise ObjectivesError(f"{setting}={text!r}: expected ttft=<time>,tpot=<time> (e.g. "
                                      "ttft=300ms,tpot=15ms), got {part.strip()!r}")
            if key in found:
                raise ObjectivesError(f"{setting}={text!r}: {key} given twice")
            match = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*(ms|s)?\s*", value)
            if match is None:
                raise ObjectivesError(f"{setting}={text!r}: {key}={value.strip()!r} is not a time like 300ms or 0.3s")
            ms = float(match.group(1)) * (1000.0 if match.group(2) == "s" else 1.0)
            if not 0.0 < ms <= MAX_OBJECTIVE_MS:
                raise ObjectivesError(f"{setting}={text!r}: {key} must be above 0 and at most one hour")
            found[key] = ms
        missing = [k for k in ("ttft", "tpot") if k not in found]
        if missing:
            raise ObjectivesError(f"{setting}={text!r}: {' and '.join(missing)} missing (give both: "
                                  "ttft=<time>,tpot=<time>)")
        return cls(found["ttft"], found["tpot"])

    def __str__(self) -> str:
        return f"ttft={self.ttft_ms:g}ms,tpot={self.tpot_ms:g}ms"


@dataclass(frozen=True)
class CostModel:
    """What time things take, as the proxy measured it (:class:`~vllm_kvp2p.proxy.cost_model.Calibration`)."""

    #: A prefill's fixed cost (API server, scheduling, one step) and its cost per uncached prompt token.
    prefill_base_ms: float
    prefill_ms_per_token: float
    #: One decode step with one running sequence, and what each more sequence in the batch adds.
    step_ms: float
    step_ms_per_decode: float
    #: What P/D adds to TTFT beyond P's prefill: D's API entry, the pull, D's first step.
    hop_ms: float
    #: The window a prefill's share of an instance's time is counted over (its decodes' TPOT averages over it).
    share_window_ms: float
    #: Whether every figure comes from observations (otherwise the token threshold decides).
    calibrated: bool

    def prefill_ms(self, tokens: int) -> float:
        return self.prefill_base_ms + self.prefill_ms_per_token * max(0, tokens)

    def tpot_ms(self, decodes: int, share: float) -> float:
        """A decode's time per token on an instance running ``decodes`` sequences that spends ``share`` of its
        time prefilling (a prefill chunk shares steps with the decodes, so the steps stretch)."""
        step = self.step_ms + self.step_ms_per_decode * max(0, decodes - 1)
        return step / max(0.05, 1.0 - min(share, 0.95))


@dataclass(frozen=True)
class InstanceLoad:
    """What the decision needs of one instance at this moment (the proxy's own accounting)."""

    usable: bool
    #: May compute a prompt for another instance (kv_producer or kv_both) / may decode (kv_consumer or kv_both).
    #: Every instance that decodes may also compute a prompt for itself (an ordinary request).
    can_prefill_for_others: bool
    can_decode: bool
    #: Leading prompt tokens it holds (0 when unknown).
    cached_tokens: int
    #: Prefill work queued there and not yet done, ms (predicted when assigned, corrected when observed).
    backlog_ms: float
    #: Prefill ms assigned there within the last share window, ms (its share of time is this / the window).
    recent_prefill_ms: float
    #: Requests decoding there.
    decodes: int
    #: Requests in flight there, any role (ties).
    outstanding: int
    #: When a skipped instance may be tried again (used only when none is usable).
    retry_at: float = 0.0
    #: The TPOT its recent streams had (90th percentile), ms; None when too few were measured lately.
    observed_tpot_ms: float | None = None


@dataclass(frozen=True)
class Decision:
    """Where one request runs: ``prefill`` (index) computes the prompt for ``decode``, or ``None``: D does."""

    decode: int
    prefill: int | None
    reason: str
    #: The predictions behind it (None where the token threshold decided).
    ttft_ms: float | None = None
    tpot_ms: float | None = None
    score: float | None = None

    @property
    def path(self) -> str:
        return "local" if self.prefill is None else "pd"


@dataclass(frozen=True)
class _Placement:
    decode: int
    prefill: int | None
    ttft_ms: float
    tpot_ms: float
    score: float
    outstanding: int
    work_ms: float


def decide(
    loads: Sequence[InstanceLoad],
    *,
    prompt_tokens: int | None,
    cost: CostModel,
    objectives: Objectives | None = None,
    threshold: int = DEFAULT_THRESHOLD_TOKENS,
    cursor: int = 0,
    pairs: Callable[[int, int], bool] = lambda p, d: True,
) -> Decision:
    """``auto``'s placement of one request. ``loads`` indexes the instances; ``cursor`` rotates ties.

    ``pairs(p, d)``: whether instance ``p`` may prefill for ``d`` (vllm_kvp2p/proxy/pairing.py): never otherwise.
    (``always`` and ``never`` need no decision: the proxy's routing picks the instance of each role, as without
    this module.)"""
    decoders = _usable([i for i, x in enumerate(loads) if x.can_decode], loads)
    if not decoders:
        raise ValueError("no instance may decode")
    prefillers = [i for i, x in enumerate(loads) if x.can_prefill_for_others]
    if prompt_tokens is None:
        return Decision(_least_busy(decoders, loads, cursor), None, "unknown_prompt")
    if objectives is None or not cost.calibrated:
        return _by_threshold(decoders, prefillers, loads, prompt_tokens, cost, threshold, cursor, pairs)
    return _by_objectives(decoders, prefillers, loads, prompt_tokens, cost, objectives, cursor, pairs)


def _by_threshold(decoders: list[int], prefillers: list[int], loads: Sequence[InstanceLoad], prompt_tokens: int,
                  cost: CostModel, threshold: int, cursor: int, pairs: Callable[[int, int], bool]) -> Decision:
    """llm-d's rule: P/D when the D with the fewest decodes lacks at least ``threshold`` of the prompt's tokens."""
    d = _least_busy(decoders, loads, cursor)
    p_set = _usable([i for i in prefillers if i != d and pairs(i, d)], loads)
    lacking = prompt_tokens - loads[d].cached_tokens
    if lacking < threshold or not p_set:
        return Decision(d, None, "threshold" if p_set else "no_prefill_instance")
    return Decision(d, _least_backlog(p_set, loads, prompt_tokens, cost, cursor), "threshold")


def _by_objectives(decoders: list[int], prefillers: list[int], loads: Sequence[InstanceLoad], prompt_tokens: int,
                   cost: CostModel, objectives: Objectives, cursor: int, pairs: Callable[[int, int], bool]
                   ) -> Decision:
    """The best placement that meets the objectives (:func:`_better`), or the split roles when none does (module
    doc)."""
    n = len(loads)
    window = max(1.0, cost.share_window_ms)

    def share(i: int, added_ms: float = 0.0) -> float:
        return (loads[i].recent_prefill_ms + added_ms) / window

    def prefill_on(i: int) -> float:  # this prompt's prefill on i, ms
        return cost.prefill_ms(prompt_tokens - loads[i].cached_tokens)

    def tpot_on(i: int, decodes: int, added_ms: float = 0.0) -> float:
        """A decode's TPOT on i: the model's, or what i's streams measured lately when that is worse (the model
        predicts a mean and misses what it does not see; the objective binds each request)."""
        predicted = cost.tpot_ms(decodes, share(i, added_ms))
        seen = loads[i].observed_tpot_ms
        return predicted if seen is None else max(predicted, seen)

    # What a prefill on p does to p's own decodes, and its TTFT there, do not depend on D (when p != D): score each
    # P once, in order; each D takes the first that is not itself and pairs with it.
    p_usable = _usable(prefillers, loads)
    remote: list[tuple[float, float, float, int]] = []  # (part of the score, ttft without the hop, p's tpot, p)
    for p in p_usable:
        ttft = loads[p].backlog_ms + prefill_on(p)
        harm = tpot_on(p, loads[p].decodes, prefill_on(p) - cost.prefill_base_ms) if loads[p].decodes else 0.0
        part = max((ttft + cost.hop_ms) / objectives.ttft_ms, harm / objectives.tpot_ms)
        remote.append((part, ttft, harm, p))
    # A P that meets the objectives first; then the one with the fewest decodes (prefills go where decodes are not).
    remote.sort(key=lambda r: (r[0] > 1.0, loads[r[3]].decodes, r[0], loads[r[3]].backlog_ms, (r[3] - cursor) % n))
    best: _Placement | None = None
    for d in decoders:
        # The request's own decode is stretched by the prefills D does meanwhile, not by its own (done before its
        # first token); D's running decodes are stretched by its own too when D computes it.
        own_tpot = tpot_on(d, loads[d].decodes + 1)
        local_ms = prefill_on(d) - cost.prefill_base_ms  # the part that takes D's steps (cost_model.py)
        ttft = loads[d].backlog_ms + prefill_on(d)
        tpot = max(own_tpot, tpot_on(d, loads[d].decodes + 1, local_ms) if loads[d].decodes else 0.0)
        candidates = [_Placement(d, None, ttft, own_tpot, max(ttft / objectives.ttft_ms, tpot / objectives.tpot_ms),
                                 loads[d].outstanding, prefill_on(d))]
        other = next((r for r in remote if r[3] != d and pairs(r[3], d)), None)
        if other is not None:
            part, p_ttft, _, p = other
            candidates.append(_Placement(d, p, p_ttft + cost.hop_ms, own_tpot,
                                         max(part, own_tpot / objectives.tpot_ms), loads[d].outstanding, prefill_on(p)))
        for c in candidates:
            if best is None or _better(c, best, cursor, n):
                best = c
    assert best is not None
    reason = "slo_met" if best.score <= 1.0 else "slo_best_effort"
    # Nothing meets the objectives. Where TPOT binds, split the roles: that removes the interference. Where TTFT
    # binds, splitting would leave the prompts fewer instances to prefill on: the least damaging placement instead.
    if best.score > 1.0 and best.ttft_ms / objectives.ttft_ms < best.score:
        split = _split_roles(decoders, p_usable, loads, pairs, cursor)
        if split is not None:  # nothing meets the objectives: separate prefill from decode (below)
            p, d = split
            ttft = loads[p].backlog_ms + prefill_on(p) + cost.hop_ms
            tpot = tpot_on(d, loads[d].decodes + 1)
            return Decision(d, p, reason, ttft, tpot, max(ttft / objectives.ttft_ms, tpot / objectives.tpot_ms))
    if best.prefill is None and not _usable([i for i in prefillers if i != best.decode and pairs(i, best.decode)],
                                            loads):
        reason = "no_prefill_instance"
    return Decision(best.decode, best.prefill, reason, best.ttft_ms, best.tpot_ms, best.score)


def _split_roles(decoders: list[int], prefillers: list[int], loads: Sequence[InstanceLoad],
                 pairs: Callable[[int, int], bool], cursor: int) -> tuple[int, int] | None:
    """When no placement meets the objectives (the fleet is loaded): P/D, the prompt prefilled on the instance with
    the fewest decodes (then the one prefilling most already) and decoded on the one prefilling least. Each choice
    makes the next the same: P's decodes drain and D's prefill share falls, so the instances settle into a prefill
    and a decode role, which is what removes the interference once it decides (DistServe); scoring each placement
    on its own would instead spread the prefills evenly, each stretching some instance's decodes. As the load falls
    the placements meet the objectives again and the roles dissolve into local requests."""
    n = len(loads)
    for p in sorted(prefillers, key=lambda i: (loads[i].decodes, -loads[i].recent_prefill_ms, (i - cursor) % n)):
        ds = [d for d in decoders if d != p and pairs(p, d)]
        if ds:
            return p, min(ds, key=lambda i: (loads[i].recent_prefill_ms, loads[i].decodes, (i - cursor) % n))
    return None


def _better(a: _Placement, b: _Placement, cursor: int, n: int) -> bool:
    """``a`` before ``b``: one that meets every objective first; among those D computing the prompt first (no hop,
    no hold, no second engine's work), then the least prefill work; then the lower score, fewer in flight, round
    robin."""
    def key(c: _Placement) -> tuple[bool, bool, float, float, int, int]:
        fits = c.score <= 1.0
        return (not fits, fits and c.prefill is not None, c.work_ms if fits else 0.0, c.score, c.outstanding,
                (c.decode - cursor) % n)
    return key(a) < key(b)


def _usable(indices: list[int], loads: Sequence[InstanceLoad]) -> list[int]:
    """The usable ones; when none is, those whose back-off ends first (stale health costs speed, not answers)."""
    up = [i for i in indices if loads[i].usable]
    if up or not indices:
        return up
    soonest = min(loads[i].retry_at for i in indices)
    return [i for i in indices if loads[i].retry_at == soonest]


def _least_busy(indices: list[int], loads: Sequence[InstanceLoad], cursor: int) -> int:
    """Fewest decodes, then least prefill queued, then fewest in flight, then round robin."""
    n = len(loads)
    return min(indices, key=lambda i: (loads[i].decodes, loads[i].backlog_ms, loads[i].outstanding, (i - cursor) % n))


def _least_backlog(indices: list[int], loads: Sequence[InstanceLoad], prompt_tokens: int, cost: CostModel,
                   cursor: int) -> int:
    """The P whose prefill of this prompt would end first (its queue, then its uncached tokens)."""
    n = len(loads)
    return min(indices, key=lambda i: (loads[i].backlog_ms + cost.prefill_ms(prompt_tokens - loads[i].cached_tokens),
                                       loads[i].outstanding, (i - cursor) % n))
