"""`scripts/bench_eager_estimate.py` instruments a real eager run (a smoke run on a few rounds)."""

import importlib
import json
import math
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[1] / "scripts"


@pytest.mark.timeout(300)
def test_records_both_estimates_every_round(tmp_path, monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(SCRIPTS))  # the worker processes import the script by its module name
    module = importlib.import_module("bench_eager_estimate")
    out = tmp_path / "estimate.json"
    method = "eager_fp4:inner_steps=2,outer_lr=1.0,outer_momentum=0.0,eager_estimate=fitted"
    module.main(["--token_budget", str(8 * 2 * 8 * 128), "--method", method, "--out", str(out)])
    rounds = json.loads(out.read_text())["workers"][0]["rounds"]
    # Rounds launched at steps 2, 4, 6, 8: each average arrives at the next launch, the last one at close().
    assert [row["step"] for row in rounds] == [4, 6, 8, 8]
    measured = [row for row in rounds if "fitted_weight" in row]
    assert len(measured) == 3  # round 1's Δ~ = Δm / M estimates nothing
    for row in measured:
        assert 0.5 <= row["fitted_weight"] <= 1.0
        assert all(math.isfinite(row[key]) and row[key] > 0 for key in ("own_share_error", "fitted_error"))
    assert "Medians: own_share" in capsys.readouterr().out


@pytest.mark.timeout(300)
def test_scores_every_candidate_along_a_blocking_run(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    module = importlib.import_module("bench_eager_estimate")
    out = tmp_path / "blocking.json"
    method = "diloco_fp4:inner_steps=2,outer_lr=0.5,outer_momentum=0.5"
    module.main(["--token_budget", str(8 * 2 * 8 * 128), "--method", method, "--out", str(out)])
    rounds = json.loads(out.read_text())["workers"][0]["rounds"]
    assert [row["step"] for row in rounds] == [2, 4, 6, 8]  # blocking: each average arrives at its own launch
    for row in rounds[1:]:
        assert set(module.BLOCKING_COLUMNS) <= set(row)
        # The oracle fits each parameter on the round itself: no estimate of the same form can do better.
        assert row["oracle_error"] <= min(row["fitted_error"], row["own_error"], row["own_share_error"]) + 1e-6
        assert -1 <= row["workers_cosine"] <= 1


def test_refuses_a_method_it_cannot_instrument(monkeypatch):
    monkeypatch.syspath_prepend(str(SCRIPTS))
    module = importlib.import_module("bench_eager_estimate")
    for method in ("streaming_fp4", "ddp", "delayed_fp4"):  # fragments with a delay, no engine, no estimate
        with pytest.raises(SystemExit):
            module.main(["--method", method])
