"""`benchmarks.paper_regime`: its quick mode trains DDP and `sign_link` on real files and writes the runs, the table
and the plot; a second start skips the finished runs; the corpus is the text files, each content once."""

import json
import sysconfig
from pathlib import Path

import pytest

from benchmarks import paper_regime

EMAIL = Path(sysconfig.get_paths()["stdlib"]) / "email"  # real Python files, a few hundred kB


@pytest.mark.timeout(180)
def test_quick_mode_writes_runs_table_and_plot_and_resumes(tmp_path, capsys):
    argv = ["--quick", "--corpus", str(EMAIL), "--out", str(tmp_path / "out"), "--work", str(tmp_path / "work")]
    text = paper_regime.main(argv)
    rows = {line.split(" | ")[0].strip("| "): line.split(" | ") for line in text.splitlines() if line.startswith("| ")}
    assert {"ddp", "sign_link"} <= set(rows)
    assert rows["sign_link"][3].startswith("s0 ") and rows["sign_link"][7].endswith("x")  # a gap and a bytes ratio
    for name in ("ddp", "sign_link"):
        record = json.loads((tmp_path / "out" / f"{name}_seed0.json").read_text())
        assert record["result"]["method"] == paper_regime.method_spec(name)
        points = record["result"]["eval_curve"]
        assert points and all(0 < p["eval_loss"] < 20 for p in points)
        assert [p["bytes_sent"] for p in points] == sorted(p["bytes_sent"] for p in points)
        assert record["tokens_per_parameter"] == paper_regime.QUICK["tokens_per_parameter"]
    assert (tmp_path / "out" / "table.md").read_text() == text
    assert (tmp_path / "out" / "paper_regime.png").stat().st_size > 10_000
    capsys.readouterr()
    paper_regime.main(argv)  # everything finished: nothing runs again
    assert "0 of 2 runs to do" in capsys.readouterr().out
    record = json.loads((tmp_path / "out" / "ddp_seed0.json").read_text())
    record["result"]["method"] = "ddp:lr=0.01@2"  # a run of another spec is not this method's: it would run again
    (tmp_path / "out" / "ddp_seed0.json").write_text(json.dumps(record))
    assert not paper_regime.finished(tmp_path / "out", "ddp", 0, paper_regime.method_spec("ddp"))


def test_the_corpus_is_each_text_file_once(tmp_path):
    files = {"a.py": "x = 1\n", "b/c.py": "x = 1\n", "d.md": "# doc\n", "e.bin": "x", "f.txt": ""}
    for name, content in files.items():
        (tmp_path / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / name).write_text(content)
    (tmp_path / "__pycache__").mkdir()
    (tmp_path / "__pycache__" / "g.py").write_text("y = 2\n")
    assert [path.name for path in paper_regime.corpus_files(tmp_path)] == ["a.py", "d.md"]
