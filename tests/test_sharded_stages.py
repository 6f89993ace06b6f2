"""Workers of M x D x S = 2 x 2 x 2 ranks at the engine level: every pipeline stage `fully_shard`-ed over its D ranks
(`hf_diloco.worker_mesh` with `pipeline_stages=2`), each engine syncing its stage's share with the same stage's
ranks of the other worker, fragments following the global block indices.

The stages train independent objectives (each its own regression, as a stage's engine cannot tell), so a plain-torch
reference written here, one worker's whole batch per step and no sharding, gives the golden θg of every stage.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn
from torch.distributed.fsdp import fully_shard

from tests.dist_utils import run_on_processes

WORKERS, RANKS, STAGES = 2, 2, 2
LAYERS, WIDTH, BATCH = 4, 16, 4
H, P, STEPS, LR = 4, 2, 10, 1e-2
SETTINGS = dict(inner_steps=H, num_fragments=P, pipeline_stages=STAGES, data_parallel_per_worker=RANKS)


class Block(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH)
        self.linear = nn.Linear(WIDTH, WIDTH)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + torch.tanh(self.linear(self.norm(x)))


class Stage(nn.Module):
    """Stage `stage` of a stack of LAYERS blocks, its blocks under their global indices (as a pipeline stage holds
    them), the input projection on the first stage and the head on the last."""

    def __init__(self, stage: int) -> None:
        super().__init__()
        torch.manual_seed(0)
        blocks, embed, head = [Block() for _ in range(LAYERS)], nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 1)
        first = stage * LAYERS // STAGES
        self.embed = embed if stage == 0 else None
        self.layers = nn.ModuleDict({str(i): blocks[i] for i in range(first, first + LAYERS // STAGES)})
        self.head = head if stage == STAGES - 1 else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed(x) if self.embed is not None else x
        for block in self.layers.values():
            x = block(x)
        return self.head(x) if self.head is not None else x


def _loss(model: nn.Module, stage: int, worker: int, step: int, rows: slice) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * worker + 10 * step + stage)
    x, target = torch.randn(BATCH, WIDTH, generator=generator), torch.randn(BATCH, 1, generator=generator)
    out = model(x[rows])
    return (out.sum(dim=-1, keepdim=True) - target[rows]).pow(2).mean()


def _fragment(name: str) -> int:
    return int(name.split(".")[1]) % P if name.startswith("layers.") else 0  # strided over global block indices


def _sharded_stages(rank: int, world: int) -> dict:
    from hf_diloco import DiLoCo, DiLoCoConfig, worker_mesh

    config = DiLoCoConfig(**SETTINGS)
    mesh = worker_mesh(config)
    stage = rank % STAGES
    model = Stage(stage)
    for block in model.layers.values():
        fully_shard(block, mesh=mesh)
    fully_shard(model, mesh=mesh)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    engine = DiLoCo(model, optimizer, config, num_blocks=LAYERS)
    worker, dp = engine.topology.worker_index, engine.topology.dp_index
    share = BATCH // RANKS
    for step in range(1, STEPS + 1):
        _loss(model, stage, worker, step, slice(dp * share, (dp + 1) * share)).backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.step()
    held = engine.stats["outer_state_bytes"]
    engine.close()
    return {
        "stage": stage,
        "worker": worker,
        "mesh": mesh.mesh.tolist(),
        "fragments": engine.fragment_names(),
        "global": engine.global_parameters(),
        "outer_state_bytes": held,
        "parameters": sum(p.numel() for p in model.parameters()),
    }


def _reference(stage: int) -> dict[str, torch.Tensor]:
    """Plain DiLoCo for one stage: WORKERS unsharded copies, whole batches, Nesterov outer steps per fragment."""
    models = [Stage(stage) for _ in range(WORKERS)]
    optimizers = [torch.optim.AdamW(m.parameters(), lr=LR) for m in models]
    params = [dict(m.named_parameters()) for m in models]
    glob = {n: p.detach().clone() for n, p in params[0].items()}
    momentum: dict[str, torch.Tensor] = {}
    for step in range(1, STEPS + 1):
        for worker, (model, optimizer) in enumerate(zip(models, optimizers)):
            _loss(model, stage, worker, step, slice(None)).backward()
            optimizer.step()
            optimizer.zero_grad()
        for fragment in range(P):
            if step % H != (fragment + 1) * H // P % H:
                continue
            for name in (n for n in glob if _fragment(n) == fragment):
                mean = sum(glob[name] - p[name].detach() for p in params) / WORKERS
                momentum[name] = mean if name not in momentum else 0.9 * momentum[name] + mean
                glob[name] = glob[name] - 0.7 * (mean + 0.9 * momentum[name])
                for p in params:
                    p[name].data.copy_(glob[name])
    for name in glob:  # close(): every fragment trained since its last launch sends its tail, a plain average
        glob[name] = glob[name] - sum(glob[name] - p[name].detach() for p in params) / WORKERS
    return glob


@pytest.mark.timeout(600)
def test_pipeline_stages_of_fsdp_workers_sync_their_shares_with_the_same_stage():
    results = run_on_processes(_sharded_stages, WORKERS * RANKS * STAGES, timeout_seconds=300)
    for rank, result in enumerate(results):
        worker, stage = rank // (RANKS * STAGES), rank % STAGES
        assert result["mesh"] == [worker * RANKS * STAGES + dp * STAGES + stage for dp in range(RANKS)]
        assert {_fragment(n) for names in result["fragments"] for n in names} == set(range(P))
        for index, names in enumerate(result["fragments"]):
            assert all(_fragment(n) == index for n in names), names
        # D = 1 holds θg, the outer momentum and the reused pseudo-gradient and average buffers (a fragment's each):
        # at most 16 bytes per parameter; each of the D = 2 ranks about half of it.
        bound = 0.55 * 16 * result["parameters"]
        assert 0 < result["outer_state_bytes"] <= bound, result["outer_state_bytes"]
    for stage in range(STAGES):
        expected = _reference(stage)
        mine = [r for r in results if r["stage"] == stage]
        for result in mine:
            assert set(result["global"]) == set(expected)
            for name, value in expected.items():
                torch.testing.assert_close(result["global"][name], value, atol=1e-5, rtol=0, msg=name)
            assert all(torch.equal(result["global"][n], mine[0]["global"][n]) for n in expected)
