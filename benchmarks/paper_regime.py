"""Loss at 20 tokens per parameter: DDP, DiLoCo, `slow_link` and `sign_link` on a larger corpus, several seeds.

    python -m benchmarks.paper_regime                              # CPU: 5 seeds x 4 methods, resumable
    python -m benchmarks.paper_regime --table                      # the table and plot of the runs finished so far
    python -m benchmarks.paper_regime --quick --out /tmp/regime    # seconds: a tiny model on a few files
    python -m benchmarks.paper_regime --size 125m --device cuda --seeds 0 1 2 --out runs/regime_125m   # a GPU

The papers compare methods near 20 training tokens per parameter; the `quality --long` regime has 7.5 on a 230 k
model. Here every method trains `--tokens_per_parameter` x N tokens (N: all parameters, the tied embedding included)
on 2 workers of the training run of `benchmarks.common` (same model init, data order and shards for every method of
a seed; `ShardBatches`), on the `.py`, `.pyi`, `.txt`, `.md` and `.rst` files of the installed site-packages
(`--corpus` another folder): duplicates dropped, 2% of the files held out for evaluation (by file, drawn from the
seed), a byte-level BPE tokenizer trained on the training files. A seed's data is built once (in `--work`, default
`outputs/paper_regime_data/`, not kept in git) and read by each of its runs.

Sizes (`--size`): `cpu` a Llama sized for the 2-core project machine (hidden 96, 3 layers, MLP 256, a 2048-token
vocabulary: 529,056 parameters, 10.6 M tokens, 5,167 steps of 8 x 128 tokens per worker): 6-7 minutes per run on
quiet cores, 10-40 beside other jobs, so that 4 methods x 5 seeds fit in an afternoon; `125m` a 124 M-parameter Llama
(hidden 768, 12 layers, MLP 2560, a 32,768-token vocabulary, blocks of 1024, 32 per worker: 2.49 B tokens, 37,926
steps per worker) for a GPU (`--device cuda`: both workers on the one GPU, bf16 autocast, gloo between them, θg on
the host): 6 x 124 M x 2.49 B = 1.9e18 FLOPs, about 2 hours per run on one H100 at 250 TFLOP/s (the GPU lane's
`test_the_125m_size_trains_ddp_and_sign_link_on_one_gpu` runs its code path at 0.07 tokens per parameter);
`quick` a tiny one for the test.

Methods (`--methods`, default all): `ddp` (`ddp@2`), `diloco` (H = 100 fp32 with the paper's outer Nesterov 0.7 / 0.9,
the library's defaults), `slow_link` and `sign_link` (the shipped configs' `diloco:` sections, read when a run
starts). Every run is one file `OUT/METHOD_seedN.json` (the method's spec, eval loss, bytes, and the eval loss of the
first `eval_blocks` held-out blocks every `eval_every` steps, with the bytes sent by then); a run whose file holds
the same spec is skipped, so an interrupted sweep resumes where it stopped. After each run, `OUT/table.md` (per
method: mean eval loss, the gap to DDP per seed, mean ± s.e., runs above +1%, bytes per token against DDP) and
`OUT/paper_regime.png` (eval loss against tokens and against bytes sent, mean and min-max over seeds) are rewritten.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
import sysconfig
import time
from pathlib import Path

import torch

from benchmarks.common import RESULTS_DIR, command_line, run_on_workers, run_settings, train_worker
from benchmarks.flagship import config_method
from benchmarks.over_seeds import above_cells, fewer_cell, mean_gap_cell, plot_over_seeds

SIZES: dict[str, dict] = {
    "cpu": {
        "model": {"hidden_size": 96, "num_hidden_layers": 3, "intermediate_size": 256},
        "vocab_size": 2048,
        "block_size": 128,
        "batch_size": 8,
        "lr": 2e-3,
        "warmup": 100,
        "eval_every": 600,  # a multiple of H = 100 and 120: DiLoCo's θg has just synced at every point
        "eval_blocks": 256,
        "tokenizer_chars": 4_000_000,
    },
    "125m": {
        "model": {
            "hidden_size": 768,
            "num_hidden_layers": 12,
            "num_attention_heads": 12,
            "num_key_value_heads": 12,
            "intermediate_size": 2560,
            "max_position_embeddings": 1024,
        },
        "vocab_size": 32768,
        "block_size": 1024,
        "batch_size": 32,
        "lr": 6e-4,
        "warmup": 400,
        "eval_every": 2400,
        "eval_blocks": 256,
        "tokenizer_chars": 60_000_000,
    },
    "quick": {
        "model": {"hidden_size": 32, "num_hidden_layers": 2, "intermediate_size": 64},
        "vocab_size": 300,
        "block_size": 32,
        "batch_size": 2,
        "lr": 2e-3,
        "warmup": 2,
        "eval_every": 4,
        "eval_blocks": 8,
        "tokenizer_chars": 200_000,
    },
}
QUICK = {"tokens_per_parameter": 0.05, "max_files": 60, "methods": ["ddp", "sign_link"], "seeds": [0]}
SUFFIXES = (".py", ".pyi", ".txt", ".md", ".rst")
MAX_FILE_BYTES = 1_000_000
EVAL_FRACTION = 0.02
WORKERS = 2


def method_spec(name: str) -> str:
    """The `benchmarks.common` spec of a method name (the configs' sections as they are now)."""
    if name == "ddp":
        return f"ddp@{WORKERS}"
    if name == "diloco":
        return f"diloco:inner_steps=100,outer_lr=0.7,outer_momentum=0.9,outer_nesterov=true@{WORKERS}"
    return config_method(name)


METHOD_NAMES = ("ddp", "diloco", "slow_link", "sign_link")


# ----------------------------------------------------------------------------------------------- the corpus


def corpus_files(root: Path | None = None) -> list[Path]:
    """The text files of `root` (default: the installed site-packages): sorted, each content once."""
    roots = [root] if root else sorted({Path(sysconfig.get_paths()[key]) for key in ("purelib", "platlib")})
    seen, files = set(), []
    for base in roots:
        for path in sorted(base.rglob("*")):
            if path.suffix not in SUFFIXES or "__pycache__" in path.parts or not path.is_file():
                continue
            if not 0 < path.stat().st_size <= MAX_FILE_BYTES:
                continue
            digest = hashlib.sha1(path.read_bytes()).digest()
            if digest not in seen:
                seen.add(digest)
                files.append(path)
    return files


def _texts(files: list[Path]):
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        if text.strip():
            yield text


def _blocks(tokenizer, files: list[Path], block_size: int, tokens: int) -> tuple[torch.Tensor, int]:
    """Blocks of `block_size` tokens from `files` in order (each document ends with EOS), until `tokens` tokens are
    packed or the files run out; also how many files were read."""
    stream: list[int] = []
    read = 0
    for text in _texts(files):
        stream += tokenizer(text, add_special_tokens=False)["input_ids"] + [tokenizer.eos_token_id]
        read += 1
        if len(stream) >= tokens:
            break
    count = min(len(stream), tokens) // block_size
    return torch.tensor(stream[: count * block_size], dtype=torch.long).view(count, block_size), read


def prepare_seed_data(folder: Path, files: list[Path], size: dict, seed: int, tokens_per_parameter: float) -> dict:
    """The seed's split, tokenizer and blocks in `folder/data.pt` (read back when it is there already)."""
    from hf_diloco.job.data import split_files, train_bpe_tokenizer
    from hf_diloco.job.modeling import DEFAULT_MODEL_CONFIG, build_model

    path = folder / "data.pt"
    if path.exists():
        return torch.load(path)
    train_files, eval_files = split_files(files, EVAL_FRACTION, seed)
    order = torch.randperm(len(train_files), generator=torch.Generator().manual_seed(seed)).tolist()
    train_files = [train_files[i] for i in order]
    sample, chars = [], 0
    for text in _texts(train_files):
        sample.append(text)
        chars += len(text)
        if chars >= size["tokenizer_chars"]:
            break
    tokenizer = train_bpe_tokenizer(sample, vocab_size=size["vocab_size"], show_progress=False)
    ids = (tokenizer.bos_token_id, tokenizer.eos_token_id, tokenizer.pad_token_id)
    model = build_model({"config": {**DEFAULT_MODEL_CONFIG, **size["model"]}}, len(tokenizer), *ids)
    parameters = sum(p.numel() for p in model.parameters())
    needed = math.ceil(tokens_per_parameter * parameters)
    train, read = _blocks(tokenizer, train_files, size["block_size"], needed + size["block_size"])
    evaluation, _ = _blocks(tokenizer, eval_files, size["block_size"], size["eval_blocks"] * size["block_size"])
    if not len(evaluation) or len(train) < WORKERS:
        raise ValueError(
            f"{len(files)} corpus files give {len(train)} training and {len(evaluation)} held-out blocks of "
            f"{size['block_size']} tokens: use more files (--max_files, --corpus)."
        )
    data = {
        "train": train,
        "eval": evaluation,
        "vocab": len(tokenizer),
        "ids": ids,
        "parameters": parameters,
        "tokens_needed": needed,
        "train_files_read": read,
        "files": {"train": len(train_files), "eval": len(eval_files)},
    }
    folder.mkdir(parents=True, exist_ok=True)
    torch.save(data, folder / "data.pt.tmp")
    (folder / "data.pt.tmp").rename(path)
    return data


# ----------------------------------------------------------------------------------------------- runs


def run_arguments(size: dict, data: dict, seed: int, device: str, label: str) -> argparse.Namespace:
    """The training-run settings of one run: steps so that 2 workers train `tokens_needed` tokens."""
    per_step = WORKERS * size["batch_size"] * size["block_size"]
    args = run_settings(
        [
            *("--seed", str(seed), "--model", json.dumps(size["model"]), "--lr", str(size["lr"])),
            *("--batch_size", str(size["batch_size"]), "--block_size", str(size["block_size"])),
            *("--warmup", str(size["warmup"]), "--log_every", "50", "--workers", str(WORKERS)),
        ]
    )
    args.steps = math.ceil(data["tokens_needed"] / per_step)
    args.eval_every, args.eval_blocks = size["eval_every"], len(data["eval"])
    args.device, args.progress = device, label
    return args


def run_path(out: Path, name: str, seed: int) -> Path:
    return out / f"{name}_seed{seed}.json"


def finished(out: Path, name: str, seed: int, spec: str) -> bool:
    """Whether `OUT/NAME_seedN.json` holds a run of `spec` (one of another spec, say an older config, is rerun)."""
    path = run_path(out, name, seed)
    return path.exists() and json.loads(path.read_text())["result"]["method"] == spec


def run_one(out: Path, work: Path, files: list[Path], args: argparse.Namespace, name: str, seed: int) -> dict:
    size = SIZES[args.size]
    data = prepare_seed_data(work / f"data_seed{seed}", files, size, seed, args.tokens_per_parameter)
    run_args = run_arguments(size, data, seed, args.device, f"{name} seed {seed}")
    spec = method_spec(name)
    started = time.perf_counter()
    outcome = run_on_workers(train_worker, WORKERS, spec.partition("@")[0], run_args, str(work / f"data_seed{seed}"))
    result = {**outcome[0], "method": spec, "steps": run_args.steps, "workers": WORKERS}
    record = {
        "command": command_line("paper_regime", args.argv),
        "name": name,
        "seed": seed,
        "size": args.size,
        "tokens_per_parameter": args.tokens_per_parameter,
        "parameters": data["parameters"],
        "train_blocks": len(data["train"]),
        "epochs": run_args.steps * WORKERS * size["batch_size"] / len(data["train"]),
        "wall_seconds": time.perf_counter() - started,
        "result": result,
    }
    run_path(out, name, seed).write_text(json.dumps(record, indent=1))
    return record


# ----------------------------------------------------------------------------------------------- table and plot


def load_runs(out: Path) -> dict[str, dict[int, dict]]:
    runs: dict[str, dict[int, dict]] = {}
    for path in sorted(out.glob("*_seed*.json")):
        record = json.loads(path.read_text())
        runs.setdefault(record["name"], {})[record["seed"]] = record
    return runs


def all_bytes(result: dict) -> int:
    return result["bytes_sent"] + result["final_sync_bytes"]


def gaps_to_ddp(runs: dict[str, dict[int, dict]], name: str) -> dict[int, float]:
    """A method's eval-loss gap to DDP (a fraction), per seed that both have run."""
    ddp = runs.get("ddp", {})
    per_seed = runs.get(name, {})
    return {
        seed: per_seed[seed]["result"]["eval_loss"] / ddp[seed]["result"]["eval_loss"] - 1
        for seed in sorted(per_seed)
        if seed in ddp
    }


def table(runs: dict[str, dict[int, dict]]) -> str:
    """Per method: mean eval loss, gap to DDP of the same seed (mean ± s.e., runs above +1% and +2%), bytes."""
    ddp = runs.get("ddp", {})
    first = next(iter(record for per_seed in runs.values() for record in per_seed.values()), None)
    if first is None:
        return "no finished runs\n"
    lines = [
        f"{first['parameters']:,} parameters, {first['tokens_per_parameter']:g} tokens per parameter "
        f"({first['result']['tokens_per_worker'] * WORKERS:,} tokens, {WORKERS} workers), size `{first['size']}`",
        "",
        "| method | seeds | eval loss (mean) | gap vs DDP, per seed | mean gap ± s.e. | above +1% | above +2% "
        "| x fewer bytes than DDP | wall s per run |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for name in sorted(runs, key=lambda n: METHOD_NAMES.index(n) if n in METHOD_NAMES else len(METHOD_NAMES)):
        per_seed = runs[name]
        losses = [record["result"]["eval_loss"] for record in per_seed.values()]
        by_seed = gaps_to_ddp(runs, name)
        paired, gaps = list(by_seed), list(by_seed.values())
        cells, mean, above1, above2, fewer = "-", "-", "-", "-", "-"
        if name != "ddp" and gaps:
            cells = ", ".join(f"s{s} {100 * g:+.2f}%" for s, g in zip(paired, gaps))
            mean, (above1, above2) = mean_gap_cell(gaps), above_cells(gaps)
            fewer = fewer_cell([all_bytes(ddp[s]["result"]) / all_bytes(per_seed[s]["result"]) for s in paired])
        seconds = statistics.fmean(record["wall_seconds"] for record in per_seed.values())
        lines.append(
            f"| {name} | {','.join(map(str, sorted(per_seed)))} | {statistics.fmean(losses):.4f} | {cells} | {mean} "
            f"| {above1} | {above2} | {fewer} | {seconds:.0f} |"
        )
    return "\n".join(lines) + "\n"


def curves(record: dict) -> list[tuple[int, int, float]]:
    """(tokens over both workers, bytes one worker sent, eval loss) at every eval point and at the end."""
    result = record["result"]
    per_step = result["tokens_per_worker"] // result["steps"] * WORKERS
    points = [(p["step"] * per_step, p["bytes_sent"], p["eval_loss"]) for p in result.get("eval_curve", [])]
    return points + [(result["steps"] * per_step, all_bytes(result), result["eval_loss"])]


def plot(runs: dict[str, dict[int, dict]], path: Path) -> bool:
    """Eval loss against tokens and against bytes sent: each method's mean over its seeds, min-max shaded."""
    names = [n for n in METHOD_NAMES if n in runs] + [n for n in runs if n not in METHOD_NAMES]
    series = {name: [curves(record) for record in runs[name].values()] for name in names}
    return plot_over_seeds(series, path, "eval loss (held-out files)")


def report(out: Path) -> str:
    runs = load_runs(out)
    text = table(runs)
    (out / "table.md").write_text(text)
    if runs:
        plot(runs, out / "paper_regime.png")
    return text


# ----------------------------------------------------------------------------------------------- main


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=sorted(SIZES), default="cpu")
    parser.add_argument("--methods", nargs="+", choices=METHOD_NAMES, default=list(METHOD_NAMES))
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2, 3, 4])
    parser.add_argument("--tokens_per_parameter", type=float, default=20.0)
    parser.add_argument("--device", default="cpu", help="`cuda`: both workers on this machine's GPU.")
    parser.add_argument("--corpus", type=Path, help="A folder of text files instead of the site-packages.")
    parser.add_argument("--max_files", type=int, help="Use only the first so many corpus files.")
    parser.add_argument("--out", type=Path, default=Path(RESULTS_DIR) / "paper_regime", help="Runs, table, plot.")
    parser.add_argument("--work", type=Path, default=Path("outputs") / "paper_regime_data", help="Each seed's data.")
    parser.add_argument("--table", action="store_true", help="Only write the table and plot of the finished runs.")
    parser.add_argument("--quick", action="store_true", help="Seconds: size quick, few files, 2 methods, seed 0.")
    return parser


