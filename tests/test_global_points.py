"""Global points on 3 real gloo processes: a bounded barrier names the rank that does not arrive, and the start-up
agreement check names the settings and the ranks that differ."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from hf_diloco.integrations.global_points import (
    PeerTimeoutError,
    SettingsMismatchError,
    check_ranks_agree,
    fingerprint,
    global_point_group,
    wait_for_all_ranks,
)
from tests.dist_utils import run_on_processes

BOUND = 3.0


def _attempt(run) -> dict:
    start = time.time()
    try:
        run()
    except (PeerTimeoutError, SettingsMismatchError) as error:
        return {"error": type(error).__name__, "message": str(error), "seconds": time.time() - start}
    return {"error": None, "seconds": time.time() - start}


def _global_points(rank: int, world: int) -> dict:
    results = {}
    group = global_point_group(BOUND)
    results["all_arrive"] = _attempt(lambda: wait_for_all_ranks(group, "the start of saving checkpoint-4", BOUND))
    if rank == 2:
        time.sleep(BOUND + 3)  # stalls past the bound
    results["late"] = _attempt(lambda: wait_for_all_ranks(group, "the end of writing checkpoint-4", BOUND))
    dist.barrier()  # the default group, generous bound: line everyone up again
    group = global_point_group(BOUND)  # the failed barrier may have left messages in flight on the old group
    model = {"hidden_size": 32, "hidden_act": "gelu" if rank == 2 else "silu", "rope_parameters": {"rope_theta": 1e4}}
    same = {"max_steps": 8, "model_config": model if rank != 2 else {**model, "hidden_act": "silu"}}
    results["same"] = _attempt(lambda: check_ranks_agree(same, group, BOUND))
    settings = {
        "max_steps": 12 if rank == 1 else 8,
        "model_config": model,
        "tokenizer": "x" * 10_000,  # long: exchanged as its fingerprint
        "data": "y" * (10_000 if rank == 0 else 9_999),
        "resume_from_step": None,
        **({"only_on_rank_1": True} if rank == 1 else {}),
    }
    results["differ"] = _attempt(lambda: check_ranks_agree(settings, group, BOUND, point="the start of training"))
    results["not_distributed"] = global_point_group(BOUND) is not None
    return results


@pytest.fixture(scope="module")
def results():
    return run_on_processes(_global_points, 3, timeout_seconds=60)


@pytest.mark.timeout(300)
def test_barrier_names_the_missing_rank_within_the_bound(results):
    for result in results:
        assert result["all_arrive"]["error"] is None
    zero, one, two = (r["late"] for r in results)
    assert zero["error"] == one["error"] == two["error"] == "PeerTimeoutError"
    assert zero["message"].startswith("Rank(s) [2] did not reach the end of writing checkpoint-4 within ")
    assert "sync_timeout_seconds=3 s" in zero["message"] and "rank 0 stops here" in zero["message"]
    assert one["message"].startswith("Rank 1 reached the end of writing checkpoint-4, but rank 0 did not confirm")
    assert "rank 0's error names it" in one["message"]
    assert BOUND - 0.5 <= zero["seconds"] <= BOUND + 3 and one["seconds"] <= BOUND + 3


@pytest.mark.timeout(300)
def test_agreement_check_names_each_setting_and_rank_that_differ(results):
    for result in results:
        assert result["same"]["error"] is None
        differ = result["differ"]
        assert differ["error"] == "SettingsMismatchError" and differ["seconds"] < BOUND
        lines = differ["message"].splitlines()
        assert lines[0] == (
            "Settings that every rank must share differ between ranks (checked at the start of training, before any "
            "work):"
        )
        assert "  - max_steps: ranks [1] disagree with rank 0 (ranks 0, 2: 8; rank 1: 12)" in lines
        assert '  - model_config: ranks [2] differ from rank 0 in hidden_act: rank 0 "silu", rank 2 "gelu"' in lines
        assert any(line.startswith("  - data: ranks [1, 2] disagree with rank 0") for line in lines)
        assert '  - only_on_rank_1: ranks [1] disagree with rank 0 (ranks 0, 2: "<not set>"; rank 1: true)' in lines
        listed = [line for line in lines if line.startswith("  - ")]
        assert len(listed) == 4 and not any("tokenizer" in line or "resume_from_step" in line for line in listed)
        assert result["not_distributed"] is True


def test_fingerprint_is_stable_and_order_free():
    assert fingerprint({"a": 1, "b": [1, 2]}) == fingerprint({"b": [1, 2], "a": 1})
    assert fingerprint({"a": 1}) != fingerprint({"a": 2}) and len(fingerprint("x")) == 16
    assert global_point_group(5.0) is None  # not distributed: no group, and the checks return at once
    wait_for_all_ranks(None, "anything", 1.0)
    check_ranks_agree({"max_steps": 1}, None, 1.0)
