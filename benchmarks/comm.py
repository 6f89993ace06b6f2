"""Bytes on the wire and loss: DDP vs DiLoCo vs Streaming DiLoCo on the same model and tokens (2 gloo workers).

    python scripts/bench_comm.py --steps 600 --methods ddp diloco streaming_fp4

Every method trains the default small Llama (random init, same seed) with AdamW on the same stdlib token blocks, each
worker on its own shard, for the same number of steps. Bytes are counted the same way for every method: what one
rank hands to the network for cross-worker communication, with the collective's wire volume (ring all-reduce:
2 (M-1)/M x payload; DiLoCo's all_to_all + all_gather: 2 (M-1) x chunk). DDP's bytes are counted by a DDP
communication hook around its real all-reduce; DiLoCo's by the engine. Eval loss is on held-out stdlib files, with
the global parameters for DiLoCo. Bytes per token are the training loop's (steady state); the once-per-run tail syncs
of `close()` (fragments trained since their last launch) are a separate column. Peak bytes per sync is the largest
single exchange. Results go to a JSON file and a markdown table, and a PNG of loss vs tokens.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

METHODS = {
    "ddp": None,
    "diloco": dict(inner_steps=100),
    "streaming_fp32": dict(inner_steps=100, num_fragments=4, sync_delay=1),
    "streaming_fp4": dict(inner_steps=100, num_fragments=4, sync_delay=1, compression="fp4", error_feedback=False),
    "streaming_fp4_zlib": dict(
        inner_steps=100, num_fragments=4, sync_delay=1, compression="fp4", error_feedback=False, entropy_coding=True
    ),
    "streaming_fp4_ef": dict(inner_steps=100, num_fragments=4, sync_delay=1, compression="fp4", error_feedback=True),
    "diloco_h50": dict(inner_steps=50),
    "eager_fp4": dict(inner_steps=100, overlap="eager", compression="fp4"),
    "delayed_fp4": dict(inner_steps=100, overlap="delayed", compression="fp4"),
    "diloco_fp4": dict(inner_steps=100, compression="fp4"),
    "lowrank8_fp4": dict(inner_steps=100, overlap="eager", compression="fp4", lowrank_rank=8),
    # The adaptive policy sees a link emulated at 20 kB/s, so the fp4 model (~0.7 MB per round) does not fit in the
    # round of compute it overlaps: the DiLoCoX regime (107B parameters over 1 Gbit/s) scaled to a 1.4M model.
    "adaptive_fp4": dict(
        inner_steps=100,
        overlap="eager",
        compression="fp4",
        lowrank_rank=32,
        adaptive_compression=True,
        adaptive_link_bytes_per_second=20000.0,
    ),
}


def prepare_data(folder: Path, block_size: int, train_files: int = 200, vocab_size: int = 4096) -> dict:
    from hf_diloco.data import build_tokenizer, load_text_dataset, tokenize_and_group

    raw = load_text_dataset({"max_train_samples": train_files, "max_eval_samples": 12})
    tokenizer = build_tokenizer({"vocab_size": vocab_size}, raw["train"]["text"])
    blocks = tokenize_and_group(raw, tokenizer, block_size)
    data = {
        "train": torch.tensor(blocks["train"]["input_ids"]),
        "eval": torch.tensor(blocks["validation"]["input_ids"]),
        "vocab": len(tokenizer),
        "ids": (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id),
    }
    torch.save(data, folder / "data.pt")
    return data


def _ddp_counting_hook(counter: dict, world: int):
    def hook(state, bucket):
        payload = bucket.buffer()
        counter["bytes"] += _ring_all_reduce_bytes(payload, world)
        work = dist.all_reduce(payload, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0] / world)

    return hook


def _all_reduce_gradients(model: torch.nn.Module, world: int) -> int:
    """Average the gradients over all ranks, as DDP does; returns the bytes a ring all-reduce sends per rank."""
    sent = 0
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world
            sent += _ring_all_reduce_bytes(param.grad, world)
    return sent


def _ring_all_reduce_bytes(tensor: torch.Tensor, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `tensor` over `world` ranks."""
    return 2 * (world - 1) * tensor.numel() * tensor.element_size() // world


