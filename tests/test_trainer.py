"""DiLoCoTrainingArguments and DiLoCoTrainer: argument handling, and docs/design.md invariants 1, 2, 4 and 5 on real
gloo processes running the real Trainer (tiny Llama, CPU)."""

from __future__ import annotations

import functools
import inspect
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from datasets import Dataset
from transformers import (
    AutoModelForCausalLM,
    HfArgumentParser,
    LlamaForCausalLM,
    Trainer,
    TrainerCallback,
    TrainingArguments,
)

from hf_diloco.core.settings.config import DiLoCoConfig
from hf_diloco.integrations.trainer import DiLoCoTrainer, DiLoCoTrainingArguments
from tests.dist_utils import free_port, run_on_processes
from tests.engine_common import assert_resumed_bitwise, cpu_trainer_args, tiny_llama

REPO = Path(__file__).resolve().parents[1]
VOCAB, SEQ, SAMPLES = 128, 16, 64
H, STEPS, MID_ROUND_CHECKPOINT = 4, 12, 6


def _tiny_model() -> LlamaForCausalLM:
    return tiny_llama(VOCAB, layers=2, max_positions=SEQ)


def _dataset() -> Dataset:
    generator = torch.Generator().manual_seed(1234)
    ids = torch.randint(0, VOCAB, (SAMPLES, SEQ), generator=generator).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def _common_args(output_dir: Path, **overrides) -> dict:
    return cpu_trainer_args(output_dir, **{"per_device_train_batch_size": 2, "max_steps": STEPS, **overrides})


def _global_parameters(trainer: DiLoCoTrainer) -> dict[str, torch.Tensor]:
    return {name: value.clone() for name, value in trainer.diloco.global_parameters().items()}


def _losses(trainer: Trainer) -> dict[int, float]:
    return {entry["step"]: entry["loss"] for entry in trainer.state.log_history if "loss" in entry}


# ------------------------------------------------------------------------------------------------ arguments


def test_arguments_accept_every_diloco_field_and_convert_to_config(tmp_path):
    args = DiLoCoTrainingArguments(
        output_dir=str(tmp_path), use_cpu=True, inner_steps=8, num_fragments=4, sync_delay=1, compression="int8"
    )
    assert isinstance(args, TrainingArguments)
    config = args.diloco_config()
    assert type(config) is DiLoCoConfig
    assert config == DiLoCoConfig(inner_steps=8, num_fragments=4, sync_delay=1, compression="int8")
    # One definition of each field: the dataclass fields of DiLoCoConfig are inherited, not redeclared.
    assert "inner_steps" not in DiLoCoTrainingArguments.__dict__.get("__annotations__", {})


def test_hf_argument_parser_reads_diloco_flags(tmp_path):
    parser = HfArgumentParser(DiLoCoTrainingArguments)
    (args,) = parser.parse_args_into_dataclasses(
        [
            "--output_dir", str(tmp_path), "--use_cpu", "--inner_steps", "10", "--num_fragments", "2",
            "--outer_lr", "0.5", "--compression", "fp8", "--no_outer_nesterov", "--learning_rate", "3e-4",
        ]
    )  # fmt: skip
    assert (args.inner_steps, args.num_fragments, args.outer_lr, args.compression) == (10, 2, 0.5, "fp8")
    assert args.outer_nesterov is False and args.learning_rate == 3e-4
    with pytest.raises(SystemExit):  # argparse refuses a value outside the field's choices
        parser.parse_args_into_dataclasses(["--output_dir", str(tmp_path), "--compression", "zip"])
    with pytest.raises(ValueError, match="num_fragments"):
        parser.parse_args_into_dataclasses(
            ["--output_dir", str(tmp_path), "--inner_steps", "10", "--num_fragments", "3"]
        )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("inner_steps", 0),
        ("outer_lr", -1.0),
        ("outer_momentum", 1.0),
        ("merge_alpha", 1.5),
        ("compression", "int3"),
        ("fragment_pattern", "random"),
        ("overlap", "sometimes"),
        ("sync_delay", 5),
        ("data_parallel_per_worker", 0),
    ],
)
def test_bad_values_raise_value_error_naming_the_field(tmp_path, field, value):
    with pytest.raises(ValueError, match=field):
        DiLoCoTrainingArguments(output_dir=str(tmp_path), use_cpu=True, **{"inner_steps": 4, field: value})


