"""The named figures that README.md and the documentation site quote, each computed from the stored results.

    python -m benchmarks.figures            # writes docs/figures.json from benchmarks/results
    python -m benchmarks.figures --check    # exit status 1 when docs/figures.json is not what the results give

A page of the site quotes a figure as `{{ name }}` (docs/hooks.py puts its text there at build time); README.md, which
GitHub shows as written, quotes the same text. tests/test_figures.py fails when docs/figures.json is stale, and when
README or a page quotes a figure (a number with %, x, a time or a size) that is neither a named figure nor in the
stored results. After new results land: rerun this module, and the pages follow.
"""

from __future__ import annotations

import argparse
import glob
import json
import statistics
import sys
from collections.abc import Callable
from dataclasses import dataclass
from functools import cache
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
OUT = ROOT / "docs" / "figures.json"


@dataclass(frozen=True)
class Figure:
    source: str  # the stored files it is computed from, relative to benchmarks/results
    text: Callable[[], str]


@cache
def load(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


def paths(pattern: str) -> list[str]:
    found = sorted(str(Path(path).relative_to(RESULTS)) for path in glob.glob(str(RESULTS / pattern)))
    if not found:
        raise FileNotFoundError(f"no stored result matches benchmarks/results/{pattern}")
    return found


def on_seeds(found: dict, seeds: range, what: str) -> list:
    """`found`'s values for `seeds`, in order; an error naming `what` and the seeds it lacks."""
    missing = [seed for seed in seeds if seed not in found]
    if missing:
        raise ValueError(f"{what} on seeds {missing}")
    return [found[seed] for seed in seeds]


# The shipped configs on the seeds no choice was made on (benchmarks/results/seeds: `benchmarks.flagship` runs, DDP and
# the config side by side; `select_seed*` chose sign_link's outer lr on seeds 0-4).
CONFIRMING_SEEDS = range(10, 20)
SELECTION_SEEDS = range(5)
REFERENCE_SPECS = {"diloco_h30": "diloco:inner_steps=30,outer_lr=1.0,outer_momentum=0.0@2"}


def seeds_gaps(name: str, seeds: range = CONFIRMING_SEEDS) -> list[tuple[float, float]]:
    """(loss gap, x fewer bytes) against DDP of the same seed: a shipped config's `diloco:` section or a reference."""
    from benchmarks import flagship

    spec = REFERENCE_SPECS.get(name) or flagship.config_method(name)
    found: dict[int, tuple[float, float]] = {}
    for method, per_seed in flagship.gaps_by_method([load(path) for path in paths("seeds/*.json")]).items():
        if flagship.settings_of(method) == flagship.settings_of(spec):  # the settings in any order
            found.update(per_seed)
    return on_seeds(found, seeds, f"benchmarks/results/seeds/ has no run of {spec}")


def seeds_gap(name: str, seeds: range = CONFIRMING_SEEDS) -> str:
    """`+1.23% ± 0.45` over the seeds."""
    from benchmarks.over_seeds import mean_gap_cell

    return mean_gap_cell([gap for gap, _ in seeds_gaps(name, seeds)]).strip("*")


def seeds_above(name: str, limit: int, seeds: range = CONFIRMING_SEEDS) -> str:
    """`3 of 10`: the seeds whose gap is above `limit` percent."""
    from benchmarks.over_seeds import above_cells

    return above_cells([gap for gap, _ in seeds_gaps(name, seeds)], (limit,))[0]


def seeds_fewer_bytes(name: str, seeds: range = CONFIRMING_SEEDS) -> str:
    from benchmarks.over_seeds import fewer_cell

    return fewer_cell([ratio for _, ratio in seeds_gaps(name, seeds)])


# The 20-tokens-per-parameter regime (benchmarks.paper_regime): no setting was chosen on its seeds.
REGIME_SEEDS = range(5)


def regime_gaps(method: str, seeds: range = REGIME_SEEDS) -> list[float]:
    """The gaps to DDP of the same seed at 20 tokens per parameter, as fractions."""
    from benchmarks import paper_regime

    found = paper_regime.gaps_to_ddp(paper_regime.load_runs(RESULTS / "paper_regime"), method)
    return on_seeds(found, seeds, f"benchmarks/results/paper_regime/ has no {method} run (or no DDP run)")


def regime_gap(method: str) -> str:
    """`+1.23% ± 0.45` over the regime's seeds."""
    from benchmarks.over_seeds import mean_gap_cell

    return mean_gap_cell(regime_gaps(method)).strip("*")


# Targets rerun on the confirming seeds with the seed setting the data (benchmarks/results/confirm: benchmarks.quality
# runs, one file per seed; the pairs of BENCHMARKS.md's "Overlap" section and of M = 1 against AdamW).
EAGER_BLOCKING = "diloco_fp4:inner_steps=25,outer_lr=0.5,outer_momentum=0.5@2"
EAGER = {
    "own_share": "eager_fp4:inner_steps=25,outer_lr=1.0,outer_momentum=0.0@2",
    "fitted": "eager_fp4:inner_steps=25,outer_lr=1.0,outer_momentum=0.0,eager_estimate=fitted@2",
}


def confirm_gap(pattern: str, method: str, reference: str) -> str:
    """`+1.23% ± 0.45`: `method` against `reference` over the confirming seeds (each must have run both)."""
    from benchmarks import seed_table
    from benchmarks.over_seeds import mean_gap_cell

    runs = seed_table.load_runs([RESULTS / path for path in paths(pattern)])
    per_seed = seed_table.gaps_by_pair(runs, [(method, reference)]).get((method, reference), {})
    what = f"benchmarks/results/{pattern} has no {method} against {reference}"
    return mean_gap_cell(on_seeds(per_seed, CONFIRMING_SEEDS, what)).strip("*")


def comm_fewer_bytes(name: str, method: str) -> str:
    results = {result["method"]: result for result in load(name)["results"]}
    return f"{results['ddp']['bytes_per_token'] / results[method]['bytes_per_token']:.0f}x"


def wan_run(name: str, method: str, rate: float) -> dict:
    [run] = [run for run in load(name)["runs"] if run["method"] == method and run["rate_mbit"] == rate]
    return run


def scale_ratio(config: str) -> str:
    return f"{load('scale.json')['configs'][config]['peak_rss_vs_unsharded']:.2f}x"


def peers_sync_vs_torchft() -> str:
    rows = load("peers.json")["rows"]
    per_gb = {(row["implementation"], row["size"]): row["sync_cpu_s_per_gb"] for row in rows}
    ratios = [per_gb["hf_diloco", size] / per_gb["torchft", size] for _, size in per_gb if _ == "hf_diloco"]
    return f"{min(ratios):.2f}-{max(ratios):.2f}x"


def fast_site_wait(name: str, policy: str, slowdown: float) -> float:
    runs = load(name)["runs"]
    return statistics.fmean(
        run["fast_wait_fraction"] for run in runs if run["policy"] == policy and run["slowdown"] == slowdown
    )


def outage(name: str, *keys: str) -> float:
    value = load(f"elastic_outage/{name}")
    for key in keys:
        value = value[key]
    return value


def make_time(target: str, condition: str) -> dict:
    """The stored timing of a make target under a condition (benchmarks/results/make_times.json)."""
    [run] = [
        run for run in load("make_times.json")["runs"] if run["target"] == target and run["condition"] == condition
    ]
    return run


def duration(seconds: float) -> str:
    """`45 s`, `12 min 5 s`: how a person reads a duration on a clock."""
    seconds = round(seconds)
    return f"{seconds} s" if seconds < 60 else f"{seconds // 60} min {seconds % 60} s"


PLAN_EXAMPLE = ["--params", "1e9", "--workers", "4", "--gpus_per_site", "8", "--link", "1gbit"]


@cache
def plan_example() -> dict:
    """`hf-diloco plan` of the documentation's example (a projection from the stored host-CPU and link measurements)."""
    import contextlib
    import io
    import tempfile

    from hf_diloco.cli import plan

    with tempfile.TemporaryDirectory() as folder, contextlib.redirect_stdout(io.StringIO()) as printed:
        plan.main([*PLAN_EXAMPLE, "--json", "--out", f"{folder}/plan.yaml"])
    return json.loads(printed.getvalue())


def plan_option(inner_steps: int) -> dict:
    [option] = [
        option
        for option in plan_example()["tried"]
        if option["inner_steps"] == inner_steps
        and option["fragments"] == 1
        and option["compression"] == "fp4"
        and not option["entropy_coding"]
    ]
    return option


def plan_check_ratios() -> list[float]:
    """Measured utilization over the projection at the run's own step time, per plan (plan_check.md's last column)."""
    return [row["measured_utilization"] / row["utilization_at_run_step"] for row in load("plan_check.json")["rows"]]


FIGURES: dict[str, Figure] = {
    # Bytes and loss against fp32 DDP, 7.5 tokens per parameter (BENCHMARKS.md, "Loss parity").
    # The confirming seeds 10-19 (no setting was chosen on them) and sign_link's selection seeds 0-4.
    "sign_link_fewer_bytes": Figure("seeds/*.json", lambda: seeds_fewer_bytes("sign_link")),
    "slow_link_fewer_bytes": Figure("seeds/*.json", lambda: seeds_fewer_bytes("slow_link")),
    "sign_link_gap_confirm": Figure("seeds/*.json", lambda: seeds_gap("sign_link")),
    "sign_link_above_2_confirm": Figure("seeds/*.json", lambda: seeds_above("sign_link", 2)),
    "sign_link_gap_select": Figure("seeds/select_seed*.json", lambda: seeds_gap("sign_link", SELECTION_SEEDS)),
    "slow_link_gap_confirm": Figure("seeds/*.json", lambda: seeds_gap("slow_link")),
    "slow_link_above_2_confirm": Figure("seeds/*.json", lambda: seeds_above("slow_link", 2)),
    "diloco_h30_gap_confirm": Figure("seeds/*.json", lambda: seeds_gap("diloco_h30")),
    "tiny_diloco_gap_confirm": Figure("seeds/*.json", lambda: seeds_gap("tiny_diloco")),
    "streaming_diloco_gap_confirm": Figure("seeds/*.json", lambda: seeds_gap("streaming_diloco")),
    "streaming_diloco_fewer_bytes": Figure("seeds/*.json", lambda: seeds_fewer_bytes("streaming_diloco")),
    "regime_diloco_gap": Figure("paper_regime/*_seed*.json", lambda: regime_gap("diloco")),
    "regime_slow_link_gap": Figure("paper_regime/*_seed*.json", lambda: regime_gap("slow_link")),
    "regime_sign_link_gap": Figure("paper_regime/*_seed*.json", lambda: regime_gap("sign_link")),
    "eager_fitted_gap_confirm": Figure(
        "confirm/h25_seed*.json", lambda: confirm_gap("confirm/h25_seed*.json", EAGER["fitted"], EAGER_BLOCKING)
    ),
    "eager_own_share_gap_confirm": Figure(
        "confirm/h25_seed*.json", lambda: confirm_gap("confirm/h25_seed*.json", EAGER["own_share"], EAGER_BLOCKING)
    ),
    "m1_vs_adamw_gap_confirm": Figure(
        "confirm/m1_seed*.json",
        lambda: confirm_gap("confirm/m1_seed*.json", "diloco_h50:outer_lr=0.5,outer_momentum=0.5@1", "ddp@1"),
    ),
    "streaming_fp4_fewer_bytes": Figure(
        "comm_targets.json", lambda: comm_fewer_bytes("comm_targets.json", "streaming_fp4")
    ),
    # Speed over an emulated 2.2 Mbit/s link (BENCHMARKS.md, "Speed on slow links").
    "diloco_x_utilization_2_2mbit": Figure(
        "wan_regime_2.2/wan_results.json",
        lambda: f"{100 * wan_run('wan_regime_2.2/wan_results.json', 'diloco_x', 2.2)['utilization']:.0f}%",
    ),
    "diloco_x_speedup_2_2mbit": Figure(
        "wan_regime_2.2/wan_results.json",
        lambda: f"{load('wan_regime_2.2/wan_results.json')['summary']['regime']['speedup_vs_ddp']['diloco_x']:.0f}x",
    ),
    # Host memory and CPU (BENCHMARKS.md, "Memory" and "Overhead").
    "fsdp_peak_rss_ratio": Figure("scale.json", lambda: scale_ratio("D=2 FSDP")),
    "pipeline_peak_rss_ratio": Figure("scale.json", lambda: scale_ratio("S=2 pipeline")),
    "sync_cpu_vs_torchft": Figure("peers.json", peers_sync_vs_torchft),
    "trainer_cpu_ratio": Figure("overhead.json", lambda: f"{load('overhead.json')['ratio_cpu']:.3f}x"),
    # One site at half speed (BENCHMARKS.md, "Unequal sites").
    # `balanced` on the confirming seeds; `steps` with a slowed worker on the fixed order's seeds 0-4 (its wait is
    # 1 - 1/k whatever the data).
    "balanced_fast_site_wait": Figure(
        "confirm/unequal_sites.json",
        lambda: f"{100 * fast_site_wait('confirm/unequal_sites.json', 'balanced', 2.0):.1f}%",
    ),
    "steps_fast_site_wait": Figure(
        "unequal_sites.json", lambda: f"{100 * fast_site_wait('unequal_sites.json', 'steps', 2.0):.0f}%"
    ),
    # A site lost and restarted (BENCHMARKS.md, "Elastic workers: an outage").
    "elastic_back_to_training": Figure(
        "elastic_outage/outage.json", lambda: f"{outage('outage.json', 'elastic', 'lost_seconds_at_kill'):.1f} s"
    ),
    "elastic_sites_back_to_training": Figure(
        "elastic_outage/outage_sites.json",
        lambda: f"{outage('outage_sites.json', 'elastic', 'lost_seconds_at_kill'):.1f} s",
    ),
    "elastic_sites_utilization": Figure(
        "elastic_outage/outage_sites.json",
        lambda: f"{100 * outage('outage_sites.json', 'elastic', 'healthy_utilization'):.0f}%",
    ),
    "fixed_sites_utilization": Figure(
        "elastic_outage/outage_sites.json",
        lambda: f"{100 * outage('outage_sites.json', 'restart', 'healthy_utilization'):.0f}%",
    ),
    # The planner: its example's projection (docs, "Plan a run") and two plans run over emulated links.
    "plan_example_gb_per_sync": Figure(
        "hf-diloco plan " + " ".join(PLAN_EXAMPLE), lambda: f"{plan_example()['sync']['bytes_per_sync'] / 1e9:.2f} GB"
    ),
    "plan_example_utilization": Figure(
        "hf-diloco plan " + " ".join(PLAN_EXAMPLE), lambda: f"{100 * plan_example()['sync']['utilization']:.1f}%"
    ),
    "plan_example_hours": Figure(
        "hf-diloco plan " + " ".join(PLAN_EXAMPLE), lambda: f"{plan_example()['wall_seconds'] / 3600:.1f} h"
    ),
    "plan_example_h200_utilization": Figure(
        "hf-diloco plan " + " ".join(PLAN_EXAMPLE), lambda: f"{100 * plan_option(200)['utilization']:.1f}%"
    ),
    "plan_check_ratios": Figure(
        "plan_check.json", lambda: " and ".join(f"{ratio:.3f}x" for ratio in plan_check_ratios())
    ),
    # The two commands of the README (benchmarks/results/make_times.json).
    "make_run_quiet": Figure("make_times.json", lambda: duration(make_time("make run", "quiet")["seconds"])),
    "make_run_loaded": Figure("make_times.json", lambda: duration(make_time("make run", "loaded")["seconds"])),
    "make_run_loaded_load": Figure(
        "make_times.json", lambda: f"{make_time('make run', 'loaded')['load_average']:.1f}"
    ),
    "make_test_quiet": Figure("make_times.json", lambda: duration(make_time("make test", "quiet")["seconds"])),
    "make_test_tests": Figure("make_times.json", lambda: f"{make_time('make test', 'quiet')['tests']}"),
    "make_test_fast_quiet": Figure(
        "make_times.json", lambda: duration(make_time("make test-fast", "quiet")["seconds"])
    ),
    "make_test_fast_tests": Figure("make_times.json", lambda: f"{make_time('make test-fast', 'quiet')['tests']}"),
    "make_test_fast_loaded": Figure(
        "make_times.json", lambda: duration(make_time("make test-fast", "loaded")["seconds"])
    ),
}


def compute() -> dict[str, dict[str, str]]:
    return {name: {"text": figure.text(), "source": source_of(figure)} for name, figure in FIGURES.items()}


def source_of(figure: Figure) -> str:
    return figure.source if figure.source.startswith("hf-diloco ") else f"benchmarks/results/{figure.source}"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--check", action="store_true", help="only compare docs/figures.json with the results")
    args = parser.parse_args(argv)
    text = json.dumps(compute(), indent=2, ensure_ascii=False) + "\n"
    if args.check:
        if OUT.read_text() != text:
            print(f"{OUT.relative_to(ROOT)} is stale: run python -m benchmarks.figures", file=sys.stderr)
            return 1
        return 0
    OUT.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
