"""`benchmarks.seed_table`: per-seed gaps, deterministic reruns counted once, two settings of one method."""

import json
from pathlib import Path

import pytest

from benchmarks import seed_table

STRIDED, BALANCED = "streaming_fp4:outer_lr=0.8@2", "streaming_fp4:outer_lr=0.8,fragment_pattern=balanced@2"


def _run(path: Path, seed: int, losses: dict[str, float]) -> Path:
    results = [{"method": method, "workers": 2, "eval_loss": loss} for method, loss in losses.items()]
    path.write_text(json.dumps({"command": f"python -m benchmarks.quality --seed {seed}", "results": results}))
    return path


def test_gaps_per_seed_with_reruns_and_pairs(tmp_path, capsys):
    files = [
        _run(tmp_path / "a0.json", 0, {"ddp@2": 4.0, STRIDED: 4.2}),
        _run(tmp_path / "b0.json", 0, {STRIDED: 4.2, BALANCED: 4.41}),  # the strided run repeated: same loss
        _run(tmp_path / "a1.json", 1, {"ddp@2": 5.0, STRIDED: 4.9, BALANCED: 4.9}),
    ]
    seed_table.main([*map(str, files), "--pair", BALANCED, STRIDED])
    rows = {line.split(" | ")[0].lstrip("| "): line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]}
    assert rows[STRIDED][1:4] == ["ddp@2", "+5.00%", "-2.00%"]
    assert rows[BALANCED][1:4] == [STRIDED, "+5.00%", "+0.00%"]
    assert rows[BALANCED][4] == "**+2.50%**"


def test_one_method_against_two_references_gets_a_row_for_each(tmp_path, capsys):
    files = [_run(tmp_path / "a0.json", 0, {"ddp@2": 4.0, STRIDED: 4.2, BALANCED: 4.41})]
    seed_table.main([*map(str, files), "--pair", BALANCED, STRIDED, "--pair", BALANCED, "ddp@2"])
    rows = [line.split(" | ")[:3] for line in capsys.readouterr().out.splitlines()[2:]]
    assert ["| " + BALANCED, STRIDED, "+5.00%"] in rows
    assert ["| " + BALANCED, "ddp@2", "+10.25%"] in rows
    assert ["| " + STRIDED, "ddp@2", "+5.00%"] in rows


def test_a_method_repeated_with_another_loss_is_refused(tmp_path):
    files = [_run(tmp_path / "a.json", 0, {"ddp@2": 4.0}), _run(tmp_path / "b.json", 0, {"ddp@2": 4.1})]
    with pytest.raises(SystemExit):
        seed_table.main(list(map(str, files)))


def test_losses_table_lists_each_setting_per_seed_and_its_mean(tmp_path, capsys):
    files = [
        _run(tmp_path / "a0.json", 0, {"ddp:lr=0.002@2": 4.0, "ddp:lr=0.003@2": 4.5}),
        _run(tmp_path / "a1.json", 1, {"ddp:lr=0.002@2": 5.0}),
    ]
    seed_table.main([*map(str, files), "--losses"])
    rows = [line.split(" | ") for line in capsys.readouterr().out.splitlines()[2:]]
    assert rows[0] == ["| ddp:lr=0.002@2", "4.0000", "5.0000", "**4.5000** |"]
    assert rows[1] == ["| ddp:lr=0.003@2", "4.5000", "", "**4.5000** |"]
