"""A projection of the outer sync to 1B, 7B and 70B models, from measured per-GB host costs and cited GPU step times.

    python -m benchmarks.projection                                         # 1B / 7B / 70B, 1 and 10 Gbit/s
    python -m benchmarks.projection --validate benchmarks/results/wan_results.json

The model of one fragment's sync (bytes, transfer at the link's efficiency, host CPU from the measured CPU seconds
per GB of each stage, the gather and copies inside a worker, period, window, utilization) is
`hf_diloco.core.settings.projection`'s, which `hf-diloco plan` uses too; its docstring gives it term by term. This command
feeds it `--costs` (a `benchmarks.sync_cost` result, at `--threads`) and the flags below.

Step times are published measurements of 8 (64 for 70B) H100 80GB GPUs in bf16, cited in `STEP_TIMES`; a worker is
that many GPUs, its step that row's batch. The host costs are this machine's (2 shared AMD EPYC cores, no GPU): the
flatten and unflatten copies stand in for the device-host copies, so a real host with more cores and pinned memory
is faster than this projects; the PCIe copies and the gather inside the worker are modelled at nominal rates.

`--validate WAN_JSON` predicts every `diloco` and `streaming` run of a `benchmarks.wan` result file from the same
model (its own measured compute per step, its rate, its H, P, τ and codec) and prints predicted next to measured
utilization.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from benchmarks.common import RESULTS_DIR
from hf_diloco.core.settings.projection import (
    EXCHANGE_STAGES,
    MEASURED_LINK_EFFICIENCY,
    STEP_SOURCE,
    STEP_TIMES,
    host_seconds,
    stage_rates,
    sync_bytes,
    utilization,
)
from hf_diloco.core.settings.projection import inside_worker as _inside_worker

# benchmarks.wan's methods and the settings of their DiLoCoConfig (wan.diloco_config) that the model needs.
WAN_METHODS = {
    "diloco": {"compression": "none", "sync_delay": 0},
    "streaming": {"compression": "fp4", "sync_delay": 1},
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--costs", default=f"{RESULTS_DIR}/sync_cost.json", help="benchmarks.sync_cost output.")
    parser.add_argument("--threads", type=int, default=1, help="Which thread count of --costs.")
    parser.add_argument("--links", type=float, nargs="+", default=[1.0, 10.0], help="Link bandwidths, Gbit/s.")
    parser.add_argument(
        "--link_efficiency",
        type=float,
        default=MEASURED_LINK_EFFICIENCY,
        help=f"Share of the link rate an exchange gets (default: the measured {MEASURED_LINK_EFFICIENCY:g}).",
    )
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument(
        "--parameter_bytes", type=int, default=2, help="Bytes per parameter on the GPUs (2: bf16; 4: fp32 + autocast)."
    )
    parser.add_argument(
        "--intra_node_gbytes", type=float, default=300.0, help="GB/s of a rank's all-gather inside a worker (NVLink)."
    )
    parser.add_argument(
        "--host_copy_gbytes", type=float, default=25.0, help="GB/s of a rank's device-host copies (PCIe)."
    )
    parser.add_argument("--compression", default="fp4")
    parser.add_argument("--exchange_pattern", default="reduce_scatter", choices=sorted(EXCHANGE_STAGES))
    parser.add_argument("--entropy_coding", action="store_true", help="Adds deflate and inflate to the host cost.")
    parser.add_argument(
        "--settings",
        nargs="+",
        default=["1,100,0", "4,100,1", "1,500,0", "4,500,1"],
        help="P,H,tau triples: fragments, inner steps, sync delay in steps (0: blocking).",
    )
    parser.add_argument("--validate", type=Path, metavar="WAN_JSON", help="Predict a benchmarks.wan result file.")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    args = build_parser().parse_args(argv)
    costs = json.loads(Path(args.costs).read_text())
    threads = args.threads
    rates = stage_rates(costs, threads)
    if args.validate:
        rows = validate(json.loads(args.validate.read_text()), rates, args.link_efficiency)
        print_validation(rows)
        return rows
    rows = project(args, rates)
    print_projection(rows, args, threads)
    return rows


# ----------------------------------------------------------------------------------------------- the model


def inside_worker(parameters: float, gpus: int, args: argparse.Namespace) -> tuple[float, float, float]:
    """`hf_diloco.core.settings.projection.inside_worker` at the command's flags."""
    return _inside_worker(parameters, gpus, args.parameter_bytes, args.intra_node_gbytes, args.host_copy_gbytes)