def test_collective_prone_accelerator_settings_are_refused(tmp_path):
    args = DiLoCoTrainingArguments(output_dir=str(tmp_path), use_cpu=True)
    assert args.accelerator_config.dispatch_batches is False
    with pytest.raises(ValueError, match="dispatch_batches"):
        DiLoCoTrainingArguments(output_dir=str(tmp_path), use_cpu=True, accelerator_config={"dispatch_batches": True})
    with pytest.raises(ValueError, match="use_seedable_sampler"):
        DiLoCoTrainingArguments(
            output_dir=str(tmp_path), use_cpu=True, accelerator_config={"use_seedable_sampler": False}
        )


@pytest.mark.timeout(120)
def test_bad_value_fails_before_any_process_group_work(tmp_path):
    """Under a 2-process launch environment whose peer never comes, a bad value must still fail at once: validation
    runs before TrainingArguments sets up devices or the process group (which would wait for the peer)."""
    code = textwrap.dedent(
        f"""
        import torch.distributed as dist
        from hf_diloco.integrations.trainer import DiLoCoTrainingArguments
        try:
            DiLoCoTrainingArguments(output_dir={str(tmp_path)!r}, inner_steps=6, num_fragments=4)
        except ValueError as error:
            assert "num_fragments" in str(error), error
            assert not dist.is_initialized()
            print("REFUSED")
        """
    )
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        RANK="0",
        LOCAL_RANK="0",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(free_port()),
        OMP_NUM_THREADS="1",
    )
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=100)
    assert result.returncode == 0 and "REFUSED" in result.stdout, result.stderr[-3000:]


def test_trainer_refuses_plain_training_arguments(tmp_path):
    with pytest.raises(TypeError, match="DiLoCoTrainingArguments"):
        DiLoCoTrainer(model=_tiny_model(), args=TrainingArguments(output_dir=str(tmp_path), use_cpu=True))


# ------------------------------------------------------------------------------------------------ invariant 2


def _ddp_then_diloco(rank: int, world: int, out_dir: str) -> dict:
    out = Path(out_dir)
    data = _dataset()
    common = _common_args(out / "ddp", optim="sgd", max_steps=6, max_grad_norm=0.0)
    ddp = Trainer(model=_tiny_model(), args=TrainingArguments(**common), train_dataset=data)
    ddp.train()
    common["output_dir"] = str(out / "diloco")
    args = DiLoCoTrainingArguments(**common, inner_steps=1, outer_lr=1.0, outer_momentum=0.0, compression="none")
    diloco = DiLoCoTrainer(model=_tiny_model(), args=args, train_dataset=data)
    diloco.train()
    return {
        "ddp_losses": _losses(ddp),
        "ddp_params": {n: p.detach().clone() for n, p in ddp.model.named_parameters()},
        "diloco_losses": _losses(diloco),
        "diloco_global": _global_parameters(diloco),
        "diloco_is_ddp": isinstance(diloco.model_wrapped, torch.nn.parallel.DistributedDataParallel),
    }