def evaluate(model, eval_ids: torch.Tensor, batch_size: int = 16) -> float:
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad():
        for start in range(0, len(eval_ids), batch_size):
            ids = eval_ids[start : start + batch_size]
            total += float(model(input_ids=ids, labels=ids).loss) * len(ids)
            count += len(ids)
    model.train()
    return total / count


# Keys of a method spec that set the training loop rather than DiLoCoConfig, so DDP can be tuned the same way.
RUN_OVERRIDES = {"lr": float, "ddp_steps": int}


def parse_method(spec: str) -> tuple[str, dict | None, int | None]:
    """`name[:key=value,...][@M]` -> (name, DiLoCoConfig fields or None for DDP, workers or None).

    The overrides go on top of the method's entry in `METHODS`, e.g. `diloco_h50:outer_lr=0.5,outer_momentum=0.6@2`;
    `RUN_OVERRIDES` keys (`lr`, the inner learning rate) are left to `run_overrides`.
    """
    from hf_diloco import DiLoCoConfig

    body, _, workers = spec.partition("@")
    name = body.partition(":")[0]
    if name not in METHODS:
        raise ValueError(f"unknown method {name!r}; choose from {sorted(METHODS)}")
    fields = None if METHODS[name] is None else dict(METHODS[name])
    for key, text in _override_items(spec):
        if key in RUN_OVERRIDES:
            continue
        if fields is None or key not in DiLoCoConfig.__dataclass_fields__:
            raise ValueError(f"{spec!r}: {key!r} is not a DiLoCoConfig field of a DiLoCo method")
        default = DiLoCoConfig.__dataclass_fields__[key].default
        fields[key] = (text.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)(text)
    if fields is not None:
        DiLoCoConfig(**fields)  # validate before any process starts
    return name, fields, int(workers) if workers else None


def run_overrides(spec: str) -> dict:
    """The training-loop settings of a method spec, e.g. `ddp:lr=0.003@2` -> {"lr": 0.003}."""
    return {key: RUN_OVERRIDES[key](text) for key, text in _override_items(spec) if key in RUN_OVERRIDES}


def _override_items(spec: str) -> list[tuple[str, str]]:
    """`name:a=1,b=2@M` -> [("a", "1"), ("b", "2")]."""
    overrides = spec.partition("@")[0].partition(":")[2]
    return [(key, text) for key, _, text in (item.partition("=") for item in filter(None, overrides.split(",")))]


def worker(rank: int, world: int, method: str, args: argparse.Namespace, folder: str) -> dict:
    from hf_diloco import DiLoCo, DiLoCoConfig
    from hf_diloco.modeling import DEFAULT_MODEL_CONFIG, build_model

    data = torch.load(Path(folder) / "data.pt")
    spec = {"config": {**DEFAULT_MODEL_CONFIG, **json.loads(args.model)}} if args.model else None
    model = build_model(spec, data["vocab"], *data["ids"], seed=args.seed)
    optimizer = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.1, betas=(0.9, 0.95))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, _cosine(args.steps, args.warmup))
    engine, counter, trained = None, {"bytes": 0}, model
    _, fields, _ = parse_method(method)
    if fields is None:
        trained = torch.nn.parallel.DistributedDataParallel(model)
        trained.register_comm_hook(None, _ddp_counting_hook(counter, world))
    ddp_steps = getattr(args, "ddp_steps", 0) if fields is not None else 0

    def start_engine() -> DiLoCo:
        return DiLoCo(model, optimizer, DiLoCoConfig(**fields))

    if fields is not None and not ddp_steps:
        engine = start_engine()
    shard = data["train"][rank::world]
    curve = []
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        index = torch.arange((step - 1) * args.batch_size, step * args.batch_size) % len(shard)
        ids = shard[index]
        loss = trained(input_ids=ids, labels=ids).loss
        loss.backward()
        if step <= ddp_steps:
            counter["bytes"] += _all_reduce_gradients(model, world)
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad()
        if engine is not None:
            engine.step()
        elif step == ddp_steps:
            engine = start_engine()
        if step % args.log_every == 0 or step == args.steps:
            curve.append((step, float(loss.detach())))
    if engine is not None:
        engine.close()
        with engine.global_weights():
            eval_loss = evaluate(model, data["eval"])
        # The final tail syncs of close() happen once per run, not per round: reported apart from the steady state.
        tail_bytes = engine.stats["final_sync_bytes"]
        sent, peak = engine.stats["bytes_sent"] - tail_bytes + counter["bytes"], engine.stats["max_sync_bytes"]
        syncs = engine.stats["outer_steps"] + engine.stats["skipped_nonfinite"]
    else:
        eval_loss = evaluate(model, data["eval"])
        sent, tail_bytes, syncs = counter["bytes"], 0, args.steps
        peak = sent // args.steps
    tokens = args.steps * args.batch_size * data["train"].shape[1]
    return {
        "method": method,
        "bytes_sent": sent,
        "tokens_per_worker": tokens,
        "bytes_per_token": sent / tokens,
        "final_sync_bytes": tail_bytes,
        "peak_bytes_per_sync": peak,
        "syncs": syncs,
        "eval_loss": eval_loss,
        "train_curve": curve,
        "seconds": time.perf_counter() - started,
        "num_parameters": sum(p.numel() for p in model.parameters()),
        # An adaptive policy's per-sync choices (step, fragment, rank, codec, why): what its bytes and loss came from.
        "policy_choices": [] if engine is None else list(engine.exchange.choices),
    }


