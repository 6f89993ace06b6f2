"""Low rank with each worker's fragment split between D = 2 data-parallel ranks, each matrix factored by one rank:
2 workers x 2 ranks on real gloo processes.

The reference is plain PowerSGD written here on whole matrices in one process, from every worker's pseudo-gradient
(the sum of its ranks' shares): P = mean M_i Q, P^ = orthonormal basis of P, Q' = mean M_i^T P^, out = P^ Q'^T,
e_i = M_i - P^ Q_i^T. With bf16 every value that crosses workers is rounded to bf16 first (elementwise), and the
average again (reduce-scatter's re-encoding): P, Q and the rest alike, so e_i subtracts P^ bf16(Q_i)^T and keeps
x - bf16(x) on the rest.
"""

from __future__ import annotations

import io

import pytest
import torch

from hf_diloco.core.compression.codecs import make_codec
from hf_diloco.core.compression.lowrank import LowRankCompressor, orthonormalize
from hf_diloco.core.exchange.exchange import OuterExchange, _ExchangeJob
from hf_diloco.core.exchange.lowrank_split import assign_owners, matrix_owners
from hf_diloco.core.layout.shard import ShardLayout
from hf_diloco.core.layout.topology import Topology
from tests.dist_utils import run_on_processes

WORKERS, RANKS, RANK = 2, 2, 2
# Matrices of different shapes (one too small to shrink at rank 2, so part of the rest) and 1-D tensors.
SHAPES = [(24, 16), (16,), (10, 30), (40, 8), (8,), (3, 3), (12, 20)]
NUMEL = sum(torch.Size(s).numel() for s in SHAPES)
SEED = 3
ROUNDS = 3


def _offsets() -> list[int]:
    offsets, at = [], 0
    for shape in SHAPES:
        offsets.append(at)
        at += torch.Size(shape).numel()
    return offsets


def _compressed() -> list[int]:
    """Indices into SHAPES of the matrices rank 2 compresses: (rows + cols) x 2 < rows x cols."""
    return [i for i, s in enumerate(SHAPES) if len(s) == 2 and (s[0] + s[1]) * RANK < s[0] * s[1]]


