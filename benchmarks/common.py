"""What the benchmarks share: the command line a result records, worker processes, and the training run.

The training run is the one `comm`, `quality` and `eager_estimate` measure: M gloo workers (processes on this
machine) train the default small Llama with AdamW on stdlib token blocks, each worker on its own shard, for the same
number of steps. `--seed` sets all that is random: the model's initialization, the held-out files (and so the
tokenizer, trained on the rest), the order of the blocks and which worker gets which (`ShardBatches`); every method of
one run shares them, so a gap between two methods of one seed is the methods' alone. A method is a spec
`name[:key=value,...][@M]`: an entry of `METHODS` (a `DiLoCoConfig`, or None for DDP), `DiLoCoConfig` overrides and
the run settings of `RUN_OVERRIDES`, and its number of workers. `REGIMES` are the two token budgets the loss
comparisons use (`quality`, `quality --long`).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import shlex
import sys
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import torch
import torch.distributed as dist

from hf_diloco.core.exchange.transport import ScheduleTag
from hf_diloco.core.settings.projection import pattern_bytes

RESULTS_DIR = "benchmarks/results"  # where stored results go, relative to the repository root (commands run there)

METHODS: dict[str, dict | None] = {
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


def _inner_optimizer_name(text: str) -> str:
    from hf_diloco.integrations.inner_optimizer import INNER_OPTIMIZERS

    if text not in INNER_OPTIMIZERS:
        raise ValueError(f"inner={text!r}: choose {' or '.join(INNER_OPTIMIZERS)}")
    return text


# Keys of a method spec that set the training loop rather than DiLoCoConfig, so DDP can be tuned the same way:
# `lr` the inner learning rate, `ddp_steps` a DDP warm start, `inner` the inner optimizer (`adamw` or `muon`, the
# front-ends' `inner_optimizer`).
RUN_OVERRIDES = {"lr": float, "ddp_steps": int, "inner": _inner_optimizer_name}

# The token budgets of the loss comparisons, as run flags: `short` 0.6 tokens per parameter of the default 1.38 M
# model; `long` 7.5 per parameter of a 229 k model (hidden 64, 4 layers, a 1024-token vocabulary, 600 corpus files),
# closer to how pretraining runs are sized on the same 2-core budget.
REGIMES = {
    "short": {"--token_budget": str(800 * 8 * 128)},
    "long": {
        "--token_budget": str(1680 * 8 * 128),
        "--model": json.dumps({"hidden_size": 64, "num_hidden_layers": 4, "intermediate_size": 128}),
        "--vocab_size": "1024",
        "--train_files": "600",
    },
}


# ----------------------------------------------------------------------------------------------- command lines


class EventLog:
    """A benchmark process's events, one JSON line each with its time, flushed as written (a killed process keeps
    what it wrote)."""

    def __init__(self, path: Path):
        self.file = path.open("a")

    def __call__(self, kind: str, **fields: object) -> None:
        self.file.write(json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n")
        self.file.flush()


def ran_as_worker(argv: Sequence[str], worker_main: Callable, worker_parser: Callable) -> bool:
    """`python -m benchmarks.NAME worker ...`: run one of the benchmark's own processes (True), else nothing (False)."""
    if list(argv[:1]) != ["worker"]:
        return False
    worker_main(worker_parser().parse_args(list(argv[1:])))
    return True


def command_line(module: str, argv: Sequence[str] | None = None) -> str:
    """The shell command that runs `benchmarks.<module>` with `argv` (default: this process's arguments)."""
    return shlex.join(["python", "-m", f"benchmarks.{module}", *(sys.argv[1:] if argv is None else argv)])


def write_results(out: str, result: dict, table: str) -> None:
    """`out.json` (the result) and `out.md` (its table), the folder made if needed; the table is printed too."""
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    Path(f"{out}.json").write_text(json.dumps(result, indent=1))
    Path(f"{out}.md").write_text(table)
    print(table)


def with_defaults(argv: list[str], defaults: dict[str, str]) -> list[str]:
    """`argv` plus every flag of `defaults` it does not set itself."""
    return argv + [item for flag, value in defaults.items() if flag not in argv for item in (flag, value)]


def run_on_workers(worker: Callable, workers: int, *args, timeout_seconds: float = 3600.0) -> list:
    """`worker(rank, workers, *args)` on `workers` processes joined by a gloo group; each rank's return value."""
    from tests.dist_utils import run_on_processes

    return run_on_processes(worker, workers, *args, timeout_seconds=timeout_seconds)


# ----------------------------------------------------------------------------------------------- method specs


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
            RUN_OVERRIDES[key](text)  # a bad value stops the benchmark before any run starts
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


# ----------------------------------------------------------------------------------------------- run settings


