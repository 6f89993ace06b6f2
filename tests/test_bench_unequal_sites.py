"""`benchmarks.unequal_sites`: 2 workers, one slowed, `steps` against `balanced` and DDP (a smoke run of `--quick`)."""

import json

import pytest

from benchmarks import unequal_sites


@pytest.mark.timeout(400)
def test_quick_run_compares_the_policies_at_equal_tokens(tmp_path, capsys):
    out = tmp_path / "unequal"
    unequal_sites.main(
        ["--quick", "--slowdowns", "2", "--seeds", "0", "--policies", "steps,balanced,ddp", "--out", str(out)]
    )
    runs = {(run["policy"], run["slowdown"]): run for run in json.loads(out.with_suffix(".json").read_text())["runs"]}
    assert set(runs) == {("steps", 1), ("steps", 2), ("balanced", 2), ("ddp", 2)}
    # Under `steps` the slowdown changes only the time: the same computation, the same loss.
    assert runs["steps", 2]["eval_loss"] == runs["steps", 1]["eval_loss"]
    assert runs["steps", 2]["steps"] == [40, 40]  # 80 steps over both workers, 4 rounds of H = 10
    assert runs["ddp", 2]["steps"] == [40, 40] and runs["ddp", 2]["eval_loss"] < runs["steps", 1]["eval_loss"] + 1
    # DDP waits for the slowed worker at every step: more of its time than under `steps`, which waits once a round.
    assert runs["ddp", 2]["fast_wait_fraction"] > 0.3
    fast, slow = runs["balanced", 2]["steps"]
    assert slow < fast and fast + slow >= 80  # the slowed worker ran fewer steps; the job the same tokens or more
    table = out.with_suffix(".md").read_text()
    assert table.startswith("`python -m benchmarks.unequal_sites --quick")
    assert (
        "| 1/2 | balanced |" in table
        and "| 1/2 | ddp |" in table
        and table.split("\n\n", 1)[1].strip() in capsys.readouterr().out
    )
