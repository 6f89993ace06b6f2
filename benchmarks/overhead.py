"""Single-worker overhead of DiLoCoTrainer over the plain Trainer: time per inner step, measured side by side.

    python -m benchmarks.overhead --steps 200 --repeats 3

Both trainers get the same model, data, seed and steps; runs alternate (Trainer, DiLoCoTrainer, Trainer, ...) in one
process so machine noise hits both alike. Reported: the median seconds per step of each and their ratio, in wall time
and in this process's CPU time (torch runs on one thread here, so CPU time is the work each trainer does and is far
less sensitive to other jobs on a shared machine than wall time).
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, command_line

WARMUP_STEPS = 10  # not timed: the first steps build caches and allocate


def build_data(num_blocks: int, block_size: int):
    from hf_diloco.job.data import build_tokenizer, load_text_dataset, tokenize_and_group

    raw = load_text_dataset({"max_train_samples": 60, "max_eval_samples": 2})
    tokenizer = build_tokenizer({"vocab_size": 4096}, raw["train"]["text"])
    blocks = tokenize_and_group(raw["train"], tokenizer, block_size)
    return tokenizer, blocks.select(range(min(num_blocks, len(blocks))))


class StepTimer:
    """A TrainerCallback measuring wall time from the end of step `warmup` to the end of training."""

    def __init__(self, warmup: int):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                now = (time.perf_counter(), time.process_time())
                if state.global_step == timer.warmup:
                    timer.started = now
                timer.last = now
                timer.steps = state.global_step

        self.warmup, self.started, self.last, self.steps = warmup, None, None, 0
        self.callback = _Callback()

    def seconds_per_step(self) -> tuple[float, float]:
        """(wall, CPU) seconds per step after the warm-up."""
        steps = self.steps - self.warmup
        return (self.last[0] - self.started[0]) / steps, (self.last[1] - self.started[1]) / steps


def run_once(use_diloco: bool, tokenizer, blocks, steps: int, inner_steps: int, out_dir: str) -> tuple[float, float]:
    from transformers import Trainer, TrainingArguments, default_data_collator

    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
    from hf_diloco.job.modeling import build_model

    common = dict(
        output_dir=out_dir,
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=1e-3,
        logging_steps=50,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=True,
        dataloader_pin_memory=False,
        disable_tqdm=True,
    )
    args = DiLoCoTrainingArguments(inner_steps=inner_steps, **common) if use_diloco else TrainingArguments(**common)
    model = build_model(
        None, len(tokenizer), tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id, 0
    )
    timer = StepTimer(warmup=WARMUP_STEPS)
    trainer_class = DiLoCoTrainer if use_diloco else Trainer
    trainer = trainer_class(
        model=model, args=args, train_dataset=blocks, data_collator=default_data_collator, callbacks=[timer.callback]
    )
    trainer.train()
    return timer.seconds_per_step()


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--inner_steps", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--block_size", type=int, default=256)
    parser.add_argument("--out", default=f"{RESULTS_DIR}/overhead.json")
    args = parser.parse_args(argv)
    if args.steps <= WARMUP_STEPS:
        parser.error(f"--steps must be more than the {WARMUP_STEPS} warm-up steps that are not timed")
    import torch

    torch.set_num_threads(1)
    tokenizer, blocks = build_data(args.steps * 8, args.block_size)
    wall: dict[str, list[float]] = {"trainer": [], "diloco_trainer": []}
    cpu: dict[str, list[float]] = {"trainer": [], "diloco_trainer": []}
    with tempfile.TemporaryDirectory() as tmp:
        for repeat in range(args.repeats):
            order = ("trainer", "diloco_trainer") if repeat % 2 == 0 else ("diloco_trainer", "trainer")
            for name in order:
                seconds = run_once(name == "diloco_trainer", tokenizer, blocks, args.steps, args.inner_steps, tmp)
                wall[name].append(seconds[0])
                cpu[name].append(seconds[1])
                print(f"repeat {repeat} {name}: {seconds[0] * 1000:.1f} ms/step wall, {seconds[1] * 1000:.1f} CPU")
    median_wall = {name: statistics.median(values) for name, values in wall.items()}
    median_cpu = {name: statistics.median(values) for name, values in cpu.items()}
    result = {
        "command": command_line("overhead", argv),
        "steps": args.steps,
        "inner_steps": args.inner_steps,
        "wall_seconds_per_step": wall,
        "cpu_seconds_per_step": cpu,
        "ratio_wall": median_wall["diloco_trainer"] / median_wall["trainer"],
        "ratio_cpu": median_cpu["diloco_trainer"] / median_cpu["trainer"],
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=2))
    print(json.dumps(result, indent=2))
    return result


if __name__ == "__main__":
    main()
