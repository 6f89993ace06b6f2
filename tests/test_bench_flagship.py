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


def test_train_curve_counts_the_bytes_of_the_syncs_done_by_each_logged_step():
    result = {
        "steps": 240,
        "syncs": 2,  # every 120 steps
        "bytes_sent": 200,
        "final_sync_bytes": 7,
        "tokens_per_worker": 2400,
        "workers": 2,
        "train_curve": [[100, 5.0], [120, 4.0], [240, 3.0]],
    }
    curve = flagship.train_curve(result)
    assert [point[0] for point in curve] == [2000, 2400, 4800]  # 10 tokens per step per worker, 2 workers
    assert [point[1] for point in curve] == [0, 100, 207]  # no sync yet, one of two, both and close()'s tail
    assert [point[2] for point in curve] == [5.0, 4.0, 3.0]  # three points: a running mean of one


def test_plot_names_shipped_configs_and_tells_other_settings_apart(tmp_path):
    sign = flagship.config_method("sign_link")
    reordered = "diloco:" + ",".join(reversed(sign[len("diloco:") : -len("@2")].split(","))) + "@2"
    labels = flagship.short_labels([reordered, "diloco:inner_steps=60@2", "diloco:inner_steps=30@2", "ddp@2"])
    assert labels == {
        reordered: "sign_link",  # the config's settings in another order are still the config
        "diloco:inner_steps=60@2": "diloco@2 (a)",
        "diloco:inner_steps=30@2": "diloco@2 (b)",
        "ddp@2": "ddp@2",
    }
    runs = []
    for seed, loss in ((2, 4.04), (3, 3.96)):
        run = _run(seed, 4.0, loss, 0)
        for result in run["results"]:
            result.update(steps=20, syncs=20 if result["method"] == "ddp@2" else 2, workers=2)
            result["train_curve"] = [[10, 6.0], [20, loss]]
        runs.append(run)
    assert flagship.plot(runs, tmp_path / "seeds.png")
    assert (tmp_path / "seeds.png").stat().st_size > 10_000