@pytest.mark.timeout(300)
def test_one_inner_step_outer_lr_one_equals_plain_ddp(tmp_path):
    """Invariant 2: H=1, outer_lr=1, no outer momentum, no compression is plain data-parallel training.

    The inner optimizer is SGD: DDP averages the workers' gradients before one SGD step, DiLoCo with H=1 averages the
    workers' one-step parameter deltas, and for SGD the delta is linear in the gradient, so both are the same update.
    (With AdamW the delta is not linear in the gradient and the two genuinely differ.) Gradient clipping is off for
    the same reason: clipping each worker's gradient is not clipping their mean."""
    results = run_on_processes(_ddp_then_diloco, 2, str(tmp_path), timeout_seconds=240)
    ddp = results[0]
    assert not any(r["diloco_is_ddp"] for r in results), "one-process workers must not be wrapped in DDP"
    assert sorted(ddp["ddp_losses"]) == list(range(1, 7))
    worker_losses = [r["diloco_losses"] for r in results]
    assert worker_losses[0] != worker_losses[1], "the workers must read different shards"
    for step, loss in ddp["ddp_losses"].items():
        mean = sum(losses[step] for losses in worker_losses) / len(worker_losses)
        assert mean == pytest.approx(loss, abs=1e-5), step
    initial = dict(_tiny_model().named_parameters())
    for name, value in ddp["ddp_params"].items():
        assert not torch.equal(value, initial[name].detach()), f"{name} did not train"
        for r in results:
            torch.testing.assert_close(r["diloco_global"][name], value, atol=1e-5, rtol=0)


def _ddp_then_diloco_two_per_worker(rank: int, world: int, out_dir: str) -> dict:
    out = Path(out_dir)
    data = _dataset()
    common = _common_args(out / "ddp", optim="sgd", max_steps=4, max_grad_norm=0.0)
    ddp = Trainer(model=_tiny_model(), args=TrainingArguments(**common), train_dataset=data)
    ddp.train()
    recorder = _CollectiveRecorder()
    common["output_dir"] = str(out / "diloco")
    args = DiLoCoTrainingArguments(
        **common, inner_steps=1, outer_lr=1.0, outer_momentum=0.0, data_parallel_per_worker=2
    )
    diloco = DiLoCoTrainer(model=_tiny_model(), args=args, train_dataset=data, callbacks=[_PhaseCallback(recorder)])
    diloco.train()
    wrapped = diloco.model_wrapped
    return {
        "ddp_losses": _losses(ddp),
        "ddp_params": {n: p.detach().clone() for n, p in ddp.model.named_parameters()},
        "diloco_losses": _losses(diloco),
        "diloco_global": _global_parameters(diloco),
        "ddp_group": dist.get_process_group_ranks(wrapped.process_group)
        if hasattr(wrapped, "process_group")
        else None,
        "calls": recorder.calls,
        "outer_peers": diloco.diloco_topology.outer_peers(),
    }


