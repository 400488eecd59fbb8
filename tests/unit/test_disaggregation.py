"""The proxy's placement decision (vllm_kvp2p/proxy/disaggregation.py) and the cost model it is fed
(vllm_kvp2p/proxy/cost_model.py): pure, no engines."""

from __future__ import annotations

import dataclasses

import pytest

from vllm_kvp2p.proxy.cost_model import MIN_OBSERVATIONS, Calibration, InstanceWork, LinearFit
from vllm_kvp2p.proxy.disaggregation import (
    REASONS,
    CostModel,
    InstanceLoad,
    Objectives,
    ObjectivesError,
    decide,
)

#: The small model of docs/performance.md section 17 on one core: 474 ms per 960-token prefill, 11.5 ms a step.
SMALL = CostModel(prefill_base_ms=20.0, prefill_ms_per_token=0.47, step_ms=11.5, step_ms_per_decode=0.1,
                  hop_ms=15.0, share_window_ms=2000.0, calibrated=True)
TIGHT_ITL = Objectives(ttft_ms=10_000.0, tpot_ms=25.0)
TIGHT_TTFT = Objectives(ttft_ms=1_500.0, tpot_ms=100.0)


def both(**kw: object) -> InstanceLoad:
    """A kv_both instance, idle unless told otherwise."""
    base = dict(usable=True, can_prefill_for_others=True, can_decode=True, cached_tokens=0, backlog_ms=0.0,
                recent_prefill_ms=0.0, decodes=0, outstanding=0)
    return InstanceLoad(**{**base, **kw})  # type: ignore[arg-type]


# -- objectives --------------------------------------------------------------------------------------------------

@pytest.mark.parametrize(("text", "want"), [
    ("ttft=300ms,tpot=15ms", (300.0, 15.0)),
    ("tpot=0.015s, ttft=2s", (2000.0, 15.0)),
    ("TTFT=250,TPOT=12.5", (250.0, 12.5)),
])
def test_objectives_parse(text: str, want: tuple[float, float]) -> None:
    got = Objectives.parse(text)
    assert (got.ttft_ms, got.tpot_ms) == want
    assert Objectives.parse(str(got)) == got


@pytest.mark.parametrize(("text", "names"), [
    ("ttft=300ms", "tpot missing"),
    ("", "expected ttft="),
    ("ttft=300ms,tpot=15ms,ttft=1s", "ttft given twice"),
    ("ttft=fast,tpot=15ms", "'fast' is not a time"),
    ("ttft=0ms,tpot=15ms", "above 0"),
    ("ttft=2h,tpot=1ms", "is not a time"),
    ("ttft=99999999s,tpot=1ms", "at most one hour"),
    ("itl=5ms,tpot=1ms", "expected ttft="),
    ("ttft=-1ms,tpot=1ms", "is not a time"),
    ("ttft=nan,tpot=1ms", "is not a time"),
])
def test_objectives_refused_naming_the_setting(text: str, names: str) -> None:
    with pytest.raises(ObjectivesError, match="--slo") as info:
        Objectives.parse(text)
    assert names in str(info.value)


# -- the decision ------------------------------------------------------------------------------------------------

