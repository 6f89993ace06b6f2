"""Bytes on the wire and loss: DDP vs DiLoCo vs Streaming DiLoCo on the same model and tokens (2 gloo workers).

    python -m benchmarks.comm --steps 600 --methods ddp diloco streaming_fp4

Every method trains the default small Llama with AdamW on the same stdlib token blocks in the same order, each worker
on its own shard, for the same number of steps (the training run of `benchmarks.common`; `--seed` sets the init, the
held-out files, the order and the shards). Bytes are counted the same way for every method: what one rank hands to
the network for cross-worker communication, with the collective's wire volume (ring all-reduce: 2 (M-1)/M x payload;
DiLoCo's all_to_all + all_gather: 2 (M-1) x chunk). DDP's bytes are counted by a DDP communication hook around its
real all-reduce; DiLoCo's by the engine. Eval loss is on held-out stdlib files, with the global parameters for
DiLoCo. Bytes per token are the training loop's (steady state); the once-per-run tail syncs of `close()` (fragments
trained since their last launch) are a separate column. Peak bytes per sync is the largest single exchange. Results
go to a JSON file and a markdown table, and a PNG of loss vs tokens.
"""

from __future__ import annotations

import argparse
import json
import tempfile
from pathlib import Path

from benchmarks.common import (
    METHODS,
    RESULTS_DIR,
    add_run_arguments,
    command_line,
    parse_method,
    prepare_data,
    run_on_workers,
    run_overrides,
    steps_for_budget,
    train_worker,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["ddp", "diloco", "streaming_fp4"],
        help=f"Methods from {sorted(METHODS)}, each optionally `:key=value,...` (DiLoCoConfig overrides, `lr` for "
        "this method's inner learning rate instead of --lr, `inner=muon` for Muon inside, `ddp_steps` for a DDP warm "
        "start) and `@M` (its number of workers, default --workers).",
    )
    add_run_arguments(parser)
    parser.add_argument("--out", default=f"{RESULTS_DIR}/comm", help="Writes OUT.json, OUT.md and OUT.png.")
    return parser


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        parsed = {spec: parse_method(spec) for spec in args.methods}  # every spec checked before any run starts
    except (ValueError, TypeError) as error:
        parser.error(str(error))
    results = []
    with tempfile.TemporaryDirectory() as folder:
        data = prepare_data(Path(folder), args.block_size, args.train_files, args.vocab_size, args.seed)
        print(f"training split: {len(data['train']) * args.block_size:,} tokens", flush=True)
        for spec in args.methods:
            method, _, workers = parsed[spec]
            run_args = argparse.Namespace(**vars(args))
            run_args.workers = workers or args.workers
            if args.token_budget:
                run_args.steps = steps_for_budget(args, run_args.workers)
            vars(run_args).update(run_overrides(spec))
            print(f"running {spec} ({run_args.workers} workers, {run_args.steps} steps) ...", flush=True)
            outcome = run_on_workers(train_worker, run_args.workers, spec.partition("@")[0], run_args, folder)
            result = outcome[0]
            result["method"] = spec
            result["workers"] = run_args.workers
            result["steps"] = run_args.steps
            result["bytes_sent_all_ranks"] = [r["bytes_sent"] for r in outcome]
            results.append(result)
            write_report(results, args, argv)  # after every method, so a long sweep leaves partial results
            print(
                f"{method}: eval loss {result['eval_loss']:.4f}, {result['bytes_per_token']:.2f} B/token, "
                f"peak {result['peak_bytes_per_sync']} B/sync, {result['seconds']:.0f} s",
                flush=True,
            )
    return results


def write_report(results: list[dict], args: argparse.Namespace, argv: list[str] | None) -> None:
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    command = command_line("comm", argv)
    baseline = next((r for r in results if r["method"].split("@")[0] == "ddp" and r.get("workers", 2) > 1), None)
    lines = [
        f"`{command}` "
        + (
            f"({args.token_budget} tokens per method in total; {args.batch_size} x {args.block_size} tokens per step)"
            if args.token_budget
            else f"({args.workers} workers, {args.steps} steps x {args.batch_size} x {args.block_size} tokens each)"
        ),
        "",
        "| method | workers | steps | bytes/token/worker | x fewer than DDP | peak bytes per sync | final tail sync bytes "
        "| eval loss | vs DDP loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        fewer = (
            f"{baseline['bytes_per_token'] / r['bytes_per_token']:.0f}x" if baseline and r["bytes_per_token"] else "-"
        )
        loss_gap = f"{100 * (r['eval_loss'] / baseline['eval_loss'] - 1):+.2f}%" if baseline else "-"
        lines.append(
            f"| {r['method']} | {r.get('workers', args.workers)} | {r.get('steps', args.steps)} | "
            f"{r['bytes_per_token']:.2f} | {fewer} | {r['peak_bytes_per_sync']:,} | {r.get('final_sync_bytes', 0):,} | "
            f"{r['eval_loss']:.4f} | {loss_gap} |"
        )
    Path(str(out) + ".md").write_text("\n".join(lines) + "\n")
    Path(str(out) + ".json").write_text(json.dumps({"command": command, "results": results}, indent=2))
    if not _can_plot():
        print(f"matplotlib is not installed: no {out}.png (the results are in {out}.json and {out}.md)", flush=True)
    else:
        _plot(results, Path(str(out) + ".png"), args)
    print("\n".join(lines))


def _can_plot() -> bool:
    """Whether matplotlib imports (a missing plot must not lose a finished run's results)."""
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _plot(results: list[dict], path: Path, args: argparse.Namespace) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax_loss, ax_bytes) = plt.subplots(1, 2, figsize=(13, 5), gridspec_kw={"width_ratios": [3, 2]})
    tokens_per_step = args.batch_size * args.block_size
    labels = [_short_label(r["method"]) for r in results]
    for r, label in zip(results, labels):
        steps, losses = zip(*r["train_curve"])
        workers = r.get("workers", args.workers)
        # One batch's loss swings by a whole nat between batches; a running mean over ~10% of the run shows the trend.
        ax_loss.plot([s * tokens_per_step * workers for s in steps], _running_mean(losses), label=label)
    ax_loss.set(xlabel="tokens (all workers)", ylabel="train loss, worker 0 (running mean)", title="Loss vs tokens")
    ax_loss.legend(fontsize=8)
    positions = range(len(results))
    sent = [r["bytes_per_token"] for r in results]
    ax_bytes.barh(positions, [value if value > 0 else float("nan") for value in sent])
    for position, value in zip(positions, sent):
        if value <= 0:
            ax_bytes.annotate("sends nothing", (0.02, position), xycoords=("axes fraction", "data"), va="center")
    ax_bytes.set_yticks(positions, labels, fontsize=8)
    ax_bytes.invert_yaxis()
    if any(value > 0 for value in sent):
        ax_bytes.set_xscale("log")
    ax_bytes.set(xlabel="bytes sent per token per worker (log)", title="Communication")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _short_label(method: str) -> str:
    """`name:overrides@M` -> `name@M` (the full specs are in the table)."""
    body, _, workers = method.partition("@")
    return body.partition(":")[0] + (f"@{workers}" if workers else "")


def _running_mean(values: list[float]) -> list[float]:
    window = max(1, len(values) // 10)
    return [sum(values[max(0, i - window + 1) : i + 1]) / (i + 1 - max(0, i - window + 1)) for i in range(len(values))]


if __name__ == "__main__":
    main()
