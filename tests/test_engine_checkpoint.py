"""A DiLoCo state written by the engine before its per-fragment restructuring still loads and continues bitwise
(on the CPU that wrote it; within rounding of the last bits on another).

`tests/fixtures/engine_state_rank{r}.pt` were written by `tests/fixtures/make_engine_state.py` running the engine of
commit cbd124c: two workers' states saved mid-round (both fragments' exchanges in flight, eager with the fitted
estimate, low rank, fp4, error feedback) and where their uninterrupted run ended.
"""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from tests.dist_utils import run_on_processes
from tests.fixtures.make_engine_state import CONFIG, SAVED_AT, STEPS, fixture_model, train

FIXTURES = Path(__file__).resolve().parent / "fixtures"
# Keys this engine writes beyond that layout, and a timing that differs from run to run.
# Absolute difference allowed where the fixture's machine and this one round differently (see `_equal_up_to_the_cpu`).
CPU_TOLERANCE = 1e-6
ADDED, TIMED = (
    {"divergence_guard", "skipped_divergent", "shard", "outer_state_bytes", "settings"},
    {"sync_wait_seconds"},
)
# Bytes on the wire follow the exchange's wire format, which gained the schedule tag (24 bytes per peer and exchange)
# after the fixture was written: the saved counts must be the written ones less those tags.
WIRE_COUNTS = {"bytes_sent", "max_sync_bytes", "fragment0_bytes_sent", "fragment1_bytes_sent"}
SCHEDULE_TAG_BYTES = 24


def _differences(saved, written, path: str = "") -> list[str]:
    """Where `written` differs from `saved` (tensors bitwise), ignoring the keys the layout gained since."""
    if torch.is_tensor(saved):
        same = torch.is_tensor(written) and saved.dtype == written.dtype and saved.shape == written.shape
        return [] if same and _equal_up_to_the_cpu(saved, written) else [path]
    if isinstance(saved, dict):
        keys = set(written) - ADDED
        if set(saved) != keys:
            return [f"{path}: keys {sorted(map(str, set(saved) ^ keys))}"]
        return [
            d
            for k in saved
            if k not in TIMED
            for d in _differences(saved[k], _less_schedule_tags(k, saved[k], written[k]), f"{path}/{k}")
        ]
    if isinstance(saved, (list, tuple)):
        if len(saved) != len(written):
            return [f"{path}: length"]
        return [d for i, (a, b) in enumerate(zip(saved, written)) for d in _differences(a, b, f"{path}[{i}]")]
    if isinstance(saved, float) and isinstance(written, float):  # a fitted estimate: rounding of the CPU too
        return [] if abs(saved - written) <= CPU_TOLERANCE else [f"{path}: {saved!r} != {written!r}"]
    return [] if saved == written else [f"{path}: {saved!r} != {written!r}"]


def _less_schedule_tags(key: str, saved, written):
    """A byte count of the current wire format less its schedule tags (a whole number of them, fewer than the
    exchanges the count covers: at most one per 24 bytes of the old count), or `written` unchanged."""
    if key not in WIRE_COUNTS or not isinstance(written, int) or not isinstance(saved, int):
        return written
    tags, remainder = divmod(written - saved, SCHEDULE_TAG_BYTES)
    return saved if remainder == 0 and 0 < tags and tags * SCHEDULE_TAG_BYTES < saved else written


def _equal_up_to_the_cpu(saved: torch.Tensor, computed: torch.Tensor) -> bool:
    """Bitwise on the machine that wrote the fixture; on another CPU its kernels may differ in the last bits (seen:
    3.7e-9 on weights of scale 1), far below what a value lost or misread on load changes (the whole update)."""
    if not saved.is_floating_point():
        return torch.equal(saved, computed)
    return torch.equal(saved, computed) or torch.allclose(saved, computed, rtol=0, atol=CPU_TOLERANCE)


def _resume_saved_state(rank: int, world: int) -> dict:
    from hf_diloco import DiLoCo, DiLoCoConfig

    fixture = torch.load(FIXTURES / f"engine_state_rank{rank}.pt", weights_only=True)
    torch.manual_seed(7)
    model = fixture_model()
    with torch.no_grad():  # other weights than the state's: everything must come from the state
        for param in model.parameters():
            param.add_(torch.randn_like(param))
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(**CONFIG))
    engine.load_state_dict(copy.deepcopy(fixture["state"]))  # the optimizers would keep training its tensors
    train(model, optimizer, engine, rank, range(SAVED_AT + 1, STEPS + 1))
    engine.close()
    resumed = {"global": engine.global_parameters(), "local": dict(model.named_parameters())}
    # The same run from the start: this engine writes that layout, value for value.
    model = fixture_model()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(**CONFIG))
    train(model, optimizer, engine, rank, range(1, SAVED_AT + 1))
    return {
        "resumed": [
            name
            for kind in ("global", "local")
            for name, value in fixture["final"][kind].items()
            if not _equal_up_to_the_cpu(value, resumed[kind][name].detach())
        ],
        "layout": _differences(fixture["state"], engine.state_dict()),
        "in_flight": sorted(fixture["state"]["pending"]),
    }


@pytest.mark.timeout(300)
def test_state_written_before_the_restructuring_resumes_bitwise():
    for result in run_on_processes(_resume_saved_state, 2):
        assert result["in_flight"] == [0, 1]
        assert result["resumed"] == [], result["resumed"]  # θg and θm end exactly where the saved run ended
        assert result["layout"] == [], result["layout"]
