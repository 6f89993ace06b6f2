"""The planner against the slow-link benchmark: `hf-diloco plan`'s projected utilization beside the one measured when
`benchmarks.wan` runs what it planned over the same emulated link.

    python -m benchmarks.plan_check                    # 100 and 10 Mbit/s, about 5 min; needs root (network namespaces)
    python -m benchmarks.plan_check --links 100 10 --out benchmarks/results/plan_check

For each link rate R:
1. the step time: `benchmarks.wan`'s `local` method (the same two workers, no communication) measures the compute of
   one inner step of its model (1.12 M parameters, 2 x 128 tokens per step) on this machine;
2. the plan: `make_plan` (what `hf-diloco plan --model ... --workers 2 --link R --step_seconds S` runs) chooses H, P,
   tau and the codec for two sites joined by R and projects the compute utilization;
3. the run: `benchmarks.wan` trains that plan (`diloco` for blocking DiLoCo, `streaming` for P = 4, tau = 1, with the
   planned codec) over a `tbf` link of rate R for 8 rounds, and measures its utilization (compute time / wall time
   of the loop).

The table shows the plan's projection at the step time it was made with, the projection at the run's own measured
step time (the shared cores' speed moves between runs), and the measured utilization. Writes OUT.json and OUT.md.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
from pathlib import Path

from benchmarks.common import RESULTS_DIR, command_line, write_results
from hf_diloco.cli.plan import count_parameters
from hf_diloco.cli.plan_model import Plan, Sites, make_plan, project_sync
from hf_diloco.core.settings.scaling_rules import Setting

# benchmarks.wan's model and batch (its FULL_PROFILE): a Llama of hidden 128, MLP 512, 4 layers, byte-level vocabulary.
WAN_MODEL = {
    "model_type": "llama",
    "hidden_size": 128,
    "intermediate_size": 512,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 4,
    "max_position_embeddings": 128,
    "tie_word_embeddings": False,
}
WAN_VOCAB, WAN_SEQ_LEN = 256, 128


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--links", type=float, nargs="+", default=[100.0, 10.0], help="link rates in Mbit/s")
    parser.add_argument("--rounds", type=int, default=8, help="rounds per measured run (the first one's start-up weighs "
                        "1/rounds)")  # fmt: skip
    parser.add_argument("--local_steps", type=int, default=200, help="steps of the run that measures the step time")
    parser.add_argument("--out", default=f"{RESULTS_DIR}/plan_check", help="writes OUT.json and OUT.md")
    return parser


def run_wan(work: Path, rate: float, method: str, steps: int, *extra: str) -> dict:
    """One `benchmarks.wan` run of `method` at `rate`; its combined row."""
    out = work / f"{method}_{rate:g}"
    command = [sys.executable, "-m", "benchmarks.wan", "--rates", f"{rate:g}", "--methods", method,
               "--steps", str(steps), "--regime-rate", "none", "--out-dir", str(out), *extra]  # fmt: skip
    subprocess.run(command, check=True, cwd=Path(__file__).resolve().parents[1])
    rows = json.loads((out / "wan_results.json").read_text())["runs"]
    return next(row for row in rows if row["method"] == method)


def wan_method(plan: Plan) -> tuple[str, list[str]]:
    """The `benchmarks.wan` method and flags that train what `plan` chose: blocking DiLoCo is its `diloco`, Streaming
    DiLoCo with tau = 1 its `streaming`, each with the planned codec."""
    sync = plan.sync
    flags = ["--inner-steps", str(sync.inner_steps), "--fragments", str(sync.fragments), "--codec", sync.compression]
    flags += ["--entropy-coding"] if sync.entropy_coding else []
    if sync.fragments == 1 and sync.sync_delay == 0:
        return "diloco", flags
    if sync.sync_delay == 1:
        return "streaming", flags
    raise SystemExit(f"benchmarks.wan has no method for the plan {vars(sync)}")


def check_link(work: Path, rate: float, num_parameters: int, args: argparse.Namespace) -> dict:
    local = run_wan(work, rate, "local", args.local_steps, "--fragments", "1")
    step = Setting(local["compute_seconds_per_step"], "benchmarks.wan local: compute per step on this machine")
    sites = Sites(workers=2, gpus_per_site=1, link_gbit=rate / 1e3, latency_seconds=0.0, speeds=(1.0, 1.0))
    plan = make_plan(num_parameters, sites, WAN_SEQ_LEN, step, "h100", 0.4, None)
    method, flags = wan_method(plan)
    sync = plan.sync
    run = run_wan(work, rate, method, args.rounds * sync.inner_steps, *flags)
    at_run_step = project_sync(num_parameters, sites, run["compute_seconds_per_step"], sync.inner_steps,
                               sync.fragments, sync.sync_delay, sync.compression, sync.entropy_coding)  # fmt: skip
    return {
        "rate_mbit": rate,
        "plan": {
            "inner_steps": sync.inner_steps,
            "num_fragments": sync.fragments,
            "sync_delay": sync.sync_delay,
            "compression": sync.compression,
            "entropy_coding": sync.entropy_coding,
        },  # fmt: skip
        "wan_method": method,
        "planned_step_seconds": step.value,
        "planned_utilization": sync.utilization,
        "planned_transfer_seconds": sync.transfer,
        "run_step_seconds": run["compute_seconds_per_step"],
        "utilization_at_run_step": at_run_step.utilization,
        "measured_utilization": run["utilization"],
        "measured_seconds_per_step": run["seconds_per_step"],
        "run": run,
    }


def markdown(rows: list[dict], command: str) -> str:
    lines = [
        "# The planner against the slow-link benchmark",
        "",
        f"`{command}`",
        "",
        "| link | plan (H, P, tau, codec) | step time: planned / run | utilization: planned | at the run's step time "
        "| measured | measured / projected at the run's step |",
        "|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        plan = row["plan"]
        codec = plan["compression"] + (" + deflate" if plan["entropy_coding"] else "")
        lines.append(
            f"| {row['rate_mbit']:g} Mbit/s | H = {plan['inner_steps']}, P = {plan['num_fragments']}, "
            f"tau = {plan['sync_delay']}, {codec} (`{row['wan_method']}`) "
            f"| {row['planned_step_seconds']:.3f} s / {row['run_step_seconds']:.3f} s "
            f"| {row['planned_utilization']:.3f} | {row['utilization_at_run_step']:.3f} "
            f"| {row['measured_utilization']:.3f} | {row['measured_utilization'] / row['utilization_at_run_step']:.3f} |"
        )
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    num_parameters = count_parameters(WAN_MODEL, WAN_VOCAB)
    with tempfile.TemporaryDirectory() as folder:
        rows = [check_link(Path(folder), rate, num_parameters, args) for rate in args.links]
    command = command_line("plan_check", argv)
    write_results(args.out, {"command": command, "rows": rows}, markdown(rows, command))
    return rows


if __name__ == "__main__":
    main()