def add_run_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The training run's settings (model, data, optimizer, steps, workers) as flags of `parser`."""
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
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Seed of the model's init, the held-out files, the block order and each worker's shard (the same for "
        "every method of the run).",
    )
    parser.add_argument(
        "--model",
        default="",
        help='JSON overrides of the default model config, e.g. \'{"hidden_size": 64, "num_hidden_layers": 2}\'.',
    )
    parser.add_argument("--vocab_size", type=int, default=4096, help="Vocabulary of the locally trained tokenizer.")
    parser.add_argument("--train_files", type=int, default=200, help="Corpus files in the training split.")
    return parser


def run_settings(argv: list[str]) -> argparse.Namespace:
    """The run settings `argv` sets (every other one at its default)."""
    return add_run_arguments(argparse.ArgumentParser()).parse_args(argv)


def steps_for_budget(args: argparse.Namespace, workers: int) -> int:
    """Inner steps per worker so that `workers` workers train on `--token_budget` tokens in total."""
    return args.token_budget // (workers * args.batch_size * args.block_size)


def prepare_data(folder: Path, block_size: int, train_files: int = 200, vocab_size: int = 4096, seed: int = 0) -> dict:
    """Train a tokenizer on the stdlib corpus and write its token blocks to `folder/data.pt` for the workers.

    `seed` picks the held-out files and the `train_files` training files (`load_text_dataset`'s `seed`)."""
    from hf_diloco.job.data import build_tokenizer, load_text_dataset, tokenize_and_group

    raw = load_text_dataset({"max_train_samples": train_files, "max_eval_samples": 12, "seed": seed})
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


class ShardBatches:
    """One worker's batches of `blocks`: each epoch a permutation of all blocks drawn from `seed` is dealt to the
    `world` workers in turn (block i of it to worker i mod world), and each worker reads its deal in order.

    Every worker draws the same permutations, so the shards are disjoint within an epoch; a seed gives the same
    batches to every method of a run (with the same number of workers), another seed another order and deal.
    """

    def __init__(self, blocks: torch.Tensor, seed: int, rank: int, world: int, batch_size: int) -> None:
        if len(blocks) < world:
            raise ValueError(f"{len(blocks)} blocks cannot be dealt to {world} workers: use more --train_files.")
        self.blocks, self.rank, self.world, self.batch_size = blocks, rank, world, batch_size
        self.generator = torch.Generator().manual_seed(seed)
        self.per_worker = len(blocks) // world  # the blocks left over by an uneven deal wait for the next epoch
        self.deals: list[torch.Tensor] = []

    def __call__(self, step: int) -> torch.Tensor:
        """The batch of 0-based `step`."""
        positions = range(step * self.batch_size, (step + 1) * self.batch_size)
        return self.blocks[torch.stack([self._index(position) for position in positions])]

    def _index(self, position: int) -> torch.Tensor:
        epoch, offset = divmod(position, self.per_worker)
        while len(self.deals) <= epoch:
            order = torch.randperm(len(self.blocks), generator=self.generator)
            self.deals.append(order[self.rank :: self.world][: self.per_worker])
        return self.deals[epoch][offset]


# ----------------------------------------------------------------------------------------------- the worker


def _ddp_counting_hook(counter: dict, world: int):
    def hook(state, bucket):
        payload = bucket.buffer()
        counter["bytes"] += _ring_all_reduce_bytes(payload, world)
        work = dist.all_reduce(payload, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0] / world)

    return hook


def all_reduce_gradients(model: torch.nn.Module, world: int) -> int:
    """Average the gradients over all ranks, as DDP does; returns the bytes a ring all-reduce sends per rank."""
    sent = 0
    for param in model.parameters():
        if param.grad is not None:
            dist.all_reduce(param.grad)
            param.grad /= world
            sent += _ring_all_reduce_bytes(param.grad, world)
    return sent


def exchange_bytes(
    pattern: str, workers: int, payload_bytes: float, schedule_tag: bool = False, clip_norm: bool = False
) -> float:
    """Bytes one rank sends to average a vector whose whole encoded payload is `payload_bytes`, by the definition of
    the `exchange_pattern`: `reduce_scatter` sends M - 1 chunks of 1/M of it, then its averaged chunk to the M - 1
    others (2 (M - 1) / M x payload); `all_gather` sends the whole payload to the M - 1 others ((M - 1) x payload).
    `schedule_tag`: plus the tag an engine's exchange sends each peer first (lock-step check, 24 bytes);
    `clip_norm`: plus the norm robust clipping (`robust_clip_factor`, on by default) all-gathers (fp32, 4 bytes)."""
    tag = (workers - 1) * ScheduleTag.NBYTES if schedule_tag else 0
    norm = (workers - 1) * 4 if clip_norm else 0
    return pattern_bytes(pattern, workers, payload_bytes) + tag + norm


def _ring_all_reduce_bytes(tensor: torch.Tensor, world: int) -> int:
    """Bytes one rank sends in a ring all-reduce of `tensor` over `world` ranks."""
    return 2 * (world - 1) * tensor.numel() * tensor.element_size() // world


