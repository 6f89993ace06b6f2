"""`round_policy: balanced`: a worker's steps per round follow its speed, the average is weighted by steps trained.

Real gloo workers whose steps are paced to a fixed length (`tests.engine_common.pace`), one worker's twice as long,
so its speed is exactly half the other's whatever the machine's load.
"""

from __future__ import annotations

import io
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hf_diloco import DiLoCo, DiLoCoConfig
from hf_diloco.core.layout.topology import Topology
from hf_diloco.core.rounds.round_policy import BalancedRounds, plan_round_steps
from tests.dist_utils import free_port, run_on_processes
from tests.engine_common import INNER_LR, inner_step, pace, tiny_model

REPO = Path(__file__).resolve().parents[1]
H = 8
ROUNDS = 5


def _config(policy: str, **extra) -> DiLoCoConfig:
    # Outer lr 1 without momentum: θg <- θg - avg, so the test's own average predicts θg exactly.
    return DiLoCoConfig(
        inner_steps=H, outer_lr=1.0, outer_momentum=0.0, round_policy=policy, sync_timeout_seconds=60, **extra
    )


def _timed_step(model, optimizer, rank: int, step: int) -> None:
    began = time.perf_counter()
    inner_step(model, optimizer, rank, step)
    pace(began, slowed=rank == 1)


def _vector(model) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1).float() for p in model.parameters()])


def _global_vector(engine: DiLoCo) -> torch.Tensor:
    values = engine.global_parameters()
    return torch.cat([values[name].reshape(-1) for name, _ in engine.model.named_parameters()])


def _run(rank: int, world: int, policy: str, resume_at: int | None = None, extra: dict | None = None) -> dict:
    """ROUNDS rounds; per round this worker's θm at its launch, θg before and after, its steps and wait fraction. With
    `resume_at`, the engine is saved after that many inner steps and a new one continues from the saved state."""
    torch.manual_seed(0)
    model = tiny_model()
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(model, optimizer, _config(policy, **(extra or {})))
    rounds: list[dict] = []
    start = _global_vector(engine)
    step = 0
    while engine.outer_rounds < ROUNDS:
        step += 1
        _timed_step(model, optimizer, rank, step)
        before = _vector(model)
        engine.step()
        if engine.outer_rounds > len(rounds):
            after = _global_vector(engine)
            rounds.append(
                {
                    "local": before,
                    "start": start,
                    "global": after,
                    "steps": engine.metrics().get("diloco/round_steps"),
                    "wait_fraction": engine.metrics()["diloco/wait_fraction"],
                }
            )
            start = after
        if step == resume_at:
            buffer = io.BytesIO()
            torch.save(engine.state_dict(), buffer)
            torch.manual_seed(1)  # a different initialisation: everything must come from the saved state
            model = tiny_model(seed=1)
            optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
            engine = DiLoCo(model, optimizer, _config(policy))
            engine.load_state_dict(torch.load(io.BytesIO(buffer.getvalue()), weights_only=False))
    steps_per_round = [record["steps"] for record in rounds]
    engine.close()
    return {
        "rounds": rounds,
        "inner_step": engine.inner_step,
        "steps_per_round": steps_per_round,
        "final": _global_vector(engine),
    }


