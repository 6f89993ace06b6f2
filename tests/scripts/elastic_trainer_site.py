"""One elastic site for tests/test_elastic_sites.py: a DiLoCoTrainer of one process whose membership comes from its
`DiLoCoTrainingArguments` alone (`lighthouse`, `site`, ...); it writes θg and the membership summary to OUT/SITE.pt.

    python tests/scripts/elastic_trainer_site.py LIGHTHOUSE SITE SLOT OUT [DIE_AT_STEP]

With DIE_AT_STEP the process dies (no clean-up, as a lost machine) at the end of that Trainer step. The environment's
ROUND_POLICY (default `steps`) is the run's `round_policy` and SYNC_DELAY its τ; with SAVE_STEPS the site checkpoints every that many
steps, and with RESUME=1 it resumes from its last checkpoint. Launched by `torchrun --nproc_per_node D` with
DATA_PARALLEL=D, the site is D data-parallel ranks (its rank 0 writes OUT/SITE.pt); with FSDP=1 they shard the model
with FSDP2 (the Trainer's `fsdp` argument). With PIPELINE_STAGES=S (and DATA_PARALLEL=1) the site's ranks are S
pipeline stages.
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import torch
from datasets import Dataset
from transformers import TrainerCallback, default_data_collator

from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
from tests.engine_common import cpu_trainer_args, tiny_llama


class DieAtStep(TrainerCallback):
    def __init__(self, step: int):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if state.global_step == self.step:
            os._exit(3)


def site_membership(lighthouse: str, site: str) -> dict:
    """The membership of a test site: its Lighthouse and name, on loopback; the job starts with two sites, and a
    site left alone trains on."""
    return dict(
        lighthouse=lighthouse,
        site=site,
        site_host="127.0.0.1",
        min_workers=1,
        start_workers=2,
        min_workers_timeout=60,
        membership_sync_timeout=20,
    )


def main() -> None:
    lighthouse, site, slot, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    callbacks = [DieAtStep(int(sys.argv[5]))] if len(sys.argv) > 5 else []
    args = DiLoCoTrainingArguments(
        **cpu_trainer_args(
            out / site,
            max_steps=4,
            per_device_train_batch_size=2,
            dataloader_pin_memory=False,
            inner_steps=2,
            data_parallel_per_worker=int(os.environ.get("DATA_PARALLEL", "1")),
            pipeline_stages=int(os.environ.get("PIPELINE_STAGES", "1")),
            **site_membership(lighthouse, site),
            round_policy=os.environ.get("ROUND_POLICY", "steps"),
            sync_delay=int(os.environ.get("SYNC_DELAY", "0")),
            fsdp=os.environ.get("FSDP") == "1",
            **(
                {"save_strategy": "steps", "save_steps": int(os.environ["SAVE_STEPS"])}
                if "SAVE_STEPS" in os.environ
                else {}
            ),
        )
    )
    # Each site its own data (a different seed) and its own initial weights: the first group makes them start alike.
    ids = torch.randint(0, 128, (16, 16), generator=torch.Generator().manual_seed(slot))
    data = Dataset.from_dict({"input_ids": ids.tolist(), "labels": ids.tolist()})
    layers = int(os.environ.get("PIPELINE_STAGES", "1"))  # a block per stage
    model = tiny_llama(128, layers=layers, max_positions=32, heads=2, kv_heads=2, seed=slot)
    trainer = DiLoCoTrainer(
        model=model, args=args, train_dataset=data, data_collator=default_data_collator, callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=os.environ.get("RESUME") == "1" or None)
    trainer.save_model()  # the global model and its card, in out/SITE
    engine = trainer.diloco
    result = {"global": engine.global_parameters(), "summary": engine.elastic.log.summary()}  # every rank gathers
    if trainer.args.process_index == 0:
        torch.save(result, out / f"{site}.pt")


if __name__ == "__main__":
    main()