def evaluate(model, eval_ids: torch.Tensor, batch_size: int = 16) -> float:
    device = next(model.parameters()).device
    model.eval()
    total, count = 0.0, 0
    with torch.no_grad(), _autocast(device):
        for start in range(0, len(eval_ids), batch_size):
            ids = eval_ids[start : start + batch_size].to(device)
            total += float(model(input_ids=ids, labels=ids).loss) * len(ids)
            count += len(ids)
    model.train()
    return total / count


def _autocast(device: torch.device):
    """bf16 autocast on a GPU (how a GPU trains); nothing on the CPU, whose runs stay exact fp32."""
    return torch.autocast("cuda", dtype=torch.bfloat16) if device.type == "cuda" else contextlib.nullcontext()


def train_worker(
    rank: int, world: int, method: str, args: argparse.Namespace, folder: str, observer: Callable | None = None
) -> dict:
    """Train `method` on this rank (data from `prepare_data` in `folder`); its bytes, losses and eval loss.

    `observer` is called with the record of every round of this process's engines (`register_round_observer`).
    """
    if observer is None:
        return _train(rank, world, method, args, folder)
    from hf_diloco.core.rounds.stats import register_round_observer

    handle = register_round_observer(observer)
    try:
        return _train(rank, world, method, args, folder)
    finally:
        handle.remove()


def _train(rank: int, world: int, method: str, args: argparse.Namespace, folder: str) -> dict:
    """The training run. Optional settings of `args` (absent: off): `device` (`cuda`: both workers on this machine's
    GPU, bf16 autocast), `eval_every` (every so many steps the eval loss of the first `eval_blocks` eval blocks, of
    θg for DiLoCo, with the bytes sent so far: `eval_curve`) and `progress` (a progress bar on rank 0, this label)."""
    from hf_diloco import DiLoCo, DiLoCoConfig
    from hf_diloco.job.modeling import DEFAULT_MODEL_CONFIG, build_model

    data = torch.load(Path(folder) / "data.pt")
    device = torch.device(getattr(args, "device", "cpu"))
    spec = {"config": {**DEFAULT_MODEL_CONFIG, **json.loads(args.model)}} if args.model else None
    model = build_model(spec, data["vocab"], *data["ids"], seed=args.seed).to(device)
    optimizer = inner_optimizer(model, getattr(args, "inner", "adamw"), args.lr)
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, cosine_schedule(args.steps, args.warmup))
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
    batches = ShardBatches(data["train"], args.seed, rank, world, args.batch_size)
    curve, eval_curve = [], []
    eval_every = getattr(args, "eval_every", 0)
    progress = _progress_bar(args.steps, args.progress) if getattr(args, "progress", "") and rank == 0 else None
    started = time.perf_counter()
    for step in range(1, args.steps + 1):
        ids = batches(step - 1).to(device)
        with _autocast(device):
            loss = trained(input_ids=ids, labels=ids).loss
        loss.backward()
        if step <= ddp_steps:
            counter["bytes"] += all_reduce_gradients(model, world)
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
        if eval_every and step % eval_every == 0 and step < args.steps:
            eval_curve.append(_eval_point(model, engine, data["eval"][: args.eval_blocks], step, counter["bytes"]))
        if progress is not None:
            progress.update()
    if progress is not None:
        progress.close()
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
        **({"eval_curve": eval_curve} if eval_every else {}),
    }


def _eval_point(model, engine, eval_ids: torch.Tensor, step: int, ddp_bytes: int) -> dict:
    """The eval loss at `step` (θg for DiLoCo: the global model as of its last sync) and every byte sent so far."""
    if engine is None:
        return {"step": step, "bytes_sent": ddp_bytes, "eval_loss": evaluate(model, eval_ids)}
    with engine.global_weights():
        loss = evaluate(model, eval_ids)
    return {"step": step, "bytes_sent": engine.stats["bytes_sent"] + ddp_bytes, "eval_loss": loss}


def _progress_bar(steps: int, label: str):
    from tqdm.auto import tqdm

    return tqdm(total=steps, desc=label, unit="step", leave=False, mininterval=10)


def inner_optimizer(model: torch.nn.Module, name: str, lr: float) -> torch.optim.Optimizer:
    """The benchmarks' inner optimizer: AdamW (weight decay 0.1 on every parameter, betas 0.9 / 0.95), or `muon`, the
    front-ends' `inner_optimizer: muon` (Muon for the block stack's matrices, that AdamW for the rest)."""
    adamw = {"betas": (0.9, 0.95)}
    if _inner_optimizer_name(name) == "adamw":
        return torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1, **adamw)
    from hf_diloco.integrations.inner_optimizer import build_muon_with_adamw

    names = [name for name, _ in model.named_parameters()]
    return build_muon_with_adamw(model, lr, 0.1, decay_names=names, adamw_kwargs=adamw)


def cosine_schedule(total: int, warmup: int):
    """The LR factor of a step: linear warm-up over `warmup` steps, then a cosine to 0.1 at step `total`."""

    def factor(step: int) -> float:
        if step < warmup:
            return (step + 1) / warmup
        progress = (step - warmup) / max(1, total - warmup)
        return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))

    return factor