def main(argv: list[str] | None = None) -> str:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    args.argv = argv
    if args.quick:
        args.size, args.tokens_per_parameter = "quick", QUICK["tokens_per_parameter"]
        args.max_files = args.max_files or QUICK["max_files"]
        args.methods, args.seeds = QUICK["methods"], QUICK["seeds"]
    args.out.mkdir(parents=True, exist_ok=True)
    if args.table:
        text = report(args.out)
        print(text)
        return text
    files = corpus_files(args.corpus)[: args.max_files]
    # A seed's data depends on the corpus, the size and the budget: each combination has a folder of its own.
    corpus = hashlib.sha1("\n".join(map(str, files)).encode()).hexdigest()[:8]
    work = args.work / f"{args.size}_{args.tokens_per_parameter:g}tpp_{corpus}"
    pending = [
        (name, seed)
        for seed in args.seeds
        for name in args.methods
        if not finished(args.out, name, seed, method_spec(name))
    ]
    print(
        f"{len(files):,} corpus files; {len(pending)} of {len(args.seeds) * len(args.methods)} runs to do", flush=True
    )
    from tqdm.auto import tqdm

    for name, seed in tqdm(pending, desc="runs", unit="run"):
        record = run_one(args.out, work, files, args, name, seed)
        tqdm.write(
            f"{name} seed {seed}: eval loss {record['result']['eval_loss']:.4f}, {record['wall_seconds']:.0f} s"
        )
        text = report(args.out)
    text = report(args.out)
    print(text)
    return text


if __name__ == "__main__":
    main()
