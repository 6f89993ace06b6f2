"""GPU lane: a pipelined `DiLoCoTrainer` start never holds the whole model on the GPU (`pytest -m gpu`).

Two processes share the one GPU (gloo default group, both on `cuda:0`), each builds the same Llama of about 27 MB on
the CPU and constructs a `DiLoCoTrainer` with `pipeline_stages=2`. The CUDA caching allocator counts per process, so
`torch.cuda.max_memory_allocated()` after construction is what that rank's start placed on the GPU: at most its
stage plus the largest unit, well under the whole model (before the stages were placed alone, it was the whole).
Only the start runs: the schedules' point-to-point sends of CUDA tensors need NCCL, which refuses two ranks on one
GPU. On CPU the same placements are recorded, and bounded, by `test_pipeline_trainer` and `test_trainer_fsdp`
(`tests.placement_recorder`).
"""

from __future__ import annotations

import os

import pytest
import torch

from tests.dist_utils import run_on_processes
from tests.engine_common import tiny_llama
from tests.placement_recorder import module_bytes

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device: the GPU lane (pytest -m gpu)"),
]

VOCAB, LAYERS, HIDDEN, SEQ = 4096, 8, 256, 32


def _model() -> torch.nn.Module:
    return tiny_llama(VOCAB, LAYERS, SEQ, heads=8, kv_heads=4, hidden_size=HIDDEN, intermediate_size=2 * HIDDEN)


def _pipelined_start(rank: int, world: int, out: str) -> dict:
    from datasets import Dataset

    from hf_diloco.integrations.trainer import DiLoCoTrainer, DiLoCoTrainingArguments

    os.environ["LOCAL_RANK"] = "0"  # one GPU: both stages on cuda:0, each process with its own allocator counts
    torch.cuda.set_device(0)
    torch.cuda.reset_peak_memory_stats()
    ids = torch.randint(0, VOCAB, (8, SEQ), generator=torch.Generator().manual_seed(0)).tolist()
    args = DiLoCoTrainingArguments(
        output_dir=f"{out}/rank{rank}",
        report_to=[],
        max_steps=1,
        per_device_train_batch_size=2,
        pipeline_stages=2,
        pipeline_microbatches=2,
        inner_steps=2,
    )
    trainer = DiLoCoTrainer(model=_model(), args=args, train_dataset=Dataset.from_dict({"input_ids": ids}))
    stage = trainer.pipeline_runner.stage_module
    return {
        "peak": torch.cuda.max_memory_allocated(),
        "stage_bytes": module_bytes(stage),
        "on_gpu": all(p.device.type == "cuda" for p in stage.parameters()),
    }


@pytest.mark.timeout(300)
def test_pipelined_start_places_one_stage_on_the_gpu(tmp_path):
    model = _model()
    whole = module_bytes(model)
    largest_unit = max(module_bytes(block) for block in model.model.layers)
    largest_unit = max(largest_unit, model.model.embed_tokens.weight.numel() * 4)
    for rank in run_on_processes(_pipelined_start, 2, str(tmp_path), timeout_seconds=240):
        assert rank["on_gpu"]
        assert rank["stage_bytes"] <= rank["peak"] <= rank["stage_bytes"] + largest_unit < whole, (rank, whole)