def _cosine(total: int, warmup: int):
    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--methods",
        nargs="+",
        default=["ddp", "diloco", "streaming_fp4"],
        help=f"Methods from {sorted(METHODS)}, each optionally `:key=value,...` (DiLoCoConfig overrides, and `lr` for "
        "this method's inner learning rate instead of --lr) and `@M` (its number of workers, default --workers).",
    )
    parser.add_argument(
        "--token_budget",
        type=int,
        default=0,
        help="If set, every method trains on this many tokens in total: steps = budget / (M x batch x block).",
    )
    parser.add_argument("--steps", type=int, default=600)
    parser.add_argument("--batch_size", type=int, default=8)
    parser.add_argument("--block_size", type=int, default=128)
    parser.add_argument("--lr", type=float, default=2e-3)
    parser.add_argument("--warmup", type=int, default=30)
    parser.add_argument("--log_every", type=int, default=10)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0, help="Seed of the model's random init (same for every method).")
    parser.add_argument(
        "--model",
        default="",
        help='JSON overrides of the default model config, e.g. \'{"hidden_size": 64, "num_hidden_layers": 2}\'.',
    )
    parser.add_argument("--vocab_size", type=int, default=4096, help="Vocabulary of the locally trained tokenizer.")
    parser.add_argument("--train_files", type=int, default=200, help="Corpus files in the training split.")
    parser.add_argument("--out", default="benchmarks/comm")
    return parser


def steps_for_budget(args: argparse.Namespace, workers: int) -> int:
    """Inner steps per worker so that `workers` workers train on `--token_budget` tokens in total."""
    return args.token_budget // (workers * args.batch_size * args.block_size)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    return build_parser().parse_args(argv)


def main(argv: list[str] | None = None) -> list[dict]:
    parser = build_parser()
    args = parser.parse_args(argv)
    from tests.dist_utils import run_on_processes

    results = []
    with tempfile.TemporaryDirectory() as folder:
        data = prepare_data(Path(folder), args.block_size, args.train_files, args.vocab_size)
        print(f"training split: {len(data['train']) * args.block_size:,} tokens", flush=True)
        for spec in args.methods:
            try:
                method, _, workers = parse_method(spec)
            except (ValueError, TypeError) as error:
                parser.error(str(error))
            run_args = argparse.Namespace(**vars(args))
            run_args.workers = workers or args.workers
            if args.token_budget:
                run_args.steps = steps_for_budget(args, run_args.workers)
            vars(run_args).update(run_overrides(spec))
            print(f"running {spec} ({run_args.workers} workers, {run_args.steps} steps) ...", flush=True)
            outcome = run_on_processes(
                worker, run_args.workers, spec.partition("@")[0], run_args, folder, timeout_seconds=3600
            )
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
    command = "python scripts/bench_comm.py " + " ".join(argv if argv is not None else sys.argv[1:])
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
    _plot(results, Path(str(out) + ".png"), args)
    print("\n".join(lines))


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
