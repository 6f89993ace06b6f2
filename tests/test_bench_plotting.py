"""Benchmarks write their results before any plot, and skip the plot when matplotlib cannot be imported."""

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

# Runs in a fresh interpreter so that making matplotlib unimportable cannot leak into other tests.
WAN_REPORT = """
import sys
sys.modules["matplotlib"] = None  # `import matplotlib` now raises ImportError, as when it is not installed
from pathlib import Path
from benchmarks import wan
report = {"settings": {"steps": 4}, "runs": [], "summary": wan.summarize([], {"regime_ratio": 10.0})}
wan.write_report(Path(sys.argv[1]), report)
"""


def test_wan_report_is_written_without_matplotlib(tmp_path):
    done = subprocess.run(
        [sys.executable, "-c", WAN_REPORT, str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    assert json.loads((tmp_path / "wan_results.json").read_text())["runs"] == []
    assert "Lowest swept rate" in (tmp_path / "wan_results.md").read_text()
    assert not (tmp_path / "wan_utilization.png").exists()
    assert "matplotlib is not installed: no " in done.stdout