def test_an_idle_fleet_computes_where_it_decodes() -> None:
    """No queue and no decodes anywhere: the second hop only adds to TTFT."""
    d = decide([both(), both()], prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
    assert (d.path, d.reason) == ("local", "slo_met")
    assert d.ttft_ms == pytest.approx(SMALL.prefill_ms(960))


def test_decodes_running_push_a_long_prompt_to_the_instance_without_them() -> None:
    """Instance 0 decodes and prefilled lately; a 960-token prefill there would stretch its decodes past the TPOT
    objective: prefilled on 1 (idle) and decoded on 0, or both on 1; never prefilled on 0."""
    busy = both(decodes=12, recent_prefill_ms=1200.0)
    d = decide([busy, both()], prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
    assert d.prefill != 0 and not (d.prefill is None and d.decode == 0)
    assert d.score is not None and d.score <= 1.0


def test_an_instance_busy_prefilling_is_not_chosen_to_decode() -> None:
    """The split follows the load: 0 prefills a lot (a decode there would be stretched), 1 decodes and prefilled
    some lately; a long prompt is prefilled on 0 and decoded on 1 (P/D), not computed on 1 (that would stretch 1's
    decodes past the objective)."""
    prefiller = both(recent_prefill_ms=1500.0, backlog_ms=100.0)
    decoder = both(decodes=20, recent_prefill_ms=800.0)
    d = decide([prefiller, decoder], prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
    assert (d.prefill, d.decode, d.path) == (0, 1, "pd")


def test_tight_ttft_keeps_prompts_local() -> None:
    """Where TTFT decides and TPOT has room, the hop is not worth it."""
    loads = [both(decodes=3, recent_prefill_ms=400.0), both(decodes=3, recent_prefill_ms=400.0)]
    d = decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_TTFT)
    assert d.path == "local"


def test_a_queue_on_d_sends_the_prompt_to_an_idle_p() -> None:
    """D's prefill queue would break the TTFT objective; an idle P meets it even with the hop."""
    loads = [both(backlog_ms=2000.0), both(can_decode=False)]
    d = decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_TTFT)
    assert (d.prefill, d.decode) == (1, 0)


def test_a_cached_prompt_on_d_is_computed_there() -> None:
    """D holds the whole prompt but one block: nothing to pull that is worth a hop."""
    loads = [both(cached_tokens=944, decodes=4), both()]
    d = decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
    assert (d.prefill, d.decode) == (None, 0)


def test_nothing_meets_the_objectives_least_damage() -> None:
    loads = [both(backlog_ms=50_000.0, decodes=60, recent_prefill_ms=1900.0)] * 2
    d = decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_TTFT)
    assert d.reason == "slo_best_effort" and d.score is not None and d.score > 1.0


def test_dedicated_roles_never_prefill_on_d_for_others_nor_decode_on_p() -> None:
    p = both(can_decode=False)
    dd = both(can_prefill_for_others=False)
    for tokens in (16, 960, 4000):
        d = decide([p, dd], prompt_tokens=tokens, cost=SMALL, objectives=TIGHT_ITL)
        assert d.decode == 1 and d.prefill in (0, None)


def test_a_lone_instance_computes_locally() -> None:
    d = decide([both()], prompt_tokens=4000, cost=SMALL, objectives=TIGHT_ITL)
    assert (d.path, d.reason) == ("local", "no_prefill_instance")
    d = decide([both()], prompt_tokens=4000, cost=dataclasses.replace(SMALL, calibrated=False))
    assert (d.path, d.reason) == ("local", "no_prefill_instance")


def test_unknown_prompt_is_computed_where_it_decodes() -> None:
    d = decide([both(decodes=3), both()], prompt_tokens=None, cost=SMALL, objectives=TIGHT_ITL)
    assert (d.path, d.decode, d.reason) == ("local", 1, "unknown_prompt")


@pytest.mark.parametrize(("cached", "path"), [(0, "pd"), (960 - 255, "local"), (960 - 256, "pd")])
def test_threshold_without_objectives(cached: int, path: str) -> None:
    """llm-d's rule: P/D when D lacks at least the threshold's tokens."""
    loads = [both(cached_tokens=cached), both(can_decode=False)]
    d = decide(loads, prompt_tokens=960, cost=SMALL, threshold=256)
    assert (d.path, d.reason) == (path, "threshold")


def test_uncalibrated_model_falls_back_to_the_threshold() -> None:
    cost = dataclasses.replace(SMALL, calibrated=False)
    d = decide([both(), both()], prompt_tokens=960, cost=cost, objectives=TIGHT_ITL, threshold=256)
    assert (d.path, d.reason) == ("pd", "threshold")