@pytest.mark.timeout(180)
def test_balanced_rounds_keep_the_fast_worker_busy_and_weight_the_average_by_steps():
    """One worker at half speed: with `balanced` it runs H/2 steps per round from round 2 and the fast worker waits
    at most 10% of a round after round 2 (the mean of its rounds) (about half with `steps`); θg is the same on both, bit for bit, and equals
    the steps-weighted average of the workers' pseudo-gradients computed here."""
    fast, slow = run_on_processes(_run, 2, "balanced", timeout_seconds=120)
    assert fast["steps_per_round"] == [H] * ROUNDS
    assert slow["steps_per_round"] == [H] + [H // 2] * (ROUNDS - 1)
    assert fast["inner_step"] == ROUNDS * H and slow["inner_step"] == H + (ROUNDS - 1) * H // 2
    waits = [record["wait_fraction"] for record in fast["rounds"][2:]]
    assert sum(waits) / len(waits) <= 0.10, waits
    assert torch.equal(fast["final"], slow["final"])
    for index, (mine, theirs) in enumerate(zip(fast["rounds"], slow["rounds"])):
        assert torch.equal(mine["global"], theirs["global"]), index
        weights = (H, H if index == 0 else H // 2)  # the steps each trained in this round
        deltas = [mine["start"] - mine["local"], theirs["start"] - theirs["local"]]
        average = (weights[0] * deltas[0] + weights[1] * deltas[1]) / sum(weights)
        torch.testing.assert_close(mine["global"], mine["start"] - average, rtol=0, atol=1e-6)

    fast_steps, _ = run_on_processes(_run, 2, "steps", timeout_seconds=120)
    assert fast_steps["steps_per_round"] == [None] * ROUNDS  # no per-worker plan under `steps`
    waits = [record["wait_fraction"] for record in fast_steps["rounds"][2:]]
    assert sum(waits) / len(waits) >= 0.3, waits  # it waits about half of every round for the slow worker


def _bf16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).to(torch.float32)


@pytest.mark.timeout(180)
def test_error_feedback_under_balanced_keeps_the_residual_in_the_workers_own_units():
    """bf16 with error feedback, one worker at half speed: each worker sends bf16(c (Δ + ρ)), c = M w / Σ w, keeps
    ρ = (c (Δ + ρ) - sent) / c, and θg takes bf16 of the mean of what was sent (the exchange's second encode), as the
    reference here computes it round by round from each worker's own θm; both end with the same θg."""
    fast, slow = run_on_processes(_run, 2, "balanced", None, {"compression": "bf16", "error_feedback": True})
    assert slow["steps_per_round"] == [H] + [H // 2] * (ROUNDS - 1)
    residuals = [torch.zeros_like(fast["final"]), torch.zeros_like(fast["final"])]
    for index, rounds in enumerate(zip(fast["rounds"], slow["rounds"])):
        weights = (H, H if index == 0 else H // 2)
        sent = []
        for worker, record in enumerate(rounds):
            scale = 2 * weights[worker] / sum(weights)
            scaled = scale * (record["start"] - record["local"] + residuals[worker])
            sent.append(_bf16(scaled))
            residuals[worker] = (scaled - sent[-1]) / scale
        expected = rounds[0]["start"] - _bf16((sent[0] + sent[1]) / 2)
        for record in rounds:
            torch.testing.assert_close(record["global"], expected, rtol=0, atol=1e-6, msg=f"round {index + 1}")
    assert torch.equal(fast["final"], slow["final"])


@pytest.mark.timeout(180)
def test_a_balanced_run_resumed_mid_round_continues_bitwise():
    """Saved after 11 inner steps (round 2 under way on both workers, whose rounds now differ in length) and resumed
    by a new engine: the same θg after every round as the run that never stopped."""
    straight = run_on_processes(_run, 2, "balanced", timeout_seconds=120)
    resumed = run_on_processes(_run, 2, "balanced", 11, timeout_seconds=120)
    for before, after in zip(straight, resumed):
        assert before["steps_per_round"] == after["steps_per_round"]
        assert torch.equal(before["final"], after["final"])


def test_the_plan_gives_each_worker_steps_in_proportion_to_its_speed():
    """DyLU: h_w = round(v_w / v_max x H), within [fewest, H]; no plan before every worker has a measurement."""
    assert plan_round_steps([0.1, 0.2, 0.4], inner_steps=8, fewest=1) == [8, 4, 2]
    assert plan_round_steps([0.1, 0.3], inner_steps=8, fewest=1) == [8, 3]  # 8 / 3 = 2.67
    assert plan_round_steps([0.1, 1.0], inner_steps=8, fewest=2) == [8, 2]  # 0.8 is raised to the floor
    assert plan_round_steps([0.1, 0.0], inner_steps=8, fewest=1) is None


def test_streaming_weights_follow_the_steps_since_each_fragments_last_launch():
    """P = 2: fragment p launches at (p + 1) h // P of each worker's round; a launch's scale is M w / Σ w, with w the
    steps this worker trained since the fragment's previous launch (counted here by hand)."""
    policy = BalancedRounds(inner_steps=8, num_fragments=2, sync_delay=0, topology=Topology.single_process())
    policy.plan = [8, 4]  # pretend a second worker: this process is worker 0
    assert policy.launch_scale(0) == pytest.approx(2 * 4 / (4 + 2))  # first round: steps 1..4 and 1..2
    policy.previous_plan, policy.plan = [8, 4], [8, 2]
    # fragment 0: worker 0 trained 8 - 4 + 4 = 8 steps since, worker 1 4 - 2 + 1 = 3
    assert policy.launch_scale(0) == pytest.approx(2 * 8 / (8 + 3))
    # fragment 1 (the round's end): worker 0 8 - 8 + 8 = 8, worker 1 4 - 4 + 2 = 2
    assert policy.launch_scale(1) == pytest.approx(2 * 8 / (8 + 2))


@pytest.mark.parametrize(
    ("settings", "named"),
    [
        ({"overlap": "delayed"}, "overlap 'delayed'"),
        ({"lowrank_rank": 2}, "low-rank"),
    ],
)
def test_balanced_refuses_what_assumes_rounds_of_equal_length(settings, named):
    with pytest.raises(ValueError, match="round_policy 'balanced'") as raised:
        DiLoCoConfig(round_policy="balanced", **settings)
    assert named in str(raised.value)


def test_balanced_takes_elastic_membership():
    """Under a Lighthouse the exchange weighs (tests/test_elastic_balanced.py runs it)."""
    config = DiLoCoConfig(round_policy="balanced", lighthouse="http://127.0.0.1:29510", site="a")
    assert config.round_policy == "balanced" and config.lighthouse


def _plugin_loop(out: Path, rounds: int, *extra: str) -> list[dict]:
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1")
    command = [
        str(Path(sys.executable).parent / "torchrun"),
        "--nproc_per_node", "2", "--master_addr", "127.0.0.1", "--master_port", str(free_port()),
        str(REPO / "tests" / "scripts" / "balanced_plugin_loop.py"), str(out), str(rounds), *extra,
    ]  # fmt: skip
    result = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-5000:]
    return [torch.load(out / f"rank{rank}.pt", weights_only=False) for rank in range(2)]


@pytest.mark.timeout(400)
def test_a_plugin_loop_ends_at_a_round_and_resumes_from_a_round_bitwise(tmp_path):
    """DiLoCoPlugin in a user's Accelerate loop on 2 torchrun processes, one at half speed: the loop ends at
    `plugin.outer_rounds == 4` with the workers at different inner steps and the same θg, the fast worker waiting
    ≤ 10% of rounds 3 and 4; resumed with `accelerator.load_state` from the state saved at round 2, it ends with the
    same θg, bit for bit."""
    straight = _plugin_loop(tmp_path / "straight", 4, "--save_at_round", "2")
    fast, slow = straight
    assert fast["outer_rounds"] == slow["outer_rounds"] == 4
    assert fast["steps_per_round"] == [H] * 4 and slow["steps_per_round"] == [H] + [H // 2] * 3
    waits = fast["wait_fractions"][2:]
    assert len(waits) == 2 and sum(waits) / len(waits) <= 0.10, fast["wait_fractions"]
    assert (fast["inner_step"], slow["inner_step"]) == (4 * H, H + 3 * H // 2)
    for name, value in fast["global"].items():
        assert torch.equal(value, slow["global"][name]), name
    resumed = _plugin_loop(tmp_path / "resumed", 4, "--resume", str(tmp_path / "straight" / "round-2"))
    for before, after in zip(straight, resumed):
        assert after["inner_step"] == before["inner_step"]
        assert after["steps_per_round"] == before["steps_per_round"][2:]
        for name, value in before["global"].items():
            assert torch.equal(value, after["global"][name]), name


# ------------------------------------------------------------------------------------------------ DiLoCoTrainer


def _trainer_run(rank: int, world: int, out_dir: str, resume: bool) -> dict:
    from datasets import Dataset
    from transformers import TrainerCallback

    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
    from tests.engine_common import cpu_trainer_args, tiny_llama

    class HalfSpeedOnRankOne(TrainerCallback):
        def __init__(self):
            self.waits: list[float] = []  # the engine's share of each round's wall time, at the round's end
            self.trainer = None

        def on_train_begin(self, args, state, control, **kwargs):
            self.rounds = None

        def on_step_begin(self, args, state, control, **kwargs):
            self.began = time.perf_counter()

        def on_pre_optimizer_step(self, args, state, control, **kwargs):
            pace(self.began, slowed=rank == 1)  # the compute is paced; the DiLoCo step (and sync) comes after

        def on_step_end(self, args, state, control, **kwargs):
            engine = self.trainer.diloco
            if self.rounds is not None and engine.outer_rounds > self.rounds:
                self.waits.append(engine.metrics()["diloco/wait_fraction"])
            self.rounds = engine.outer_rounds

    ids = torch.randint(0, 128, (256, 16), generator=torch.Generator().manual_seed(1234)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    common = cpu_trainer_args(
        out_dir, per_device_train_batch_size=2, max_steps=4 * H, save_strategy="steps", save_steps=2 * H
    )
    args = DiLoCoTrainingArguments(
        **common, inner_steps=H, round_policy="balanced", outer_lr=1.0, outer_momentum=0.0, sync_timeout_seconds=60
    )
    pacing = HalfSpeedOnRankOne()
    trainer = DiLoCoTrainer(
        model=tiny_llama(128, layers=2, max_positions=16), args=args, train_dataset=data, callbacks=[pacing],
    )  # fmt: skip
    pacing.trainer = trainer
    trainer.train(resume_from_checkpoint=str(Path(out_dir) / f"checkpoint-{2 * H}") if resume else None)
    engine = trainer.diloco
    return {
        "global_step": trainer.state.global_step,
        "inner_step": engine.inner_step,
        "outer_rounds": engine.outer_rounds,
        "learning_rate": trainer.optimizer.param_groups[0]["lr"],
        "global": {name: value.clone() for name, value in engine.global_parameters().items()},
        "losses": [entry["loss"] for entry in trainer.state.log_history if "loss" in entry],
        "checkpoints": sorted(path.name for path in Path(out_dir).glob("checkpoint-*")),
        "wait_fractions": list(pacing.waits),
    }


@pytest.mark.timeout(400)
def test_the_trainer_counts_the_runs_position_and_resumes_a_balanced_run_bitwise(tmp_path):
    """DiLoCoTrainer on 2 processes, one at half speed, max_steps 4H, a checkpoint every 2H: both end at global step
    4H after 4 rounds, with different inner steps, the same LR (the slow worker's schedule steps H / h times per
    step) and the same θg, the fast worker waiting ≤ 10% of the rounds after the second; checkpoints are named
    alike; resumed from checkpoint-2H, θg is the same, bit for bit."""
    fast, slow = run_on_processes(_trainer_run, 2, str(tmp_path), False, timeout_seconds=300)
    waits = fast["wait_fractions"][2:]
    assert waits and sum(waits) / len(waits) <= 0.10, fast["wait_fractions"]
    assert fast["global_step"] == slow["global_step"] == 4 * H
    assert fast["outer_rounds"] == slow["outer_rounds"] == 4
    assert (fast["inner_step"], slow["inner_step"]) == (4 * H, H + 3 * H // 2)
    assert fast["learning_rate"] == slow["learning_rate"]
    assert fast["checkpoints"] == [f"checkpoint-{2 * H}", f"checkpoint-{4 * H}"]
    assert len(slow["losses"]) == slow["inner_step"]  # logged at each of its own steps, never twice
    for name, value in fast["global"].items():
        assert torch.equal(value, slow["global"][name]), name
    steps_file = tmp_path / f"checkpoint-{2 * H}" / "diloco_worker_steps.json"
    assert steps_file.is_file()
    shutil.rmtree(tmp_path / f"checkpoint-{4 * H}")
    resumed = run_on_processes(_trainer_run, 2, str(tmp_path), True, timeout_seconds=300)
    for before, after in zip((fast, slow), resumed):
        assert after["inner_step"] == before["inner_step"]
        for name, value in before["global"].items():
            assert torch.equal(value, after["global"][name]), name


@pytest.mark.parametrize(
    ("overrides", "named"),
    [
        ({"max_steps": 12}, "max_steps (12"),
        ({"save_strategy": "steps", "save_steps": 12}, "save_steps (12"),
        ({"save_strategy": "epoch"}, "save_strategy is 'epoch'"),
    ],
)
def test_the_trainer_refuses_shared_events_inside_a_round(tmp_path, overrides, named):
    from datasets import Dataset

    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
    from tests.engine_common import cpu_trainer_args, tiny_llama

    ids = torch.randint(0, 128, (32, 16), generator=torch.Generator().manual_seed(0)).tolist()
    common = cpu_trainer_args(tmp_path, per_device_train_batch_size=2, **{"max_steps": 16, **overrides})
    args = DiLoCoTrainingArguments(**common, inner_steps=H, round_policy="balanced")
    trainer = DiLoCoTrainer(
        model=tiny_llama(128, layers=1, max_positions=16), args=args,
        train_dataset=Dataset.from_dict({"input_ids": ids, "labels": ids}),
    )  # fmt: skip
    with pytest.raises(ValueError, match="round_policy 'balanced'") as raised:
        trainer.train()
    assert named in str(raised.value)
    assert not any(tmp_path.glob("checkpoint-*"))