@pytest.mark.timeout(400)
def test_two_data_parallel_ranks_per_worker_equal_plain_ddp(tmp_path):
    """2 workers x 2 data-parallel ranks with H=1, outer_lr=1: DDP runs inside each worker (its own group, token
    count and loss scale of the worker), the outer sync averages the two workers, and the result is plain DDP over
    the 4 processes (SGD, no clipping, as in the test above). During steps, collectives stay in a worker, except the
    outer sync itself."""
    results = run_on_processes(_ddp_then_diloco_two_per_worker, 4, str(tmp_path), timeout_seconds=360)
    for rank, result in enumerate(results):
        worker = tuple(range(rank // 2 * 2, rank // 2 * 2 + 2))
        assert result["ddp_group"] == list(worker), "DDP must average over the worker's processes only"
        allowed = {worker, tuple(result["outer_peers"])}
        stepping = [(phase, op, ranks) for phase, op, ranks in result["calls"] if phase.isdigit()]
        assert stepping and all(ranks in allowed for _, _, ranks in stepping), stepping
        for name, value in results[0]["ddp_params"].items():
            torch.testing.assert_close(result["diloco_global"][name], value, atol=1e-5, rtol=0)
    for step, loss in results[0]["ddp_losses"].items():
        mean = sum(results[rank]["diloco_losses"][step] for rank in (0, 2)) / 2  # one log per worker
        assert mean == pytest.approx(loss, abs=1e-5), step


# ------------------------------------------------------------------------------------------------ invariants 1, 4, 5


class _CollectiveRecorder:
    """Wraps the torch.distributed collectives to record (phase, op, ranks of the group) for every call."""

    OPS = (
        "all_reduce", "all_gather", "all_gather_into_tensor", "all_gather_object", "broadcast",
        "broadcast_object_list", "reduce", "reduce_scatter", "reduce_scatter_tensor", "all_to_all",
        "all_to_all_single", "barrier", "monitored_barrier", "gather", "gather_object", "scatter",
        "scatter_object_list", "send", "recv", "isend", "irecv",
    )  # fmt: skip

    def __init__(self):
        self.phase: str = "setup"
        self.calls: list[tuple[str, str, tuple[int, ...]]] = []
        self.default_group: list[tuple[str, str]] = []  # (phase, op) of the calls on the default group
        for name in self.OPS:
            original = getattr(dist.distributed_c10d, name)
            wrapped = self._wrap(name, original)
            setattr(dist.distributed_c10d, name, wrapped)
            setattr(dist, name, wrapped)

    def _wrap(self, name, original):
        signature = inspect.signature(original)

        @functools.wraps(original)
        def record(*args, **kwargs):
            group = signature.bind_partial(*args, **kwargs).arguments.get("group")
            ranks = (
                tuple(dist.get_process_group_ranks(group))
                if group is not None
                else tuple(range(dist.get_world_size()))
            )
            self.calls.append((self.phase, name, ranks))
            if group is None or group is dist.group.WORLD:
                self.default_group.append((self.phase, name))
            return original(*args, **kwargs)

        return record


class _PhaseCallback(TrainerCallback):
    def __init__(self, recorder: _CollectiveRecorder):
        self.recorder = recorder

    def on_step_begin(self, args, state, control, **kwargs):
        self.recorder.phase = str(state.global_step + 1)


class _RecordedDiLoCoTrainer(DiLoCoTrainer):
    """Labels the deliberate global points (saving, end of training) for the recorder."""

    recorder: _CollectiveRecorder | None = None

    def _save_checkpoint(self, model, trial):
        step_phase, self.recorder.phase = self.recorder.phase, "save"
        super()._save_checkpoint(model, trial)
        self.recorder.phase = step_phase

    def _finalize_training(self, trial, num_train_samples, start_time):
        self.recorder.phase = "end"
        return super()._finalize_training(trial, num_train_samples, start_time)


def _run(output_dir: Path, recorder: _CollectiveRecorder, resume: Path | None = None, **diloco) -> DiLoCoTrainer:
    recorder.phase = "setup"
    args = DiLoCoTrainingArguments(
        **_common_args(output_dir, save_strategy="steps", save_steps=MID_ROUND_CHECKPOINT), inner_steps=H, **diloco
    )
    _RecordedDiLoCoTrainer.recorder = recorder
    trainer = _RecordedDiLoCoTrainer(
        model=_tiny_model(), args=args, train_dataset=_dataset(), callbacks=[_PhaseCallback(recorder)]
    )
    trainer.train(resume_from_checkpoint=str(resume) if resume else None)
    return trainer


def _record(trainer: DiLoCoTrainer) -> dict:
    return {
        "global": _global_parameters(trainer),
        "model": {n: p.detach().clone() for n, p in trainer.model.named_parameters()},
        "outer_optimizer": trainer.diloco.state_dict()["outer_optimizer"],
        "losses": _losses(trainer),
        "logs": list(trainer.state.log_history),
        "fragments": trainer.diloco.fragment_names(),
        "is_ddp": isinstance(trainer.model_wrapped, torch.nn.parallel.DistributedDataParallel),
    }


def _diloco_runs(rank: int, world: int, out_dir: str) -> dict:
    out = Path(out_dir)
    recorder = _CollectiveRecorder()
    blocking = _run(out / "blocking", recorder)
    calls = list(recorder.calls)
    recorder.phase = "final_save"
    blocking.save_model(str(out / "final"))
    recorder.phase = "evaluate"  # the evaluation data sharded over both workers: its gathers cross them
    evaluation = blocking.evaluate(eval_dataset=_dataset())
    evaluated = [(op, ranks) for phase, op, ranks in recorder.calls if phase == "evaluate"]
    results = {"calls": calls, "blocking": _record(blocking), "evaluated": evaluated, "eval": evaluation}
    results["default_group"] = list(recorder.default_group)
    resumed = _run(out / "blocking_resumed", recorder, resume=out / "blocking" / f"checkpoint-{MID_ROUND_CHECKPOINT}")
    results["blocking_resumed"] = _record(resumed)
    # Two fragments with one step of delay: at step 6 fragment 0 has just been launched and is still in flight.
    streaming = dict(num_fragments=2, sync_delay=1)
    results["streaming"] = _record(_run(out / "streaming", recorder, **streaming))
    checkpoint = out / "streaming" / f"checkpoint-{MID_ROUND_CHECKPOINT}"
    results["streaming_resumed"] = _record(_run(out / "streaming_resumed", recorder, resume=checkpoint, **streaming))
    return results


@pytest.fixture(scope="module")
def diloco_runs(tmp_path_factory):
    out = tmp_path_factory.mktemp("diloco_runs")
    return out, run_on_processes(_diloco_runs, 2, str(out), timeout_seconds=400)


@pytest.mark.timeout(600)
def test_workers_end_with_identical_global_state(diloco_runs):
    """Invariant 1: bitwise-identical theta_g and outer optimizer state on every rank; the model is theta_g."""
    _, (first, second) = diloco_runs
    for run in ("blocking", "streaming", "streaming_resumed"):
        a, b = first[run], second[run]
        assert a["global"].keys() == b["global"].keys()
        for name in a["global"]:
            assert torch.equal(a["global"][name], b["global"][name]), (run, name)
            assert torch.equal(a["model"][name], a["global"][name].to(a["model"][name].dtype)), (run, name)
        assert _nested_equal(a["outer_optimizer"], b["outer_optimizer"]), run
    assert first["blocking"]["losses"] != second["blocking"]["losses"], "the workers must read different shards"


@pytest.mark.timeout(600)
def test_no_collective_crosses_workers_between_syncs(diloco_runs):
    """Invariant 4: with logging at every step, cross-worker collectives only at sync steps and global points."""
    _, results = diloco_runs
    for result in results:
        assert not result["blocking"]["is_ddp"]
        crossing = [(phase, op) for phase, op, ranks in result["calls"] if len(ranks) > 1]
        outside = [(p, op) for p, op in crossing if p not in ("setup", "save", "end") and int(p) % H != 0]
        assert outside == [], f"collectives across workers between syncs: {outside}"
        sync_steps = sorted({int(p) for p, _ in crossing if p.isdigit()})
        assert sync_steps == list(range(H, STEPS + 1, H)), "the recorder must see the outer syncs themselves"
        logged = [entry for entry in result["blocking"]["logs"] if "loss" in entry]
        assert len(logged) == STEPS and logged[-1]["diloco/outer_steps"] == STEPS // H
        # At start: the output folder's lock, shared from rank 0 as text, and the ranks' settings, the engine's (it
        # covers the trainer's): each is text of every rank (`core/agreement.all_gather_text`: lengths, then bytes).
        gathers = [op for phase, op, ranks in result["calls"] if phase == "setup" and op.startswith("all_gather")]
        assert gathers == ["all_gather"] * 4, gathers


@pytest.mark.timeout(600)
def test_no_front_end_collective_runs_on_the_default_group(diloco_runs):
    """Across workers only the engine's and the front-end's own gloo groups (bounded by sync_timeout_seconds) carry
    collectives, never the default group, which on GPUs is an NCCL communicator across sites. The evaluation's
    gathers cross the workers (its data is sharded over both) and so run on the global points' gloo group."""
    _, results = diloco_runs
    for result in results:
        assert result["default_group"] == [], result["default_group"]
        assert any(op.startswith("all_gather") and len(ranks) == 2 for op, ranks in result["evaluated"])
    assert results[0]["eval"]["eval_loss"] == results[1]["eval"]["eval_loss"]


@pytest.mark.timeout(600)
@pytest.mark.parametrize("run", ["blocking", "streaming"])
def test_resume_from_mid_round_checkpoint_is_bitwise(diloco_runs, run):
    """Invariant 5: resuming at step 6 (H=4: mid-round; streaming: fragment 0 in flight) continues bitwise."""
    _, results = diloco_runs
    for result in results:
        assert_resumed_bitwise(result[run], result[f"{run}_resumed"], MID_ROUND_CHECKPOINT, STEPS)


@pytest.mark.timeout(600)
def test_saved_model_is_the_global_model(diloco_runs):
    """The final `save_model` folder and the mid-round checkpoint hold theta_g, not a worker's local parameters."""
    out, results = diloco_runs
    final = AutoModelForCausalLM.from_pretrained(out / "final")
    for name, param in final.named_parameters():
        assert torch.equal(param.detach(), results[0]["blocking"]["global"][name]), name
    checkpoint = out / "blocking" / f"checkpoint-{MID_ROUND_CHECKPOINT}"
    saved = dict(AutoModelForCausalLM.from_pretrained(checkpoint).named_parameters())
    for rank in range(2):
        state = torch.load(checkpoint / f"diloco_state_rank{rank}.pt", weights_only=True)["engine"]
        names = results[rank]["blocking"]["fragments"][0]
        flat = torch.cat([saved[name].detach().reshape(-1) for name in names])
        assert torch.equal(flat, state["global"][0])
        assert not torch.equal(flat, state["local"][0]), "mid-round, a worker's parameters differ from theta_g"


def _nested_equal(a, b) -> bool:
    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict):
        return a.keys() == b.keys() and all(_nested_equal(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_nested_equal(x, y) for x, y in zip(a, b))
    return a == b


@pytest.mark.timeout(300)
def test_evaluation_during_training_uses_global_parameters(tmp_path):
    """Evaluated at step 6 (mid-round, H=4, one process = one worker), the model is theta_g of step 4: the same loss as
    a run that stops at step 4. After training, close() has synced the tail (steps 5-6) into theta_g, which is what
    `trainer.model` then holds."""
    data = _dataset()

    def run(max_steps: int, **extra) -> DiLoCoTrainer:
        args = DiLoCoTrainingArguments(
            **_common_args(tmp_path / str(max_steps), max_steps=max_steps, lr_scheduler_type="constant", **extra),
            inner_steps=H,
            per_device_eval_batch_size=8,
        )
        trainer = DiLoCoTrainer(
            model=_tiny_model(), args=args, train_dataset=data, eval_dataset=data.select(range(16))
        )
        trainer.train()
        return trainer

    trainer = run(MID_ROUND_CHECKPOINT, eval_strategy="steps", eval_steps=6)
    during = [entry["eval_loss"] for entry in trainer.state.log_history if "eval_loss" in entry]
    for name, param in trainer.model.named_parameters():
        assert torch.equal(param.detach(), trainer.diloco.global_parameters()[name]), name
    assert trainer.diloco.stats["final_syncs"] == 1
    assert during != [trainer.evaluate()["eval_loss"]]  # the final theta_g holds steps 5-6 as well
    assert during == [run(H).evaluate()["eval_loss"]]


def test_short_run_warns_about_outer_momentum_memory(tmp_path, caplog):
    """3 rounds with Nesterov 0.9 (memory ~10 rounds): the trainer says so before training; 0.5 over 4 rounds is fine."""
    import logging

    def train(momentum: float, max_steps: int) -> list[str]:
        caplog.clear()
        args = DiLoCoTrainingArguments(
            **_common_args(tmp_path / f"{momentum}", max_steps=max_steps), inner_steps=2, outer_momentum=momentum
        )
        with caplog.at_level(logging.WARNING, logger="hf_diloco.integrations.trainer"):
            DiLoCoTrainer(model=_tiny_model(), args=args, train_dataset=_dataset()).train()
        return [r.getMessage() for r in caplog.records if "outer_momentum" in r.getMessage()]

    warned = train(0.9, 6)
    assert len(warned) == 1 and "only 3" in warned[0]
    assert train(0.5, 8) == []