def test_unusable_instances_are_left_out_unless_all_are() -> None:
    down = both(usable=False, retry_at=5.0)
    d = decide([down, both()], prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
    assert d.decode == 1 and d.prefill is None
    d = decide([down, dataclasses.replace(down, retry_at=3.0)], prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
    assert d.decode == 1


def test_no_decoder_is_an_error() -> None:
    with pytest.raises(ValueError, match="no instance may decode"):
        decide([both(can_decode=False)], prompt_tokens=10, cost=SMALL)


def test_every_reason_is_declared() -> None:
    loads_sets = [[both()], [both(), both()], [both(decodes=30, recent_prefill_ms=1900.0), both()]]
    for loads in loads_sets:
        for objectives in (None, TIGHT_ITL, TIGHT_TTFT):
            for tokens in (None, 10, 960, 100_000):
                assert decide(loads, prompt_tokens=tokens, cost=SMALL, objectives=objectives).reason in REASONS


def test_absurd_inputs_stay_bounded() -> None:
    """A client's prompt of any length and the proxy's counters at any size give a decision, never an error."""
    loads = [both(backlog_ms=1e12, recent_prefill_ms=1e12, decodes=10**9), both(cached_tokens=10**9)]
    for tokens in (0, 1, 10**9):
        d = decide(loads, prompt_tokens=tokens, cost=SMALL, objectives=TIGHT_ITL)
        assert d.reason in REASONS


# -- the cost model ----------------------------------------------------------------------------------------------

def test_linear_fit_recovers_a_line_and_forgets() -> None:
    fit = LinearFit(0.0, 1.0)
    assert fit.coefficients == (0.0, 1.0)  # the prior
    for x in (100, 500, 900, 300, 700) * 4:
        fit.add(x, 20.0 + 0.5 * x)
    a, b = fit.coefficients
    assert a == pytest.approx(20.0) and b == pytest.approx(0.5)
    for x in (100, 500, 900, 300, 700) * 40:  # the machine got slower: the fit follows
        fit.add(x, 40.0 + 1.0 * x)
    a, b = fit.coefficients
    assert a == pytest.approx(40.0, rel=0.05) and b == pytest.approx(1.0, rel=0.05)


def test_linear_fit_drops_absurd_observations() -> None:
    fit = LinearFit(1.0, 1.0)
    for x, y in ((-1, 5.0), (1, float("nan")), (1, -3.0), (1, 1e12), (float("inf"), 1.0)):
        fit.add(x, y)
    assert fit.n == 0 and fit.coefficients == (1.0, 1.0)


def test_one_x_keeps_the_prior_slope() -> None:
    fit = LinearFit(0.0, 0.25)
    for _ in range(10):
        fit.add(400, 120.0)
    a, b = fit.coefficients
    assert b == 0.25 and a == pytest.approx(20.0)


def test_calibration_becomes_calibrated_from_observations() -> None:
    cal = Calibration()
    assert not cal.model().calibrated
    for i in range(MIN_OBSERVATIONS):
        cal.prefill_took(200 + 200 * i, 20.0 + 0.5 * (200 + 200 * i))
    assert not cal.model().calibrated  # no decode step seen yet
    for _ in range(MIN_OBSERVATIONS):
        cal.decode_took(decodes=4, tokens=31, span_ms=31 * 12.0 + 100.0, prefill_ms_meanwhile=100.0)
    m = cal.model()
    assert m.calibrated
    assert m.prefill_ms_per_token == pytest.approx(0.5) and m.step_ms == pytest.approx(12.0)
    assert m.hop_ms == pytest.approx(m.prefill_base_ms)  # no P/D stream seen: a second entry's fixed cost
    cal.hop_took(17.0)
    assert cal.model().hop_ms == pytest.approx(17.0)


def test_instance_work_queue_and_decaying_share() -> None:
    cost = dataclasses.replace(SMALL, prefill_base_ms=0.0, prefill_ms_per_token=1.0, share_window_ms=1000.0)
    work = InstanceWork()
    work.prefill_placed(500, now_ms=0.0, window_ms=1000.0)
    load = work.load(cost, 0.0, usable=True, can_prefill_for_others=True, can_decode=True, cached_tokens=0,
                     outstanding=1, retry_at=0.0)
    assert (load.backlog_ms, load.recent_prefill_ms) == (500.0, 500.0)
    work.prefill_ended(500)
    work.prefill_ended(500)  # ended twice (a retry's bookkeeping): never below zero
    load = work.load(cost, 1000.0, usable=True, can_prefill_for_others=True, can_decode=True, cached_tokens=0,
                     outstanding=0, retry_at=0.0)
    assert load.backlog_ms == 0.0
    assert load.recent_prefill_ms == pytest.approx(500.0 / 2.718281828, rel=1e-6)  # one window later: 1/e of it


def test_a_loaded_fleet_splits_into_roles_and_keeps_them() -> None:
    """Nothing meets a tight TPOT objective (both instances decode and prefill): the prompt is prefilled on the
    instance with fewer decodes and decoded on the one prefilling less; applying that decision again (P's prefill
    share up, its decodes draining; D's decodes up) keeps the same roles while the fleet stays loaded."""
    loads = [both(decodes=6, recent_prefill_ms=900.0), both(decodes=9, recent_prefill_ms=1100.0)]
    for step in range(5):
        d = decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
        assert (d.prefill, d.decode) == (0, 1), (step, d)
        p, dd = loads[0], loads[1]
        loads[0] = dataclasses.replace(p, recent_prefill_ms=min(1900.0, p.recent_prefill_ms + 150.0),
                                       decodes=max(0, p.decodes - 1))
        loads[1] = dataclasses.replace(dd, decodes=dd.decodes + 1)
    # P without decodes: its prefills stretch nobody's, and the placement meets the objectives again.
    loads[0] = dataclasses.replace(loads[0], decodes=0)
    loads[1] = dataclasses.replace(loads[1], recent_prefill_ms=600.0)  # room for decodes, none for a prefill
    d = decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
    assert (d.prefill, d.decode, d.reason) == (0, 1, "slo_met"), d


def test_roles_dissolve_when_the_load_falls() -> None:
    """The same fleet, idle again: computed where it decodes."""
    loads = [both(recent_prefill_ms=10.0), both(decodes=1)]
    d = decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
    assert d.path == "local" and d.reason == "slo_met"


def test_what_an_instance_s_streams_showed_overrules_a_rosier_model() -> None:
    """The model says a local prefill on the idle-looking instance 1 fits; its streams lately had a TPOT over the
    objective (what the model does not see: another tenant, a slower device, a tail): no longer local there."""
    loads = [both(can_decode=False), both(decodes=2)]
    assert decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL).path == "local"
    loads[1] = dataclasses.replace(loads[1], observed_tpot_ms=26.0)
    d = decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_ITL)
    assert (d.prefill, d.decode) == (0, 1) and d.reason == "slo_best_effort", d  # the split: the best left


def test_observed_tpot_counts_only_recent_streams() -> None:
    work = InstanceWork()
    for i in range(3):
        work.tpot_seen(1000.0 * i, 10.0 + i)
    assert work.observed_tpot_ms(3000.0) is None  # too few
    work.tpot_seen(3000.0, 30.0)
    assert work.observed_tpot_ms(3000.0) == 30.0  # the 90th percentile of 10, 11, 12, 30
    assert work.observed_tpot_ms(12_500.0) is None  # 10 s on: the first three have aged out
    for bad in (float("nan"), -1.0, 1e12):
        work.tpot_seen(4000.0, bad)
    assert len(work._tpots) == 4


def test_when_ttft_is_what_fails_the_roles_do_not_split() -> None:
    """Loaded by prefills (queues past the TTFT objective everywhere, TPOT fine): splitting would leave one
    instance to prefill on; the least damaging placement is taken instead, computed where it decodes."""
    loads = [both(backlog_ms=3000.0, decodes=1), both(backlog_ms=2500.0, decodes=1)]
    d = decide(loads, prompt_tokens=960, cost=SMALL, objectives=TIGHT_TTFT)
    assert (d.reason, d.path, d.decode) == ("slo_best_effort", "local", 1), d
