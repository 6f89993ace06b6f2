"""DiLoCoTrainer runs for tests/test_trainer_guards.py: what a run does with refused checkpoints, a finished run, a
stalled peer, a full disk and settings that differ between ranks. Launched by the test on real processes (RANK,
WORLD_SIZE, MASTER_ADDR, ... in the environment); each rank writes what it saw to BASE/<mode>_rank{r}.json.

    python tests/scripts/guarded_train.py --base_dir BASE --mode {sequence,stall_in_files,stall_in_model,disk_full}
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import resource
import signal
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from datasets import Dataset
from safetensors.torch import load_file
from transformers import TrainerCallback, default_data_collator

from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
from hf_diloco.integrations.atomic_checkpoints import CheckpointError, CheckpointSaveError, checkpoint_to_resume
from hf_diloco.integrations.global_points import PeerTimeoutError, SettingsMismatchError
from tests.engine_common import cpu_trainer_args, tiny_llama

SECRET_TOKEN = "hf_reliabilityTestSecret0123456789"
MAX_STEPS, SAVE_STEPS = 8, 4
# What a resume changes against the checkpoint (each refused before any step).
RESUME_CHANGES = {
    "compression": {"compression": "int8"},
    "inner_steps": {"inner_steps": 2},
    "batch": {"per_device_train_batch_size": 4},
    "data_seed": {"data_seed": 7},
    "tokenizer": {"tokenizer": "sha256:another"},
}


class StepCounter(TrainerCallback):
    def __init__(self):
        self.steps: list[int] = []

    def on_step_end(self, args, state, control, **kwargs):
        self.steps.append(state.global_step)


class LimitFileSizeAfterFirstSave(TrainerCallback):
    """After the checkpoint of step 4 is complete, files larger than 2 kB can no longer be written (a full disk)."""

    def on_save(self, args, state, control, **kwargs):
        if state.global_step == SAVE_STEPS:
            resource.setrlimit(resource.RLIMIT_FSIZE, (2000, resource.getrlimit(resource.RLIMIT_FSIZE)[1]))


class StallingTrainer(DiLoCoTrainer):
    """Rank 1 stops (SIGSTOP) in the middle of saving checkpoint-4: after writing its files (`stall_in="files"`), or
    before the model is saved (`"model"`, where rank 0 then meets the Trainer's own best-model barrier)."""

    stall_in = "files"

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        if self.stall_in == "model" and _internal_call:
            self._stall_on_rank_1(Path(output_dir).parent)
        super().save_model(output_dir, _internal_call)

    def _save_optimizer_and_scheduler(self, output_dir: str) -> None:
        super()._save_optimizer_and_scheduler(output_dir)
        if self.stall_in == "files":
            self._stall_on_rank_1(Path(output_dir).parent)

    def _stall_on_rank_1(self, run_dir: Path) -> None:
        if self.args.process_index == 1 and self.state.global_step == SAVE_STEPS:
            (run_dir / "stalled_at").write_text(repr(time.time()))
            os.kill(os.getpid(), signal.SIGSTOP)


def make_trainer(
    output_dir: Path,
    trainer_class=DiLoCoTrainer,
    model: dict | None = None,
    callbacks=(),
    tokenizer: str = "sha256:first",
    **overrides,
):
    values = cpu_trainer_args(
        output_dir,
        max_steps=MAX_STEPS,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        save_strategy="steps",
        save_steps=SAVE_STEPS,
        dataloader_pin_memory=False,
        inner_steps=4,
        sync_timeout_seconds=60,
    )
    values.update(overrides)
    args = DiLoCoTrainingArguments(**values)
    ids = torch.randint(0, 128, (96, 16), generator=torch.Generator().manual_seed(0))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    counter = StepCounter()
    trainer = trainer_class(
        model=tiny_llama(128, layers=2, max_positions=32, heads=2, kv_heads=2, **(model or {})),
        args=args,
        train_dataset=data,
        eval_dataset=data.select(range(8)) if args.eval_strategy != "no" else None,
        data_collator=default_data_collator,
        callbacks=[counter, *callbacks],
    )
    trainer.require_agreement("tokenizer", tokenizer)  # as the main job adds its tokenizer's fingerprint
    return trainer, counter


def snapshot(folder: Path) -> dict[str, str]:
    """sha256 of every file under `folder`, by relative path."""
    return {
        str(path.relative_to(folder)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(folder.rglob("*"))
        if path.is_file()
    }


def changes(folder: Path, before: dict[str, str]) -> list[str]:
    """The files under `folder` added, removed or rewritten since `before` (a `snapshot`)."""
    after = snapshot(folder)
    return sorted(name for name in before.keys() | after.keys() if before.get(name) != after.get(name))


def attempt(run) -> dict[str, Any]:
    """Run `run()`; what it raised (type and message) and how long it took."""
    start = time.time()
    try:
        value = run()
    except (CheckpointError, SettingsMismatchError, CheckpointSaveError, PeerTimeoutError) as error:
        return {"error": type(error).__name__, "message": str(error), "seconds": time.time() - start}
    return {"error": None, "value": value, "seconds": time.time() - start}


def sequence(base: Path, rank: int) -> dict[str, Any]:
    run = base / "run"
    results: dict[str, Any] = {}

    trainer, counter = make_trainer(run, hub_token=SECRET_TOKEN)
    trainer.train()
    results["first"] = {"steps": counter.steps}
    # The job "crashes" after its final checkpoint, before saving the model: the rerun trains nothing.
    dist.barrier()
    before = snapshot(run)
    trainer, counter = make_trainer(run, hub_token=SECRET_TOKEN)
    output = trainer.train(resume_from_checkpoint=True)
    saved = load_file(run / f"checkpoint-{MAX_STEPS}" / "model.safetensors")
    results["after_final_checkpoint"] = {
        "steps": counter.steps,
        "global_step": output.global_step,
        "finished": trainer.resumed_a_finished_run,
        "changed": changes(run, before),
        "model_is_checkpoint": all(
            torch.equal(p, saved[n]) for n, p in trainer.model.state_dict().items() if n in saved
        ),
    }
    dist.barrier()  # every rank has looked at the folder before rank 0 writes the model into it
    trainer.save_model()  # what the main job does next when the final model is missing
    dist.barrier()

    # Rerunning the finished job: nothing trained, nothing written.
    before = snapshot(run)
    trainer, counter = make_trainer(run)
    output = trainer.train(resume_from_checkpoint=True)
    results["rerun"] = {
        "steps": counter.steps,
        "global_step": output.global_step,
        "changed": changes(run, before),
    }

    trainer, counter = make_trainer(run, model={"hidden_size": 64})
    results["other_model"] = attempt(lambda: trainer.train(resume_from_checkpoint=True))
    results["other_model"]["changed"] = changes(run, before)

    # Another batch, data seed, DiLoCo field or tokenizer than the checkpoint's: refused, naming it, before any step.
    for case, overrides in RESUME_CHANGES.items():
        trainer, counter = make_trainer(run, **overrides)
        results[f"changed_{case}"] = attempt(lambda trainer=trainer: trainer.train(resume_from_checkpoint=True))
        results[f"changed_{case}"].update(steps=counter.steps, changed=changes(run, before))

    # Only scheduler.pt of each checkpoint is truncated; the weights are intact.
    dist.barrier()
    if rank == 0:
        for step in (SAVE_STEPS, MAX_STEPS):
            path = run / f"checkpoint-{step}" / "scheduler.pt"
            path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])
    dist.barrier()
    before = snapshot(run)
    trainer, counter = make_trainer(run)
    results["refused"] = attempt(lambda: trainer.train(resume_from_checkpoint=True))
    results["refused"].update(steps=counter.steps, changed=changes(run, before), before=before)
    results["refused_auto_resume"] = attempt(lambda: checkpoint_to_resume(run))  # what the main job calls
    dist.barrier()  # every rank has looked at the folder before the next run moves checkpoints aside

    # Starting over knowingly, with rotation down to one checkpoint: the refused ones are moved aside, not deleted.
    trainer, counter = make_trainer(run, save_total_limit=1)
    trainer.train()
    dist.barrier()
    results["start_over"] = {"steps": counter.steps, "after": snapshot(run)}

    # Settings that differ between ranks: found at start, on every rank, before any step.
    mismatch = {"max_steps": 12} if rank == 1 else {}
    trainer, counter = make_trainer(base / "mismatch", model={"hidden_act": "gelu"} if rank == 1 else None, **mismatch)
    results["mismatch"] = attempt(trainer.train)
    results["mismatch"]["steps"] = counter.steps
    return results