def _layout(kind: str) -> ShardLayout:
    """`contiguous`: rank k holds [k L, (k + 1) L) (replicated workers; the cut falls inside a row of a matrix).
    `rows`: rank k holds its torch.chunk of every tensor's rows (FSDP)."""
    if kind == "contiguous":
        half = NUMEL // 2 + 5
        return ShardLayout(NUMEL, (((0, half),), ((half, NUMEL - half),)))
    runs: list[list[tuple[int, int]]] = [[] for _ in range(RANKS)]
    for offset, shape in zip(_offsets(), SHAPES):
        row = torch.Size(shape[1:]).numel()
        size = -(-shape[0] // RANKS)
        for k in range(RANKS):
            first, stop = min(k * size, shape[0]), min((k + 1) * size, shape[0])
            runs[k].append((offset + first * row, (stop - first) * row))
    return ShardLayout(NUMEL, tuple(tuple(r) for r in runs))


def _delta(worker: int, index: int) -> torch.Tensor:
    return torch.randn(NUMEL, generator=torch.Generator().manual_seed(1000 * worker + index))


def _share(vector: torch.Tensor, layout: ShardLayout, dp: int) -> torch.Tensor:
    return torch.cat([vector[offset : offset + length] for offset, length in layout.runs[dp]])


def _rounds(rank: int, world: int, kind: str, codec: str) -> dict:
    topology = Topology.from_default_group(data_parallel_per_worker=RANKS)
    worker, dp = topology.worker_index, topology.dp_index
    layout = _layout(kind)
    exchange = OuterExchange(topology, make_codec(codec), keep_residual=True)
    compressor = LowRankCompressor(SHAPES, rank=RANK, seed=SEED)
    residual = torch.zeros(layout.length(dp))
    averages, residuals, intra, saved = [], [], [], None
    for index in range(ROUNDS):
        if index == ROUNDS - 1:  # a checkpoint of the compressor before the last round, through bytes
            buffer = io.BytesIO()
            torch.save(compressor.state_dict(), buffer)
            saved = buffer.getvalue()
            before_last = residual.clone()
        result = exchange.launch(
            _share(_delta(worker, index), layout, dp) + residual, "t", compressor=compressor, layout=layout
        ).wait()
        residual = result.residual
        averages.append(result.average)
        residuals.append(result.residual)
        intra.append(result.bytes_sent_intra_worker)
    resumed = LowRankCompressor(SHAPES, rank=RANK, seed=SEED + 1)  # another seed: the state must hold everything
    resumed.load_state_dict(torch.load(io.BytesIO(saved), weights_only=True))
    again = exchange.launch(
        _share(_delta(worker, ROUNDS - 1), layout, dp) + before_last, "t", compressor=resumed, layout=layout
    ).wait()
    exchange.close()
    elsewhere = LowRankCompressor(SHAPES, rank=RANK, seed=SEED)
    assign_owners(elsewhere, layout, 1 - dp)  # the other rank's matrices: this rank's state lacks their warm starts
    with pytest.raises(ValueError, match="load each rank's own state file"):
        elsewhere.load_state_dict(torch.load(io.BytesIO(saved), weights_only=True))
    return {
        "averages": averages,
        "residuals": residuals,
        "intra": intra,
        "resumed": (again.average, again.residual),
        "warm_starts": [q is not None for q in compressor.q],
    }


def _bf16(values: torch.Tensor) -> torch.Tensor:
    return values.to(torch.bfloat16).float()


def _reference(codec: str) -> tuple[list[torch.Tensor], list[list[torch.Tensor]]]:
    """Whole-matrix PowerSGD of both workers' whole pseudo-gradients, with error feedback, in one process."""
    lossy = _bf16 if codec == "bf16" else (lambda x: x)

    def mean(parts: list[torch.Tensor]) -> torch.Tensor:
        return lossy(sum(lossy(p) for p in parts) / len(parts))

    generator = torch.Generator().manual_seed(SEED)
    compressed = _compressed()
    q = {i: torch.randn(SHAPES[i][1], RANK, generator=generator) for i in compressed}
    residuals = [torch.zeros(NUMEL) for _ in range(WORKERS)]
    averages, all_residuals = [], []
    for index in range(ROUNDS):
        inputs = [_delta(w, index) + residuals[w] for w in range(WORKERS)]
        average = mean(inputs)  # the rest
        new = [x - lossy(x) for x in inputs]
        for i in compressed:
            start, (rows, cols) = _offsets()[i], SHAPES[i]
            mats = [x[start : start + rows * cols].view(rows, cols) for x in inputs]
            p_hat = orthonormalize(mean([m @ q[i] for m in mats]))
            q_parts = [m.T @ p_hat for m in mats]
            q[i] = mean(q_parts)
            average[start : start + rows * cols] = (p_hat @ q[i].T).reshape(-1)
            for w in range(WORKERS):
                new[w][start : start + rows * cols] = (mats[w] - p_hat @ lossy(q_parts[w]).T).reshape(-1)
        residuals = new
        averages.append(average)
        all_residuals.append(residuals)
    return averages, all_residuals


def _expected_intra(layout: ShardLayout, dp: int) -> int:
    """fp32 bytes rank `dp` sends inside its worker: the pieces of matrices another rank owns, then for each piece
    another rank holds of a matrix it owns, P^ of the rows the piece touches, Q' and the Q its worker sent."""
    compressed = _compressed()
    held = [torch.cat([torch.arange(o, o + n) for o, n in layout.runs[k]]) for k in range(RANKS)]
    spans = [(_offsets()[i], SHAPES[i][0] * SHAPES[i][1]) for i in compressed]
    values_held = [[int(((h >= start) & (h < start + n)).sum()) for h in held] for start, n in spans]
    owners = matrix_owners([n for _, n in spans], values_held)
    values = 0
    for j, i in enumerate(compressed):
        start, (rows, cols) = _offsets()[i], SHAPES[i]
        for k in range(RANKS):
            inside = held[k][(held[k] >= start) & (held[k] < start + rows * cols)] - start
            if k == dp and owners[j] != dp:
                values += inside.numel()
            if k != dp and owners[j] == dp and inside.numel():
                touched = int(inside.max()) // cols - int(inside.min()) // cols + 1
                values += (touched + 2 * cols) * RANK
    return 4 * values


def test_owners_keep_matrices_where_they_lie_within_a_balanced_load():
    # halves of a vector: each matrix to the rank that holds it, the straddling one to the larger holder
    assert matrix_owners([100, 100, 60], [[100, 0], [0, 100], [40, 20]]) == (0, 1, 0)
    # rows split evenly (FSDP): no locality, so largest first to the less loaded rank, ties to the lower
    assert matrix_owners([50, 40, 30, 20, 10], [[25, 25], [20, 20], [15, 15], [10, 10], [5, 5]]) == (0, 1, 1, 0, 0)
    # never beyond the average load plus the largest matrix, however skewed the holding
    assert matrix_owners([100] * 4, [[100, 0]] * 4) == (0, 0, 0, 1)
    assert matrix_owners([], []) == ()


@pytest.mark.timeout(300)
@pytest.mark.parametrize("kind", ["contiguous", "rows"])
@pytest.mark.parametrize("codec", ["none", "bf16"])
def test_split_low_rank_equals_whole_matrix_powersgd(kind, codec):
    results = run_on_processes(_rounds, WORKERS * RANKS, kind, codec)
    layout = _layout(kind)
    averages, residuals = _reference(codec)
    # bf16: a value whose fp32 round-off lands on a bf16 rounding boundary may round the other way (one bf16 step).
    atol = 1e-5 if codec == "none" else 2**-7 * float(max(a.abs().max() for a in averages))
    for rank, result in enumerate(results):
        worker, dp = divmod(rank, RANKS)
        for index in range(ROUNDS):
            for ours, expected in (
                (result["averages"][index], _share(averages[index], layout, dp)),
                (result["residuals"][index], _share(residuals[index][worker], layout, dp)),
            ):
                torch.testing.assert_close(ours, expected, atol=atol, rtol=0)
                assert float(((ours - expected).abs() > 1e-5).float().mean()) < 0.01
        # every worker's rank dp holds the same bits of the average; the resumed compressor continues bitwise
        peer = results[(1 - worker) * RANKS + dp]
        assert all(torch.equal(a, b) for a, b in zip(result["averages"], peer["averages"]))
        again_average, again_residual = result["resumed"]
        assert torch.equal(again_average, result["averages"][-1])
        assert torch.equal(again_residual, result["residuals"][-1])
        # no rank gathers the fragment: the bytes it sends inside the worker are far below (D - 1) / D of it
        assert result["intra"] == [_expected_intra(layout, dp)] * ROUNDS
        assert result["intra"][0] < (RANKS - 1) / RANKS * NUMEL * 4
    # each rank keeps the warm starts of its own matrices only, and together they keep every one once
    kept = torch.tensor([results[dp]["warm_starts"] for dp in range(RANKS)])
    assert kept.sum(0).tolist() == [1] * len(_compressed())
    assert not hasattr(_ExchangeJob, "_gather_shares")


# ------------------------------------------------------------------------------------------------ the engine

ENGINE_CASES = {
    "plain": dict(inner_steps=4, num_fragments=2, sync_delay=1, lowrank_rank=2, error_feedback=True),
    "int8": dict(
        inner_steps=4, num_fragments=2, sync_delay=1, lowrank_rank=2, error_feedback=True, compression="int8"
    ),
}


def _replica(config, seed: int = 0):
    from torch.nn.parallel import DistributedDataParallel

    from hf_diloco import DiLoCo
    from tests.engine_common import INNER_LR, tiny_model

    model = tiny_model(seed=seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(model, optimizer, config)
    return model, optimizer, engine, DistributedDataParallel(model, process_group=engine.topology.data_parallel_group)


def _train(replica, steps: range) -> None:
    from tests.engine_common import BATCH, batch_for

    model, optimizer, engine, ddp = replica
    worker, dp = engine.topology.worker_index, engine.topology.dp_index
    for t in steps:
        ids = batch_for(worker, t)["input_ids"][dp * BATCH // RANKS : (dp + 1) * BATCH // RANKS]
        ddp(input_ids=ids, labels=ids).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.step()


def _engine_runs(rank: int, world: int) -> dict:
    """Streaming fragments of a tiny Llama with DDP replicas, saved with fragment 0's exchange in flight and resumed
    in a fresh replica (other weights: everything must come from the state)."""
    from hf_diloco import DiLoCoConfig

    out = {}
    for name, settings in ENGINE_CASES.items():
        config = DiLoCoConfig(data_parallel_per_worker=RANKS, **settings)
        replica = _replica(config)
        _train(replica, range(1, 7))
        buffer = io.BytesIO()
        torch.save(replica[2].state_dict(), buffer)
        buffer.seek(0)
        state = torch.load(buffer, weights_only=True)
        _train(replica, range(7, 13))
        replica[2].close()
        resumed = _replica(config, seed=7)
        resumed[2].load_state_dict(state)
        _train(resumed, range(7, 13))
        resumed[2].close()
        out[name] = {
            "in_flight": sorted(state["pending"]),
            "global": replica[2].global_parameters(),
            "local": {n: p.detach().clone() for n, p in replica[0].named_parameters()},
            "resumed_global": resumed[2].global_parameters(),
            "resumed_local": {n: p.detach().clone() for n, p in resumed[0].named_parameters()},
            "compressed": [len(f.compressor.matrices) for f in replica[2].fragments],
        }
    return out


@pytest.mark.timeout(600)
def test_engine_split_low_rank_keeps_replicas_and_workers_identical_and_resumes_bitwise():
    results = run_on_processes(_engine_runs, WORKERS * RANKS, timeout_seconds=300)
    for name in ENGINE_CASES:
        first = results[0][name]
        assert first["in_flight"] == [0] and min(first["compressed"]) >= 2, name
        for result in results:
            ours = result[name]
            for param, value in first["global"].items():  # θg: every rank of every worker
                assert torch.equal(ours["global"][param], value), (name, param)
            for label in ("resumed_global", "resumed_local"):
                kept = label.removeprefix("resumed_")
                assert all(torch.equal(ours[label][p], ours[kept][p]) for p in ours[kept]), (name, label)
        for worker in range(WORKERS):  # the replicas of a worker hold the same weights
            a, b = (results[worker * RANKS + dp][name]["local"] for dp in range(RANKS))
            assert all(torch.equal(a[p], b[p]) for p in a), name
    plain, int8 = results[0]["plain"]["global"], results[0]["int8"]["global"]
    assert any(not torch.equal(plain[p], int8[p]) for p in plain)  # the codec was used
