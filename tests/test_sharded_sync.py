"""Two data-parallel ranks per worker x two workers: the sharded outer sync equals the unsharded result."""

from __future__ import annotations

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from hf_diloco import DiLoCo, DiLoCoConfig
from tests.dist_utils import run_on_processes
from tests.engine_common import BATCH, INNER_LR, SEQ, VOCAB, reference_run, tiny_model


def _worker_batch(worker: int, step: int) -> torch.Tensor:
    from tests.engine_common import batch_for

    return batch_for(worker, step)["input_ids"]


def _train_sharded(rank: int, world: int, config_kwargs: dict, steps: int) -> dict:
    config = DiLoCoConfig(data_parallel_per_worker=2, **config_kwargs)
    model = tiny_model()
    engine_model = model
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(engine_model, optimizer, config)
    ddp = DistributedDataParallel(model, process_group=engine.topology.data_parallel_group)
    worker, dp = engine.topology.worker_index, engine.topology.dp_index
    for t in range(1, steps + 1):
        # each dp rank takes half of its worker's batch; DDP averages, so the worker sees the whole batch's gradient
        ids = _worker_batch(worker, t)[dp * BATCH // 2 : (dp + 1) * BATCH // 2]
        ddp(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.step()
    engine.close()
    return {
        "global": {n: v.clone() for n, v in engine.global_parameters().items()},
        "local": {n: p.detach().clone() for n, p in model.named_parameters()},
        "stats": dict(engine.stats),
        "worker": worker,
    }


@pytest.mark.timeout(300)
@pytest.mark.parametrize(
    "options", [{}, {"entropy_coding": True}, {"exchange_pattern": "all_gather"}], ids=["plain", "deflate", "gather"]
)
def test_sharded_outer_sync_equals_unsharded_reference(options):
    assert BATCH % 2 == 0 and SEQ > 0 and VOCAB > 0
    steps, inner = 9, 4
    entropy_coding = options.get("entropy_coding", False)
    results = run_on_processes(_train_sharded, 4, dict(inner_steps=inner, **options), steps)
    locals_, glob = reference_run(2, steps, inner)
    for result in results:
        for name, value in glob.items():
            torch.testing.assert_close(result["global"][name], value, atol=1e-5, rtol=0)
            torch.testing.assert_close(result["local"][name], locals_[result["worker"]][name], atol=1e-5, rtol=0)
        assert torch.equal(
            torch.cat([v.flatten() for v in result["global"].values()]),
            torch.cat([v.flatten() for v in results[0]["global"].values()]),
        )
    # each dp rank sends only its half of the pseudo-gradient across workers, then gathers the rest inside
    model_bytes = sum(v.numel() for v in glob.values()) * 4
    syncs = steps // inner + 1  # the rounds, plus close()'s sync of the one step after the last round
    for result in results:
        assert result["stats"]["final_syncs"] == 1
        lengths = syncs * 2 * 8 if entropy_coding else 0  # the payload lengths exchanged before each all_to_all
        assert result["stats"]["bytes_sent"] <= syncs * model_bytes // 2 + syncs * 4 * 4 + lengths
        assert result["stats"]["bytes_sent_intra_worker"] >= syncs * model_bytes // 2
