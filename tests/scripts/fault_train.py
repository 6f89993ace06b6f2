"""A small DiLoCoTrainer job for the fault tests: optionally SIGKILLs one rank once, mid-round, at a given step.

    PYTHONPATH=. torchrun --nproc_per_node 2 --max-restarts 1 tests/scripts/fault_train.py --output_dir OUT \
        [--kill_at_step 10] [--max_steps 16]

It resumes by itself from the newest complete checkpoint in OUT (as scripts/pretrain.py does), and appends every
inner step it runs to OUT/steps_rank{r}.log so the test can count redone work. Run from the repository root with
it on PYTHONPATH (for `tests.engine_common`), as tests/test_faults.py does.
"""

from __future__ import annotations

import argparse
import os
import signal
from pathlib import Path

import torch


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--output_dir", required=True)
    parser.add_argument("--kill_at_step", type=int, default=0)
    parser.add_argument("--kill_rank", type=int, default=1)
    parser.add_argument("--max_steps", type=int, default=16)
    cli = parser.parse_args()

    from datasets import Dataset
    from transformers import TrainerCallback, default_data_collator

    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
    from hf_diloco.integrations.atomic_checkpoints import last_complete_checkpoint
    from tests.engine_common import tiny_llama

    args = DiLoCoTrainingArguments(
        output_dir=cli.output_dir,
        max_steps=cli.max_steps,
        per_device_train_batch_size=2,
        learning_rate=3e-3,
        save_steps=4,
        logging_steps=1,
        report_to="none",
        use_cpu=True,
        seed=0,
        dataloader_pin_memory=False,
        disable_tqdm=True,
        inner_steps=4,
        num_fragments=2,
        sync_delay=1,
    )
    rank = args.process_index
    generator = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 128, (96, 16), generator=generator)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    model = tiny_llama(128, layers=2, max_positions=32, heads=2, kv_heads=2)
    marker = Path(cli.output_dir) / "killed_once"
    step_log = Path(cli.output_dir) / f"steps_rank{rank}.log"

    class FaultCallback(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            with open(step_log, "a") as handle:
                handle.write(f"{state.global_step}\n")
            if rank == cli.kill_rank and state.global_step == cli.kill_at_step and not marker.exists():
                marker.write_text("x")
                os.kill(os.getpid(), signal.SIGKILL)

    trainer = DiLoCoTrainer(
        model=model, args=args, train_dataset=data, data_collator=default_data_collator, callbacks=[FaultCallback()]
    )
    trainer.train(resume_from_checkpoint=last_complete_checkpoint(cli.output_dir))
    trainer.save_model(os.path.join(cli.output_dir, "final"))
    torch.distributed.destroy_process_group()


if __name__ == "__main__":
    main()
