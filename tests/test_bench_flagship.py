"""`benchmarks.flagship`: the per-seed table counts the close() tail in the bytes, and the shipped config's spec."""

import json

import pytest

from benchmarks import flagship

CANDIDATE = "diloco:inner_steps=120@2"


def _run(seed: int, ddp_loss: float, loss: float, tail: int) -> dict:
    ddp = {"method": "ddp@2", "eval_loss": ddp_loss, "bytes_sent": 900_000, "final_sync_bytes": 0}
    method = {"method": CANDIDATE, "eval_loss": loss, "bytes_sent": 700, "final_sync_bytes": tail}
    results = [{**r, "tokens_per_worker": 1000} for r in (ddp, method)]
    return {
        "command": f"python -m benchmarks.quality --long --seed {seed} --methods ddp@2 {CANDIDATE}",
        "results": results,
    }


def test_table_counts_the_tail_and_gives_mean_and_standard_error(tmp_path, capsys):
    paths = []
    for seed, loss, tail in ((2, 4.04, 200), (3, 3.96, 200), (4, 4.02, 0)):
        paths.append(tmp_path / f"seed{seed}.json")
        paths[-1].write_text(json.dumps(_run(seed, 4.0, loss, tail)))
    lines = flagship.main(["--table", *map(str, paths)])
    row = lines[2].split(" | ")
    assert row[1:4] == ["+1.00%", "-1.00%", "+0.50%"]
    # gaps +1, -1, +0.5 %: mean +0.17, sample standard deviation 1.04, / sqrt(3) = 0.60
    assert row[4] == "**+0.17% ± 0.60**"
    assert row[5:7] == ["0 of 3", "0 of 3"]  # no gap above +1% (+1.00% is not above it)
    assert row[7] == "1000-1286x |"  # 900,000 / (700 + 200) and 900,000 / 700
    assert flagship.main(["--table", *map(str, paths), "--seeds", "2"])[2].split(" | ")[2] == "**+1.00%**"
    assert capsys.readouterr().out


def test_table_borrows_ddp_of_the_same_seed_and_refuses_ddp_runs_that_disagree(tmp_path):
    with_ddp, without = _run(2, 4.0, 4.04, 0), _run(2, 4.0, 4.08, 0)
    without["results"] = [{**without["results"][1], "method": "diloco:inner_steps=60@2"}]
    paths = [tmp_path / "a.json", tmp_path / "b.json"]
    for path, run in zip(paths, (with_ddp, without)):
        path.write_text(json.dumps(run))
    lines = flagship.main(["--table", *map(str, paths)])
    assert [line.split(" | ")[1] for line in lines[2:]] == ["+1.00%", "+2.00%"]
    paths[1].write_text(json.dumps(_run(2, 4.1, 4.08, 0)))
    with pytest.raises(ValueError, match="two ddp@2 runs of seed 2 disagree"):
        flagship.main(["--table", *map(str, paths)])
    paths[1].write_text(json.dumps({**without, "command": without["command"].replace("--seed 2", "--seed 3")}))
    with pytest.raises(ValueError, match="no ddp@2 run of seed 3"):
        flagship.main(["--table", *map(str, paths)])


@pytest.mark.parametrize(
    "name, expected",
    [
        ("slow_link", {"compression": "fp4", "entropy_coding": "true", "inner_steps": "120"}),
        ("sign_link", {"compression": "sign", "error_feedback": "true", "outer_lr": "2.0", "inner_steps": "120"}),
    ],
)
def test_shipped_config_becomes_a_diloco_spec_of_two_workers(name, expected):
    spec = flagship.config_method(name)
    assert spec.startswith("diloco:") and spec.endswith("@2")
    settings = dict(item.split("=") for item in spec[len("diloco:") : -len("@2")].split(","))
    assert expected.items() <= settings.items()
