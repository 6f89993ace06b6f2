"""The observer hook (`DiLoCo.add_observer`, `register_round_observer`) and the typed stats record.

Two workers, several overlap modes in one launch; every number a record carries is checked against what the test
itself gathers or measures on the model, not against the engine.
"""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from hf_diloco.core.rounds.stats import EngineStats
from tests.dist_utils import run_on_processes
from tests.engine_common import INNER_LR, inner_step, tiny_model

PLAIN_OUTER = dict(outer_lr=1.0, outer_momentum=0.0)  # θ <- θ - update: every update is readable off the weights


def _observed_run(rank: int, world: int, config: dict, steps: int) -> dict:
    from hf_diloco import DiLoCo, DiLoCoConfig
    from hf_diloco.core.rounds.stats import register_round_observer

    model = tiny_model(layers=2)
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(**config))
    own, everywhere, checks = [], [], []

    def gather_mean(record) -> None:  # a collective at the same point on every worker: the record's average is it
        everyone = [torch.zeros_like(record.sent) for _ in range(world)]
        dist.all_gather(everyone, record.sent)
        checks.append(torch.allclose(sum(everyone) / world, record.average, rtol=0, atol=1e-7))

    engine.add_observer(own.append)
    engine.add_observer(gather_mean)
    handle = register_round_observer(everywhere.append)
    flat = {}  # inner step -> this worker's θm and θg after engine.step()
    for t in range(1, steps + 1):
        inner_step(model, optimizer, rank, t)
        engine.step()
        flat[t] = (torch.nn.utils.parameters_to_vector(model.parameters()).detach().clone(), _theta_g(engine))
        if t == steps // 2:
            handle.remove()
    engine.close()
    return {
        "records": own,
        "process_wide": len(everywhere),
        "mean_matches": checks,
        "flat": flat,
        "stats": engine.stats,
        "piece_sizes": [sum(f.sizes) for f in engine.fragments],
        "bytes_sent": engine.stats["bytes_sent"],
    }


def _theta_g(engine) -> torch.Tensor:
    params = engine.global_parameters()
    return torch.cat([params[name].reshape(-1) for name, _ in engine.model.named_parameters()])


def _cases(rank: int, world: int) -> dict:
    return {
        "streaming": _observed_run(rank, world, dict(inner_steps=4, num_fragments=2, sync_delay=1, **PLAIN_OUTER), 10),
        "eager": _observed_run(rank, world, dict(inner_steps=3, overlap="eager", **PLAIN_OUTER), 12),
    }


@pytest.fixture(scope="module")
def observed() -> list[dict]:
    return run_on_processes(_cases, 2)


@pytest.mark.timeout(300)
def test_every_round_is_observed_with_what_was_sent_and_averaged(observed):
    for worker in observed:
        run = worker["streaming"]
        records = run["records"]
        # Fragments launched at 2, 4, 6, 8, 10 (P = 2, H = 4), applied a step later; close() applies the last one
        # at step 10 and syncs fragment 1's tail (trained since its launch at 8).
        assert [(r.fragment, r.step, r.final) for r in records] == [
            (0, 3, False),
            (1, 5, False),
            (0, 7, False),
            (1, 9, False),
            (0, 10, False),
            (1, 10, True),
        ]
        assert all(run["mean_matches"]) and len(run["mean_matches"]) == len(records)
        assert sum(r.bytes_sent for r in records) == run["bytes_sent"] > 0
        assert all(r.rejected is None and r.estimate is None and r.workers == 2 for r in records)
        assert [sum(r.piece_sizes) for r in records[:2]] == run["piece_sizes"]
        assert run["process_wide"] == 2  # the process-wide observer saw the rounds until it was removed at step 5
        for record in records[:4]:  # θg moved by exactly the average of the fragment applied at that step
            before, after = run["flat"][record.step - 1][1], run["flat"][record.step][1]
            assert torch.count_nonzero(before - after) == record.average.count_nonzero()
            torch.testing.assert_close((before - after).norm(), record.average.norm(), rtol=1e-5, atol=0)


@pytest.mark.timeout(300)
def test_eager_records_carry_the_update_each_worker_applied_to_its_trajectory(observed):
    for worker in observed:
        run = worker["eager"]
        records = [r for r in run["records"] if not r.final]
        assert [r.step for r in records] == [6, 9, 12, 12]  # a round later; the last at close()
        for earlier, later in zip(records, records[1:3]):
            # Δ~ after round r = avg^r + (Δm^{r+1} - Δm^r) / M (own_share), and a_m moved by exactly Δ~ (lr 1).
            expected = earlier.average + (later.sent - earlier.sent) / 2
            torch.testing.assert_close(earlier.estimate, expected, rtol=0, atol=1e-6)
            moved = run["flat"][earlier.step - 3][0] - run["flat"][earlier.step][0]
            torch.testing.assert_close(moved, earlier.estimate, rtol=0, atol=1e-5)
        assert records[-1].estimate is None  # applied by close(): no next round to estimate


def test_stats_read_like_the_dict_they_are_saved_as():
    stats = EngineStats(bytes_sent=10, lowrank_rank=4)
    stats.book_exchange(fragment=1, bytes_sent=5, bytes_intra=2, per_fragment=True)
    assert stats["bytes_sent"] == 15 and stats.get("eager_estimate_weight", 0) == 0
    assert stats["fragment1_syncs"] == 1 and stats["fragment1_bytes_sent"] == 5 and "fragment0_syncs" not in stats
    saved = dict(stats)
    assert "lowrank_rank" in saved and "eager_estimate_weight" not in saved and saved["max_sync_bytes"] == 5
    assert dict(EngineStats.from_dict(saved)) == saved
    assert EngineStats.from_dict({"outer_steps": 3, "key_of_a_later_version": 1})["final_syncs"] == 0
    with pytest.raises(KeyError):
        stats["fragment_syncs"]  # noqa: B018 - the dict inside is not a key of its own
