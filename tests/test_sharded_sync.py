"""Two data-parallel ranks per worker x two workers: the sharded outer sync equals the unsharded result."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from torch.nn.parallel import DistributedDataParallel

from hf_diloco import DiLoCo, DiLoCoConfig
from hf_diloco.integrations.rank_state import load_rank_state, rank_state_path, save_rank_state
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
        tags = syncs * 24  # the schedule tag sent to the other worker before each sync
        assert result["stats"]["bytes_sent"] <= syncs * model_bytes // 2 + syncs * 4 * 4 + lengths + tags
        assert result["stats"]["bytes_sent_intra_worker"] >= syncs * model_bytes // 2


BF16_CONFIG = dict(data_parallel_per_worker=2, inner_steps=4, num_fragments=2, sync_delay=1, merge_alpha=0.5)


def _bf16_replica(seed: int = 0):
    model = tiny_model(seed=seed).to(torch.bfloat16)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(**BF16_CONFIG))
    return model, optimizer, engine, DistributedDataParallel(model, process_group=engine.topology.data_parallel_group)


def _train_replica(model, optimizer, engine, ddp, steps: range) -> None:
    worker, dp = engine.topology.worker_index, engine.topology.dp_index
    for t in steps:
        ids = _worker_batch(worker, t)[dp * BATCH // 2 : (dp + 1) * BATCH // 2]
        ddp(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.step()


def _resumed_replica(folder: Path, rank: int, world: int) -> dict[str, torch.Tensor]:
    """A fresh replica (other weights) resumed from `folder` at step 6 and trained to the end."""
    model, optimizer, engine, ddp = _bf16_replica(seed=7)
    load_rank_state(folder, rank, world, engine)
    _train_replica(model, optimizer, engine, ddp, range(7, 10))
    engine.close()
    return {n: p.detach().clone() for n, p in model.named_parameters()}


def _train_bf16_replicas(rank: int, world: int, window: int, folder: str) -> dict:
    """Streaming DiLoCo (P = 2, τ = 1) on bf16 parameters with DDP inside each worker; the updated parameters are
    shared in windows of `window` values, so some windows straddle two pieces and the last one of a rank is short.
    At step 6 (fragment 0 in flight) each rank saves its state, as the front-ends do and as every rank did before
    the inner state was written once per worker; fresh replicas resume from both."""
    from hf_diloco.core.layout.shard import ReplicatedValues

    ReplicatedValues.share_window = window
    model, optimizer, engine, ddp = _bf16_replica()
    _train_replica(model, optimizer, engine, ddp, range(1, 7))
    new, old = Path(folder) / "new", Path(folder) / "old"
    save_rank_state(new, rank, world, engine)
    old.mkdir(parents=True, exist_ok=True)
    torch.save({"engine": engine.state_dict(), "world_size": world}, rank_state_path(old, rank))
    inner_bytes = sum(t.nbytes for state in optimizer.state.values() for t in state.values() if t.dim())
    _train_replica(model, optimizer, engine, ddp, range(7, 10))
    before_close = {n: p.detach().clone() for n, p in model.named_parameters()}
    engine.close()
    stats = dict(engine.stats)  # before global_parameters(), which gathers fp32 θg over the shard group
    carrier, device = engine.worker.parameter_carrier(torch.device("cpu"))
    return {
        "before_close": before_close,
        "local": {n: p.detach().clone() for n, p in model.named_parameters()},
        "global": {n: v.clone() for n, v in engine.global_parameters().items()},
        "fragment_numels": [sum(fragment.sizes) for fragment in engine.fragments],
        "granularity": engine.exchange.granularity(),
        "stats": stats,
        "on_training_group": carrier is engine.topology.data_parallel_group and device.type == "cpu",
        "worker": engine.topology.worker_index,
        "inner_bytes": inner_bytes,
        "file_bytes": rank_state_path(new, rank).stat().st_size,
        "resumed": _resumed_replica(new, rank, world),
        "resumed_old": _resumed_replica(old, rank, world),
    }


@pytest.fixture(scope="module")
def bf16_replicas(tmp_path_factory):
    window = 1000
    folder = tmp_path_factory.mktemp("bf16_replicas")
    return window, run_on_processes(_train_bf16_replicas, 4, window, str(folder), timeout_seconds=240)


@pytest.mark.timeout(300)
def test_bf16_replicas_share_updates_bitwise_in_their_dtype_on_the_training_group(bf16_replicas):
    window, results = bf16_replicas
    for worker in range(2):
        first, second = results[2 * worker], results[2 * worker + 1]
        for label in ("before_close", "local"):  # the replicas hold the same bits after the rounds and at the end
            assert all(torch.equal(first[label][n], second[label][n]) for n in first[label]), (worker, label)
    for result in results:
        assert result["on_training_group"]
        for name, value in result["global"].items():  # θm <- θg at the end: the bf16 rounding of fp32 θg, once
            assert result["local"][name].dtype == torch.bfloat16
            assert torch.equal(result["local"][name], value.to(torch.bfloat16)), name
    # Per fragment: 2 rounds (each written once, merged) and close()'s tail, each with the verdict's agreement of three
    # float64s and the squared norm robust clipping combines over the worker's ranks (one float64); a write
    # all-gathers (D - 1) x the longest window of bf16 values, rank 0's (the last rank's is short).
    stats = results[0]["stats"]
    assert stats["outer_steps"] == 4 and stats["final_syncs"] == 2
    granularity = results[0]["granularity"]
    expected = 0
    for numel in results[0]["fragment_numels"]:
        span = -(-numel // granularity) * granularity // 2
        rank0 = min(span, numel)
        windows = [min(window, rank0 - begin) for begin in range(0, rank0, window)]
        expected += 3 * ((2 - 1) * sum(windows) * 2 + (2 - 1) * (3 + 1) * 8)
    for result in results:
        assert result["stats"]["bytes_sent_intra_worker"] == expected


@pytest.mark.timeout(300)
def test_replicated_ranks_store_the_inner_optimizer_once_per_worker_and_resume_bitwise(bf16_replicas):
    _, results = bf16_replicas
    for worker in range(2):
        first, second = results[2 * worker], results[2 * worker + 1]
        # The second rank's file leaves the inner optimizer (AdamW's two moments) to the first rank's.
        assert first["inner_bytes"] > 0 and second["file_bytes"] < first["file_bytes"] - first["inner_bytes"]
    for result in results:
        for label in ("resumed", "resumed_old"):  # this layout and the one with every rank's own inner state
            assert all(torch.equal(result[label][n], result["local"][n]) for n in result["local"]), label


def _nccl_replica(rank: int, world: int, port: int, out: str) -> None:
    """One rank of a worker of two CUDA ranks (default group "cpu:gloo,cuda:nccl"): bf16 parameters on its GPU."""
    import os

    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.cuda.set_device(rank)
    dist.init_process_group("cpu:gloo,cuda:nccl", rank=rank, world_size=world)
    try:
        device = torch.device("cuda", rank)
        model = tiny_model().to(device=device, dtype=torch.bfloat16)
        optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
        engine = DiLoCo(model, optimizer, DiLoCoConfig(data_parallel_per_worker=2, inner_steps=2))
        ddp = DistributedDataParallel(model, device_ids=[rank], process_group=engine.topology.data_parallel_group)
        for t in range(1, 6):
            ids = _worker_batch(0, t)[rank * BATCH // 2 : (rank + 1) * BATCH // 2].to(device)
            ddp(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            engine.step()
        engine.close()
        carrier, on = engine.worker.parameter_carrier(device)
        result = {
            "local": {n: p.detach().cpu() for n, p in model.named_parameters()},
            "global": engine.global_parameters(),
            "on_device": carrier is engine.topology.data_parallel_group and on == device,
            "still_on_device": all(p.device == device for p in model.parameters()),
        }
        torch.save(result, Path(out) / f"rank{rank}.pt")
    finally:
        dist.destroy_process_group()


@pytest.mark.timeout(300)
@pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2,
    reason="NCCL inside a worker needs two CUDA devices; the gloo test above runs the same code on the CPU",
)
def test_bf16_replicas_share_updates_over_nccl_on_their_device(tmp_path):
    """The parameter gather on the training group's NCCL backend, on the GPUs: replicas bitwise equal, the bf16
    rounding of θg, nothing moved off the device."""
    import torch.multiprocessing as mp

    from tests.dist_utils import free_port

    mp.spawn(_nccl_replica, args=(2, free_port(), str(tmp_path)), nprocs=2, join=True)
    first, second = (torch.load(tmp_path / f"rank{rank}.pt", weights_only=False) for rank in range(2))
    for result in (first, second):
        assert result["on_device"] and result["still_on_device"]
        for name, value in result["global"].items():
            assert torch.equal(result["local"][name], value.to(torch.bfloat16)), name
    assert all(torch.equal(first["local"][n], second["local"][n]) for n in first["local"])
