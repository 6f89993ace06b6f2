"""The outer learning rate's schedule: its factors against the formula written here, two real workers against the
plain-torch reference stepping each fragment's outer SGD at those rates, and where the front-ends take its length."""

from __future__ import annotations

import math

import pytest
import torch

from hf_diloco import DiLoCo, DiLoCoConfig
from tests.dist_utils import run_on_processes
from tests.engine_common import INNER_LR, inner_step, reference_run, tiny_model


def expected_factor(kind: str, k: int, total: int, warmup: int, final: float) -> float:
    """The schedule as README states it: linear warmup to 1 over `warmup` rounds, then decay to `final` at the last
    of `total` rounds."""
    if k < warmup:
        return (k + 1) / (warmup + 1)
    if kind == "constant":
        return 1.0
    progress = min(1.0, (k - warmup) / max(1, total - warmup - 1))
    if kind == "linear":
        return 1.0 + (final - 1.0) * progress
    return final + (1.0 - final) * 0.5 * (1.0 + math.cos(math.pi * progress))


@pytest.mark.parametrize("kind", ["constant", "cosine", "linear"])
@pytest.mark.parametrize("total, warmup, final", [(10, 0, 0.1), (10, 3, 0.0), (1, 0, 0.5), (4, 6, 0.2)])
def test_factors_follow_the_formula_and_end_at_the_final_fraction(kind, total, warmup, final):
    config = DiLoCoConfig(
        outer_lr_schedule=kind,
        outer_lr_total_rounds=total,
        outer_lr_warmup_rounds=warmup,
        outer_lr_final_fraction=final,
    )
    schedule = config.outer_schedule()
    if kind == "constant" and warmup == 0:
        assert schedule is None  # plain SGD, nothing added to its state
        return
    factors = [schedule.factor(k) for k in range(total + 3)]
    assert factors == pytest.approx([expected_factor(kind, k, total, warmup, final) for k in range(total + 3)])
    assert all(f > 0 for f in factors[:warmup])
    if kind != "constant" and total > warmup + 1:  # one round after the warmup: that round runs at outer_lr
        assert factors[total - 1] == pytest.approx(final) and factors[-1] == pytest.approx(final)


def test_a_decaying_schedule_needs_its_length_from_the_run_or_the_config():
    with pytest.raises(ValueError, match="outer_lr_total_rounds"):
        DiLoCo(tiny_model(), None, DiLoCoConfig(outer_lr_schedule="cosine"))
    config = DiLoCoConfig(inner_steps=4, outer_lr_schedule="cosine")
    assert config.with_outer_schedule_length(40).outer_lr_total_rounds == 10
    assert config.with_outer_schedule_length(0) is config  # unknown length: the engine refuses, naming the field
    set_by_hand = DiLoCoConfig(inner_steps=4, outer_lr_schedule="linear", outer_lr_total_rounds=3)
    assert set_by_hand.with_outer_schedule_length(40).outer_lr_total_rounds == 3
    for bad in (dict(outer_lr_schedule="step"), dict(outer_lr_final_fraction=1.5), dict(outer_lr_warmup_rounds=-1)):
        with pytest.raises(ValueError, match=next(iter(bad))):
            DiLoCoConfig(**bad)


def test_the_front_ends_session_spans_the_schedule_over_the_runs_steps():
    """EngineSession (the Trainer, the main job, the plugin) fills in R = max_steps / H; a plugin run whose length is
    unknown (no max_steps: one epoch's steps are no run's length) is refused by the engine, naming the field."""
    from hf_diloco.core.layout.topology import Topology
    from hf_diloco.integrations.engine_session import EngineSession

    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    config = DiLoCoConfig(inner_steps=4, outer_lr_schedule="cosine", outer_lr_warmup_rounds=1)
    session = EngineSession.start(model, optimizer, config, Topology.single_process(), total_steps=24)
    assert session.engine.config.outer_lr_total_rounds == 6
    assert session.metrics()["diloco/outer_lr"] == pytest.approx(0.7 * 0.5)  # the first warmup round
    session.close()
    with pytest.raises(ValueError, match="outer_lr_total_rounds"):
        EngineSession.start(
            model, optimizer, config, Topology.single_process(), total_steps=24, steps_label="steps per epoch"
        )


def test_the_schedule_is_a_field_of_every_front_end():
    from transformers import HfArgumentParser

    from hf_diloco import DiLoCoTrainingArguments

    (args,) = HfArgumentParser(DiLoCoTrainingArguments).parse_args_into_dataclasses(
        ["--output_dir", "out", "--outer_lr_schedule", "linear", "--outer_lr_warmup_rounds", "2", "--use_cpu"]
    )
    config = args.diloco_config()
    assert (config.outer_lr_schedule, config.outer_lr_warmup_rounds) == ("linear", 2)


CASES = {
    "streaming_cosine": dict(
        config=dict(inner_steps=4, num_fragments=2, sync_delay=1, merge_alpha=0.5, outer_lr_schedule="cosine"),
        schedule=dict(kind="cosine", total=4, warmup=1, final=0.1),
    ),
    "delayed_warmup_then_linear": dict(
        config=dict(inner_steps=4, overlap="delayed", outer_lr_schedule="linear"),
        schedule=dict(kind="linear", total=4, warmup=1, final=0.1),
    ),
}
STEPS = 16  # whole rounds: four of each fragment


def _train(rank: int, world: int) -> dict:
    results = {}
    for name, case in CASES.items():
        schedule = case["schedule"]
        config = DiLoCoConfig(
            **case["config"],
            outer_lr_total_rounds=schedule["total"],
            outer_lr_warmup_rounds=schedule["warmup"],
            outer_lr_final_fraction=schedule["final"],
        )
        model = tiny_model()
        optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
        engine = DiLoCo(model, optimizer, config)
        for t in range(1, STEPS + 1):
            inner_step(model, optimizer, rank, t)
            engine.step()
        engine.close()
        results[name] = {"global": engine.global_parameters(), "local": dict(model.named_parameters())}
    return results


@pytest.mark.timeout(300)
def test_two_workers_step_each_fragment_at_the_scheduled_rates_like_the_reference():
    ranks = run_on_processes(_train, 2, timeout_seconds=200)
    for name, case in CASES.items():
        config, schedule = case["config"], case["schedule"]
        kind, total, warmup, final = (schedule[key] for key in ("kind", "total", "warmup", "final"))
        run = dict(
            sync_delay=config.get("sync_delay", 0),
            alpha=config.get("merge_alpha", 0.5),
            overlap=config.get("overlap", "streaming"),
        )
        shape = (2, STEPS, config["inner_steps"], config.get("num_fragments", 1))
        factors = [expected_factor(kind, k, total, warmup, final) for k in range(total)]
        glob = reference_run(*shape, **run, outer_lr_factor=factors.__getitem__)[1]
        constant_lr = reference_run(*shape, **run)[1]
        for param, value in glob.items():
            assert torch.equal(ranks[0][name]["global"][param], ranks[1][name]["global"][param]), (name, param)
            torch.testing.assert_close(ranks[0][name]["global"][param], value, atol=1e-5, rtol=0)
        differs = max(float((glob[p] - constant_lr[p]).abs().max()) for p in glob)
        assert differs > 1e-4, name  # the schedule changed the outcome: the comparison above can fail