def project(args: argparse.Namespace, rates: dict[str, float]) -> list[dict]:
    rows = []
    for model, (parameters, gpus, batch, throughput) in STEP_TIMES.items():
        step = batch / throughput
        for setting in args.settings:
            fragments, inner_steps, delay = (int(v) for v in setting.split(","))
            # Each of the worker's GPUs' ranks codes and steps its 1/D share of the fragment (data_parallel_per_worker).
            gigabytes = parameters * 4 / 1e9 / fragments / gpus
            main, exchange = host_seconds(
                rates, gigabytes, args.compression, args.exchange_pattern, args.workers, args.entropy_coding
            )
            sent = sync_bytes(parameters / fragments, args.compression, args.exchange_pattern, args.workers)
            intra_bytes, intra, copies = inside_worker(parameters / fragments, gpus, args)
            for link in args.links:
                transfer = sent * 8 / (link * 1e9 * args.link_efficiency)
                period, window = inner_steps / fragments * step, delay * step
                rows.append(
                    {
                        "model": model,
                        "gpus": gpus,
                        "step_seconds": step,
                        "fragments": fragments,
                        "inner_steps": inner_steps,
                        "sync_delay": delay,
                        "link_gbit": link,
                        "bytes_per_sync": sent,
                        "transfer_seconds": transfer,
                        "main_seconds": main,
                        "exchange_seconds": exchange,
                        "intra_worker_bytes": intra_bytes,
                        "intra_worker_seconds": intra,
                        "host_copy_seconds": copies,
                        "period_seconds": period,
                        "window_seconds": window,
                        "utilization": utilization(period, main + intra + copies, exchange, transfer, window),
                    }
                )
    return rows


def validate(wan: dict, rates: dict[str, float], link_efficiency: float = MEASURED_LINK_EFFICIENCY) -> list[dict]:
    """Predicted and measured utilization of every diloco / streaming run of a benchmarks.wan result."""
    settings, rows = wan["settings"], []
    for run in wan["runs"]:
        if run.get("status") != "ok" or run["method"] not in WAN_METHODS:
            continue
        method = WAN_METHODS[run["method"]]
        fragments = 1 if run["method"] == "diloco" else settings["fragments"]
        compression = method["compression"]
        parameters = run["grad_bytes"] / 4 / fragments
        main, exchange = host_seconds(rates, parameters * 4 / 1e9, compression, "reduce_scatter", 2)
        rate = run["rate_mbit"] * 1e6 * link_efficiency
        transfer = sync_bytes(parameters, compression, "reduce_scatter", 2) * 8 / rate
        step = run["compute_seconds_per_step"]
        period = settings["inner_steps"] / fragments * step
        window = method["sync_delay"] * step
        predicted = utilization(period, main, exchange, transfer, window)
        rows.append(
            {
                "method": run["method"],
                "rate_mbit": run["rate_mbit"],
                "step_seconds": step,
                "transfer_seconds": transfer,
                "host_seconds": main + exchange,
                "predicted_stall_seconds": main + max(0.0, exchange + transfer - window),
                # What the loop took beyond its compute, per sync (fragment syncs for streaming).
                "measured_stall_seconds": (run["loop_seconds"] - run["steps_done"] * step) / run["outer_steps"],
                "predicted": predicted,
                "measured": run["utilization"],
            }
        )
    return rows


# ----------------------------------------------------------------------------------------------- output


def print_projection(rows: list[dict], args: argparse.Namespace, threads: int) -> None:
    print(
        f"{args.compression}, {args.exchange_pattern}, M = {args.workers}"
        f"{', entropy coding' if args.entropy_coding else ''}; link efficiency {args.link_efficiency:g}; "
        f"{args.parameter_bytes}-byte parameters, inside a worker {args.intra_node_gbytes:g} GB/s, "
        f"device-host copies {args.host_copy_gbytes:g} GB/s; "
        f"host costs of {args.costs} ({threads} threads); "
        f"step times: {STEP_SOURCE}\n"
    )
    header = (
        "| model (GPUs per worker, step) | P | H | τ | link | bytes per sync | transfer | host CPU (main + exchange) "
        "| inside the worker (gather + copies) | compute window | period | utilization |"
    )
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for r in rows:
        print(
            f"| {r['model']} ({r['gpus']}, {r['step_seconds']:.2f} s) | {r['fragments']} | {r['inner_steps']} | "
            f"{r['sync_delay']} | {r['link_gbit']:g} Gbit/s | {r['bytes_per_sync'] / 1e9:.2f} GB | "
            f"{r['transfer_seconds']:.1f} s | {r['main_seconds']:.1f} + {r['exchange_seconds']:.1f} s | "
            f"{r['intra_worker_bytes'] / 1e9:.2f} GB: {r['intra_worker_seconds']:.2f} + {r['host_copy_seconds']:.2f} s | "
            f"{r['window_seconds']:.1f} s | {r['period_seconds']:.0f} s | {r['utilization']:.3f} |"
        )


def print_validation(rows: list[dict]) -> None:
    print(
        "| method | rate (Mbit/s) | step (s) | transfer per sync (s) | host per sync (s) | stall per sync, predicted "
        "| measured | utilization, predicted | measured | predicted / measured |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(
            f"| {r['method']} | {r['rate_mbit']:g} | {r['step_seconds']:.3f} | {r['transfer_seconds']:.3f} | "
            f"{r['host_seconds']:.4f} | {r['predicted_stall_seconds']:.3f} | {r['measured_stall_seconds']:.3f} | "
            f"{r['predicted']:.3f} | {r['measured']:.3f} | {r['predicted'] / r['measured']:.3f} |"
        )


if __name__ == "__main__":
    main()
