"""`benchmarks.eager_estimate` instruments a real eager run (a smoke run on a few rounds)."""

import json
import math

import pytest

from benchmarks import eager_estimate


@pytest.mark.timeout(300)
def test_records_both_estimates_every_round(tmp_path, capsys):
    out = tmp_path / "estimate.json"
    method = "eager_fp4:inner_steps=2,outer_lr=1.0,outer_momentum=0.0,eager_estimate=fitted"
    argv = ["--token_budget", str(8 * 2 * 8 * 128), "--method", method, "--out", str(out)]
    eager_estimate.main(argv)
    rounds = json.loads(out.read_text())["workers"][0]["rounds"]
    # Rounds launched at steps 2, 4, 6, 8: each average arrives at the next launch, the last one at close().
    assert [row["step"] for row in rounds] == [4, 6, 8, 8]
    measured = [row for row in rounds if "fitted_weight" in row]
    assert len(measured) == 3  # round 1's Δ~ = Δm / M estimates nothing
    for row in measured:
        assert 0.5 <= row["fitted_weight"] <= 1.0
        assert all(math.isfinite(row[key]) and row[key] > 0 for key in ("own_share_error", "fitted_error"))
    printed = capsys.readouterr().out
    assert "Medians: own_share" in printed
    # The table is stored next to the JSON, under the command that reproduces it.
    table = out.with_suffix(".md").read_text()
    assert table.startswith(f"`python -m benchmarks.eager_estimate {' '.join(argv)}`\n\n{method}, 8 steps per worker")
    assert table.split("\n\n", 1)[1].strip() in printed


@pytest.mark.timeout(300)
def test_scores_every_candidate_along_a_blocking_run(tmp_path):
    out = tmp_path / "blocking.json"
    method = "diloco_fp4:inner_steps=2,outer_lr=0.5,outer_momentum=0.5"
    eager_estimate.main(["--token_budget", str(8 * 2 * 8 * 128), "--method", method, "--out", str(out)])
    rounds = json.loads(out.read_text())["workers"][0]["rounds"]
    assert [row["step"] for row in rounds] == [2, 4, 6, 8]  # blocking: each average arrives at its own launch
    for row in rounds[1:]:
        assert set(eager_estimate.BLOCKING_COLUMNS) <= set(row)
        # The oracle fits each parameter on the round itself: no estimate of the same form can do better.
        assert row["oracle_error"] <= min(row["fitted_error"], row["own_error"], row["own_share_error"]) + 1e-6
        assert -1 <= row["workers_cosine"] <= 1


def test_refuses_a_method_it_cannot_instrument():
    for method in ("streaming_fp4", "ddp", "delayed_fp4", "no_such_method"):  # delay, no engine, no estimate, typo
        with pytest.raises(SystemExit):
            eager_estimate.main(["--method", method])
