"""One elastic `DiLoCoTrainer` site for tests/test_elastic_sites.py's heal test: a user's script whose Trainer
subclass records, at each step, which samples it trained on.

    python tests/scripts/elastic_trainer_heal.py LIGHTHOUSE SITE SLOT OUT MODE

MODE `die`: the process dies (no clean-up, as a lost machine) at the end of step 3 (on a site of several ranks, its
last rank alone: torchrun then stops the others, and the site leaves as a whole). MODE `wait`: at the end of step 6
it waits for OUT/rejoined (bounded, 120 s), which the test writes once the restarted site heartbeats to the
Lighthouse. MODE `rejoin`: a fresh start of the lost site. Each site trains 12 steps at H = 2 on its own 32 samples (sample k starts with
token k); it writes θg, the membership summary, the samples of each step and the Trainer's log to OUT/SITE-MODE.pt.
Launched by `torchrun --nproc_per_node D` with DATA_PARALLEL=D (and FSDP=1 to shard the model with FSDP2), or with
PIPELINE_STAGES=D, each rank writes OUT/SITE-MODE_rK.pt.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback, default_data_collator

from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
from tests.engine_common import cpu_trainer_args, tiny_llama
from tests.scripts.elastic_trainer_site import site_membership

SAMPLES, MAX_STEPS = 32, 12


class RecordingTrainer(DiLoCoTrainer):
    """A user's Trainer subclass: notes the first token of every sample it trains on, by step."""

    seen: dict[int, list[int]]

    def training_step(self, model, inputs, num_items_in_batch=None):
        self.seen.setdefault(self.state.global_step + 1, []).extend(inputs["input_ids"][:, 0].tolist())
        return super().training_step(model, inputs, num_items_in_batch)


class Script(TrainerCallback):
    def __init__(self, mode: str, out: Path):
        self.mode, self.out = mode, out

    def on_step_end(self, args, state, control, **kwargs):
        if self.mode == "die" and state.global_step == 3 and args.process_index == args.world_size - 1:
            os._exit(3)
        if self.mode == "wait" and state.global_step == 6:
            deadline = time.monotonic() + 120
            while not (self.out / "rejoined").exists() and time.monotonic() < deadline:
                time.sleep(0.1)


def main() -> None:
    lighthouse, site, slot, out, mode = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4]), sys.argv[5]
    args = DiLoCoTrainingArguments(
        **cpu_trainer_args(
            out / site,
            max_steps=MAX_STEPS,
            per_device_train_batch_size=2,
            dataloader_pin_memory=False,
            inner_steps=2,
            outer_lr=1.0,
            outer_momentum=0.0,
            data_parallel_per_worker=int(os.environ.get("DATA_PARALLEL", "1")),
            pipeline_stages=int(os.environ.get("PIPELINE_STAGES", "1")),
            fsdp=os.environ.get("FSDP") == "1",
            **site_membership(lighthouse, site),
        )
    )
    ids = torch.randint(0, 128, (SAMPLES, 16), generator=torch.Generator().manual_seed(slot))
    ids[:, 0] = torch.arange(SAMPLES)
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    layers = int(os.environ.get("PIPELINE_STAGES", "1"))  # a block per stage
    model = tiny_llama(128, layers=layers, max_positions=32, heads=2, kv_heads=2, seed=slot)
    trainer = RecordingTrainer(
        model=model, args=args, train_dataset=data, data_collator=default_data_collator, callbacks=[Script(mode, out)]
    )
    trainer.seen = {}
    trainer.train()
    engine = trainer.diloco
    result = {
        "global": engine.global_parameters(),
        "summary": engine.elastic.log.summary(),
        "seen": trainer.seen,
        "log": trainer.state.log_history,
        "global_step": trainer.state.global_step,
        # The batches of an uninterrupted epoch, in order: Trainer's own data loader, read again after training.
        "order": [batch["input_ids"][:, 0].tolist() for batch in trainer.get_train_dataloader()],
        "sharded": any(type(p).__name__ == "DTensor" for p in trainer.model.parameters()),
    }
    rank = f"_r{args.process_index}" if args.world_size > 1 else ""
    torch.save(result, out / f"{site}-{mode}{rank}.pt")


if __name__ == "__main__":
    main()
