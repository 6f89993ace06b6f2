"""`benchmarks.paper_regime`: its quick mode trains DDP and `sign_link` on real files and writes the runs, the table
and the plot; a second start skips the finished runs; the corpus is the text files, each content once."""

import json
import math
import sysconfig
from pathlib import Path

import pytest
import torch

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


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: torch.cuda.is_available() is False here")
@pytest.mark.timeout(900)
def test_the_125m_size_trains_ddp_and_sign_link_on_one_gpu(tmp_path):
    """The GPU lane's check of `--size 125m --device cuda`, cut to 0.07 tokens per parameter: ~8.7 M tokens, 133
    steps per worker, so `sign_link` (H = 120) syncs once. On paper it is the full run's code path: the same model,
    tokenizer size, blocks and batch; both workers on the one GPU under bf16 autocast, gloo between them, θg on the
    host. The full run (20 tokens per parameter, 37,926 steps per worker) is 6 x 124 M x 2.49 B = 1.9e18 FLOPs: about
    2 hours per method and seed on one H100 at 250 TFLOP/s, 40 GPU-hours for 4 methods x 5 seeds (BENCHMARKS.md)."""
    out = tmp_path / "out"
    argv = ["--size", "125m", "--device", "cuda", "--tokens_per_parameter", "0.07", "--max_files", "5000"]
    argv += ["--methods", "ddp", "sign_link", "--seeds", "0", "--out", str(out), "--work", str(tmp_path / "work")]
    paper_regime.main(argv)
    ddp, sign = (json.loads((out / f"{name}_seed0.json").read_text()) for name in ("ddp", "sign_link"))
    assert ddp["parameters"] > 120_000_000 and ddp["size"] == "125m"
    assert sign["result"]["syncs"] >= 1 and 0 < sign["result"]["bytes_sent"] < ddp["result"]["bytes_sent"] / 100
    assert all(math.isfinite(record["result"]["eval_loss"]) for record in (ddp, sign))