def stall_at_save(base: Path, rank: int, stall_in: str) -> dict[str, Any]:
    StallingTrainer.stall_in = stall_in
    # With a tracked best metric the Trainer's own save waits for every rank (after evaluating at step 4).
    best = (
        dict(eval_strategy="steps", eval_steps=SAVE_STEPS, metric_for_best_model="loss") if stall_in == "model" else {}
    )
    trainer, _ = make_trainer(base / "stall", trainer_class=StallingTrainer, sync_timeout_seconds=8, **best)
    return {"train": attempt(trainer.train), "failed_at": time.time()}


def disk_full(base: Path, rank: int) -> dict[str, Any]:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a write past the limit fails with EFBIG instead of killing
    folder = base / "disk"
    trainer, _ = make_trainer(folder, callbacks=[LimitFileSizeAfterFirstSave()])
    results = {"full": attempt(trainer.train)}
    hard = resource.getrlimit(resource.RLIMIT_FSIZE)[1]
    resource.setrlimit(resource.RLIMIT_FSIZE, (hard, hard))  # space was freed
    dist.barrier()
    checkpoint = checkpoint_to_resume(folder)
    trainer, counter = make_trainer(folder)
    trainer.train(resume_from_checkpoint=checkpoint)
    results["resumed"] = {"from": checkpoint, "steps": counter.steps}
    return results


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--base_dir", required=True)
    parser.add_argument("--mode", choices=["sequence", "stall_in_files", "stall_in_model", "disk_full"], required=True)
    cli = parser.parse_args()
    base, rank = Path(cli.base_dir), int(os.environ["RANK"])
    if cli.mode.startswith("stall_in_"):
        results = stall_at_save(base, rank, cli.mode.removeprefix("stall_in_"))
    else:
        results = {"sequence": sequence, "disk_full": disk_full}[cli.mode](base, rank)
    (base / f"{cli.mode}_rank{rank}.json").write_text(json.dumps(results, indent=1, default=str))
    if dist.is_initialized():
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
