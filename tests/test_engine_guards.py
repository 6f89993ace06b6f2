"""The divergence guard: an absurd but finite average is skipped on every worker alike, and a run whose rounds keep
being skipped stops with an error instead of finishing with a dead model."""

from __future__ import annotations

import logging
import re

import pytest
import torch

from hf_diloco.core.rounds.rounds import DivergenceGuard, TrainingDivergedError
from tests.dist_utils import run_on_processes
from tests.engine_common import INNER_LR, inner_step, tiny_model

H = 2
BLOWN_UP = (6, 10, 12)  # rounds launched after these inner steps get a pseudo-gradient of about 1e4 from worker 1


def _diverging_worker(rank: int, world: int) -> dict:
    from hf_diloco import DiLoCo, DiLoCoConfig

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("hf_diloco.core.rounds.rounds").addHandler(handler)
    model = tiny_model(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    # The guard alone: robust clipping, on by default, would scale worker 1's blown-up rounds down first.
    config = DiLoCoConfig(inner_steps=H, outer_lr=1.0, outer_momentum=0.0, max_skipped_rounds=2, robust_clip_factor=0)
    engine = DiLoCo(model, optimizer, config)
    records, theta_g, error = [], {}, None
    engine.add_observer(lambda record: records.append((record.step, record.rejected)))
    try:
        for t in range(1, 7 * H + 1):
            inner_step(model, optimizer, rank, t)
            if rank == 1 and t in BLOWN_UP:
                with torch.no_grad():  # a worker whose training blew up, short of NaN
                    for param in model.parameters():
                        param.add_(1e4)
            before = {n: v.clone() for n, v in engine.global_parameters().items()}
            engine.step()
            theta_g[t] = (before, {n: v.clone() for n, v in engine.global_parameters().items()})
            if t == BLOWN_UP[0]:
                local_after_skip = {n: p.detach().clone() for n, p in model.named_parameters()}
    except TrainingDivergedError as raised:
        error = (t, str(raised))
    return {
        "records": records,
        "error": error,
        "stats": dict(engine.stats),
        "theta_g": theta_g,
        "local_after_skip": local_after_skip,
        "messages": messages,
    }


def _poisoned_first_round(rank: int, factor: float | None) -> dict:
    """The defaults (or `robust_clip_factor` = `factor`), two workers: worker 1's weights are all 15 before the first
    exchange. θg before and after that exchange, worker 0's (honest) pseudo-gradient norm, the warnings, the stats
    and the closing summary."""
    from hf_diloco import DiLoCo, DiLoCoConfig
    from hf_diloco.integrations.run_summary import closing_summary

    messages: list[str] = []
    handler = logging.Handler()
    handler.emit = lambda record: messages.append(record.getMessage())
    logging.getLogger("hf_diloco.core.rounds.rounds").addHandler(handler)
    model = tiny_model(layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    config = DiLoCoConfig(inner_steps=H) if factor is None else DiLoCoConfig(inner_steps=H, robust_clip_factor=factor)
    engine = DiLoCo(model, optimizer, config)
    before = torch.cat([v.flatten().clone() for v in engine.global_parameters().values()])
    for t in range(1, H + 1):
        inner_step(model, optimizer, rank, t)
        if rank == 1 and t == 1:
            with torch.no_grad():  # the case: a worker whose weights are 15 before the first exchange
                for param in model.parameters():
                    param.fill_(15.0)
        engine.step()
    after = torch.cat([v.flatten().clone() for v in engine.global_parameters().values()])
    logging.getLogger("hf_diloco.core.rounds.rounds").removeHandler(handler)
    return {
        "moved": float((after - before).norm()),
        "largest": (float(before.abs().max()), float(after.abs().max())),
        "pseudo_grad_norm": engine.stats["pseudo_grad_norm"],
        "clipped_workers": dict(engine.stats.clipped_workers),
        "messages": messages,
        "summary": closing_summary(engine),
        "config": (config.robust_clip_factor, config.outer_lr, config.outer_momentum),
    }


def _both_cases(rank: int, world: int) -> dict:
    # One launch for every multi-process case: spawning the processes costs more than any run.
    return {
        "garbage": _garbage_before_the_first_exchange(rank, world),
        "diverging": _diverging_worker(rank, world),
        "poisoned": _poisoned_first_round(rank, None),
        "poisoned_unclipped": _poisoned_first_round(rank, 0.0),
    }


@pytest.fixture(scope="module")
def two_workers():
    return run_on_processes(_both_cases, 2)


@pytest.mark.timeout(300)
def test_absurd_rounds_are_skipped_everywhere_and_a_run_that_keeps_diverging_stops(two_workers):
    results = [result["diverging"] for result in two_workers]
    for result in results:
        # Rounds at 2, 4 applied (the history), 6 skipped, 8 applied, 10 and 12 skipped: two in a row stop the run.
        assert result["records"] == [(2, None), (4, None), (6, "divergent"), (8, None), (10, "divergent")] + [
            (12, "divergent")
        ]
        assert result["error"] is not None and result["error"][0] == 12
        assert "2 outer rounds of fragment 0 in a row were skipped, the last at inner step 12" in result["error"][1]
        assert "divergence_factor=100" in result["error"][1]
        assert result["stats"]["skipped_divergent"] == 3 and result["stats"]["outer_steps"] == 3
        before, after = result["theta_g"][6]
        assert all(torch.equal(before[n], after[n]) for n in before)  # θg untouched by the skipped round
        assert all(torch.equal(result["local_after_skip"][n], after[n]) for n in after)  # every worker restarts at θg
        moved, applied = result["theta_g"][8]
        assert any(not torch.equal(moved[n], applied[n]) for n in moved)  # the next healthy round goes through
        assert sum("Skipped the outer round of fragment 0 at inner step" in m for m in result["messages"]) == 3
    for name, value in results[0]["theta_g"][10][1].items():
        assert torch.equal(value, results[1]["theta_g"][10][1][name])  # the workers still agree bitwise


def test_guard_compares_with_the_median_of_recent_applied_rounds():
    guard = DivergenceGuard(factor=10.0, max_skipped=0)
    assert guard.judge(0, True, 1e9) == (None, "")  # no history yet: nothing to compare with
    guard.applied(0, 0.0)  # a round at learning rate 0 moves nothing: not a scale to compare with
    assert guard.judge(0, True, 1e9) == (None, "")
    for scale in (1.0, 2.0, 3.0, 4.0, 5.0, 6.0):
        guard.applied(0, scale)
    assert guard.scales[0] == [2.0, 3.0, 4.0, 5.0, 6.0]  # the last five
    assert guard.judge(0, True, 40.0)[0] is None  # 10 x the median 4
    reason, why = guard.judge(0, True, 41.0)
    assert reason == "divergent" and "41" in why and "median 4" in why
    assert guard.judge(1, True, 1e9)[0] is None  # every fragment has its own history
    assert guard.judge(0, False, 0.0)[0] == "nonfinite"
    assert DivergenceGuard(factor=0.0, max_skipped=0, scales={0: [1.0]}).judge(0, True, 1e9)[0] is None


def test_guard_counts_rejections_in_a_row_and_its_state_round_trips():
    guard = DivergenceGuard(factor=10.0, max_skipped=3)
    guard.rejected(0, 4, "why")
    guard.rejected(0, 6, "why")
    guard.applied(0, 1.0)  # an applied round ends the streak
    guard.rejected(0, 8, "why")
    guard.rejected(1, 8, "why")  # another fragment's streak is its own
    guard.rejected(0, 10, "why")
    guard.stop_if_diverged(0)  # two in a row: below the limit
    restored = DivergenceGuard(factor=10.0, max_skipped=3)
    restored.load_state_dict(guard.state_dict())
    assert restored == guard and restored.last_rejection == guard.last_rejection
    restored.rejected(0, 12, "its average is absurd")
    with pytest.raises(TrainingDivergedError, match="3 outer rounds of fragment 0 in a row.*step 12: its average"):
        restored.stop_if_diverged(0)
    never = DivergenceGuard(factor=10.0, max_skipped=0)
    for step in range(10):
        never.rejected(0, step, "why")
    never.stop_if_diverged(0)
    empty = DivergenceGuard(factor=10.0, max_skipped=3)
    empty.load_state_dict(None)  # a checkpoint written before the guard existed
    assert empty.scales == {} and empty.skipped_in_a_row == {}


def _garbage_before_the_first_exchange(rank: int, world: int) -> dict:
    from hf_diloco import DiLoCo, DiLoCoConfig

    model = tiny_model(layers=1)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    config = DiLoCoConfig(inner_steps=H, outer_lr=1.0, outer_momentum=0.0, robust_clip_factor=0)  # the guard alone
    engine = DiLoCo(model, optimizer, config)
    records, scales = [], [max(float(v.abs().max()) for v in engine.global_parameters().values())]
    engine.add_observer(lambda record: records.append((record.step, record.rejected)))
    for t in range(1, 2 * H + 1):
        inner_step(model, optimizer, rank, t)
        if rank == 1 and t == 1:
            with torch.no_grad():  # this worker's weights are garbage before the first exchange
                for param in model.parameters():
                    param.fill_(30.0)
        engine.step()
        if t % H == 0:
            scales.append(max(float(v.abs().max()) for v in engine.global_parameters().values()))
    return {"records": records, "scales": scales, "skipped": engine.stats.skipped_divergent}


@pytest.mark.timeout(300)
def test_garbage_weights_before_the_first_exchange_are_rejected_in_round_one(two_workers):
    """One worker's weights all 30 before the first exchange: with no history to compare with, the round is judged
    against θg's own scale and rejected on both workers; θg keeps its scale and the next round goes through."""
    for result in (result["garbage"] for result in two_workers):
        assert result["records"] == [(H, "divergent"), (2 * H, None)]
        assert result["skipped"] == 1
        initial, after_first, after_second = result["scales"]
        assert after_first == initial and after_second < 2 * initial, result["scales"]


@pytest.mark.timeout(300)
def test_a_poisoned_first_round_moves_theta_g_at_most_the_factor_times_an_honest_step_and_names_the_worker(
    two_workers,
):
    """Issue 51's case on the defaults: worker 1's weights are 15 before the first exchange. Its pseudo-gradient,
    thousands of times the honest one's norm, is scaled down to robust_clip_factor x the lower median (here worker 0's
    norm), so θg moves by at most that factor times the step worker 0's pseudo-gradient alone makes (the first outer
    step of Nesterov SGD moves θg by outer_lr x (1 + outer_momentum) x the average). Both workers name worker 1 in a
    warning and in the run's closing summary. Without the defence (robust_clip_factor 0) the same round moves θg
    hundreds of times further."""
    for result in two_workers:
        poisoned, unclipped = result["poisoned"], result["poisoned_unclipped"]
        factor, outer_lr, momentum = poisoned["config"]
        assert factor > 1  # the defence is on by default
        honest_step = outer_lr * (1 + momentum) * two_workers[0]["poisoned"]["pseudo_grad_norm"]
        assert poisoned["moved"] <= factor * honest_step, (poisoned["moved"], honest_step)
        assert unclipped["moved"] > 100 * factor * honest_step, (unclipped["moved"], honest_step)
        assert poisoned["largest"][1] < 2 * poisoned["largest"][0] < unclipped["largest"][1], (poisoned, unclipped)
        assert poisoned["clipped_workers"] == {"worker 1": 1} and unclipped["clipped_workers"] == {}
        [warning] = [m for m in poisoned["messages"] if m.startswith("robust aggregation")]
        assert re.fullmatch(
            r"robust aggregation scaled down the pseudo-gradient of worker 1 in the exchange of fragment 0 at inner "
            r"step 2: its norm was [0-9.e+]+ x the lower median of the contributors' norms, above robust_clip_factor "
            r"\(0 turns this defence off\)",
            warning,
        ), warning
        assert poisoned["summary"] == [
            f"robust aggregation scaled down the pseudo-gradient of worker 1 in 1 exchange (robust_clip_factor {factor:g})"
        ]


def test_a_round_without_history_is_bounded_by_theta_g_own_scale():
    guard = DivergenceGuard(factor=100.0, max_skipped=0, absolute_factor=10.0)
    reason, why = guard.judge(0, True, 15.0, theta_scale=1.0)
    assert reason == "divergent" and "15 x θg's own largest value 1" in why and "first_round_factor=10" in why
    assert guard.judge(0, True, 9.0, theta_scale=1.0) == (None, "")
    assert guard.judge(0, True, 1e9, theta_scale=0.0) == (None, ""), "θg all zeros: nothing to bound by"
    guard.applied(0, 0.5)  # with a history the median decides: 15 is 30 x 0.5, under divergence_factor 100
    assert guard.judge(0, True, 15.0, theta_scale=1.0) == (None, "")
    assert DivergenceGuard(factor=100.0, max_skipped=0).judge(0, True, 1e9, theta_scale=1.0) == (None, "")


def test_outer_updates_that_keep_growing_are_warned_about_once(caplog):
    warm_up, blowing_up = DivergenceGuard(100.0, 0), DivergenceGuard(100.0, 0)
    with caplog.at_level(logging.WARNING, logger="hf_diloco.core.rounds.rounds"):
        for round_ in range(1, 9):
            warm_up.applied(0, 0.01 * round_)  # a linear learning-rate warm-up
        assert not caplog.records
        for round_ in range(8):
            blowing_up.applied(0, 0.01 * 2.0**round_)
    warnings = [r.getMessage() for r in caplog.records]
    assert len(warnings) == 1 and "fragment 0 grew at least 1.5x in each of its last 4 rounds" in warnings[0]
