"""`benchmarks.quality` without `--methods` runs what the stored loss-parity tables ran (their methods and settings,
read from the stored files), and refuses a preset together with a method list."""

import json
import re
from pathlib import Path

import pytest

from benchmarks import quality

RESULTS = Path(__file__).resolve().parents[1] / "benchmarks" / "results"
# Flags of a stored command, whose `--model` JSON was written unquoted: `--flag {...}` or `--flag value ...`.
FLAG = re.compile(r"--(\w+) (\{[^}]*\}|(?:[^-\s]\S*\s?)+)")


def _flags(command: str) -> dict[str, str]:
    return {name: value.strip() for name, value in FLAG.findall(command)}


@pytest.mark.parametrize(("argv", "stored"), [([], "quality"), (["--long"], "quality_long")])
def test_default_methods_and_settings_are_the_stored_tables(argv, stored):
    run = json.loads((RESULTS / f"{stored}.json").read_text())
    expected = _flags(run["command"])
    assert expected["methods"].split() == [result["method"] for result in run["results"]]
    actual = _flags(" ".join(quality.comm_arguments(argv)))
    assert actual.pop("out") == f"benchmarks/results/{stored}"
    expected.pop("out")
    assert actual == expected


def test_methods_replace_the_preset_and_both_together_are_refused(capsys):
    arguments = quality.comm_arguments(["--methods", "ddp@2", "--seed", "3"])
    assert arguments[: arguments.index("--token_budget")] == ["--methods", "ddp@2", "--seed", "3"]
    with pytest.raises(SystemExit):
        quality.comm_arguments(["--preset", "parity", "--methods", "ddp@2"])
    assert "either --preset or --methods" in capsys.readouterr().err
