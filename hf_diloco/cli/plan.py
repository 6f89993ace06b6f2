"""`hf-diloco plan`: the settings of a DiLoCo run from the model, the sites and their link, written as a YAML that
`hf-diloco pretrain --config` runs, and a table of what to expect (bytes, time and host CPU per sync, compute
utilization, wall-clock), each value with its source.

    hf-diloco plan --params 1e9 --workers 4 --gpus_per_site 8 --link 1gbit --out plan.yaml

The rules are `plan_model`'s; the files `plan_yaml`'s. `--measure` times a few inner steps of the model on this
machine's CPU instead of assuming a GPU's speed.
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..core.settings.scaling_rules import PAPER_SEQUENCE_LENGTH, Setting
from .plan_model import DEFAULT_MFU, GPU_PEAK_FLOPS, Plan, Sites, make_plan, parse_link
from .plan_yaml import llama_shape, plan_table, plan_yaml

MEASURE_MAX_PARAMETERS = 3e8  # --measure builds the model in this machine's memory with AdamW state
MEASURE_TOKENS = 128  # tokens per timed step


class _Parser(argparse.ArgumentParser):
    """Refuses a bad flag as one `hf-diloco: error:` line (the dispatcher's), naming the flag."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise ValueError(f"{message} (see hf-diloco plan --help)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog="hf-diloco plan",
        description="Plan a DiLoCo run: write a ready YAML (H, P, tau, codec, round policy and the DiLoCo scaling "
        "laws' learning rates, batch and warmup) and print what to expect, each value with its source.",
        epilog="Example: hf-diloco plan --params 1e9 --workers 4 --gpus_per_site 8 --link 1gbit --out plan.yaml; "
        "then: torchrun --nnodes 4 --nproc_per_node 8 ... -m hf_diloco pretrain --config plan.yaml",
    )
    model = parser.add_argument_group("the model (one of)")
    model.add_argument("--params", type=float, help="parameter count, e.g. 1e9 (a Llama of that size is written)")
    model.add_argument("--model", help="a model config: a local folder with config.json, or a JSON file")
    model.add_argument("--vocab_size", type=int, default=32000, help="tokenizer size for --params (default 32000)")
    sites = parser.add_argument_group("the sites")
    sites.add_argument("--workers", type=int, required=True, help="M: the sites (DiLoCo workers)")
    sites.add_argument("--gpus_per_site", type=int, default=1, help="D: GPUs per site (default 1)")
    sites.add_argument("--link", nargs="+", required=True, help="each site's link (or one for all): 1gbit, 100mbit")
    sites.add_argument("--latency_ms", type=float, nargs="+", default=[0.0], help="each site's latency (or one)")
    sites.add_argument(
        "--site_speeds",
        type=float,
        nargs="+",
        help="relative speed of each site, e.g. 1 1 0.5 (the step time is the fastest's)",
    )
    speed = parser.add_argument_group("the step time (one of; default: --gpu h100)")
    speed.add_argument("--gpu", default="h100", help=f"GPU type: {', '.join(GPU_PEAK_FLOPS)}")
    speed.add_argument(
        "--mfu", type=float, default=DEFAULT_MFU, help=f"assumed MFU with --gpu (default {DEFAULT_MFU})"
    )
    speed.add_argument("--step_seconds", type=float, help="a measured inner step time of one site")
    speed.add_argument("--measure", action="store_true", help="time a few inner steps of the model on this machine")
    run = parser.add_argument_group("the run")
    run.add_argument("--tokens", type=float, help="token budget (default 20 per parameter)")
    run.add_argument("--block_size", type=int, default=PAPER_SEQUENCE_LENGTH, help="sequence length (default 2048)")
    run.add_argument("--compression", help="force the codec: none, bf16 or fp4 (default: chosen from the link)")
    run.add_argument("--out", default="plan.yaml", help="the YAML to write; the table goes beside it (.md)")
    run.add_argument("--output_dir", default="outputs/plan", help="the run's output_dir in the YAML")
    run.add_argument("--json", action="store_true", help="print the plan as JSON instead of the table")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    arguments = list(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(arguments)
    num_parameters, model, vocab_size = model_of(args)
    sites = sites_of(args)
    step = None
    if args.step_seconds is not None:
        if not args.step_seconds > 0:
            raise ValueError(f"--step_seconds: must be positive, got {args.step_seconds:g}.")
        step = Setting(args.step_seconds, "--step_seconds")
    plan = make_plan(num_parameters, sites, args.block_size, step, args.gpu.lower(), args.mfu, args.tokens,
                     args.compression)  # fmt: skip
    if args.measure:
        if args.step_seconds is not None:
            raise ValueError("--measure and --step_seconds: give one of them.")
        step = measure_step_seconds(model, vocab_size, num_parameters, plan.per_device_batch * args.block_size)
        plan = make_plan(num_parameters, sites, args.block_size, step, args.gpu, args.mfu, args.tokens,
                         args.compression)  # fmt: skip
    command = "hf-diloco plan " + shlex.join(arguments)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(plan_yaml(plan, model, vocab_size, args.output_dir, _header(plan, command, out)))
    table = plan_table(plan, command)
    out.with_suffix(".md").write_text(table)
    print(json.dumps(plan_json(plan, out), indent=2) if args.json else table)
    print(f"Wrote {out} and {out.with_suffix('.md')}.", file=sys.stderr)
    return 0


def model_of(args: argparse.Namespace) -> tuple[float, dict[str, Any], int]:
    """(N, the YAML's model section, the tokenizer size) from --params or --model."""
    if (args.params is None) == (args.model is None):
        raise ValueError("--params or --model: give exactly one (a parameter count, or a config folder / JSON file).")
    if args.vocab_size < 1:
        raise ValueError(f"--vocab_size: must be positive, got {args.vocab_size}.")
    if args.params is not None:
        if not args.params > 0:
            raise ValueError(f"--params: must be a positive parameter count, got {args.params:g}.")
        return args.params, {"config": llama_shape(args.params, args.vocab_size, args.block_size)}, args.vocab_size
    path = Path(args.model)
    if path.is_dir() and (path / "config.json").is_file():
        config, section = json.loads((path / "config.json").read_text()), {"config_name": str(path)}
    elif path.is_file():
        config = json.loads(path.read_text())
        section = {"config": config}
    else:
        raise ValueError(f"--model: {args.model!r} is neither a folder with config.json nor a JSON config file.")
    if "model_type" not in config:
        raise ValueError(f"--model: {args.model!r} has no model_type (any AutoModelForCausalLM config has one).")
    vocab_size = int(config.get("vocab_size") or args.vocab_size)
    return float(count_parameters(config, vocab_size)), section, vocab_size


def count_parameters(config: dict[str, Any], vocab_size: int) -> int:
    """Parameters of the model a config describes, built on the meta device (no memory, no weights)."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {key: value for key, value in config.items() if key != "model_type"}
    settings.setdefault("vocab_size", vocab_size)
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **settings))
    return sum(parameter.numel() for parameter in model.parameters())


def sites_of(args: argparse.Namespace) -> Sites:
    links = [parse_link(text) for text in args.link]
    for flag, values in (("--link", links), ("--latency_ms", args.latency_ms)):
        if len(values) not in (1, args.workers):
            raise ValueError(f"{flag}: give one value, or one per site ({args.workers}); got {len(values)}.")
    return Sites(
        workers=args.workers,
        gpus_per_site=args.gpus_per_site,
        link_gbit=min(links),
        latency_seconds=max(args.latency_ms) / 1e3,
        speeds=tuple(args.site_speeds) if args.site_speeds else (1.0,) * max(1, args.workers),
    )


def measure_step_seconds(model: dict[str, Any], vocab_size: int, num_parameters: float, rank_tokens: int) -> Setting:
    """A site's inner step on this machine's CPU: a few AdamW steps of `MEASURE_TOKENS` tokens, scaled linearly to
    the `rank_tokens` one GPU's rank trains per step (the site's GPUs run in parallel)."""
    if num_parameters > MEASURE_MAX_PARAMETERS:
        raise ValueError(
            f"--measure: {num_parameters:.3g} parameters do not fit this machine's CPU measurement (at most "
            f"{MEASURE_MAX_PARAMETERS:.0e}); give --step_seconds from your GPUs, or --gpu."
        )
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if "config" in model:
        settings = {k: v for k, v in model["config"].items() if k != "model_type"}
        config = AutoConfig.for_model(model["config"]["model_type"], **{"vocab_size": vocab_size, **settings})
    else:
        config = AutoConfig.from_pretrained(model["config_name"])
    torch.manual_seed(0)
    network = AutoModelForCausalLM.from_config(config)
    optimizer = torch.optim.AdamW(network.parameters(), lr=1e-4)
    length = min(MEASURE_TOKENS, getattr(config, "max_position_embeddings", MEASURE_TOKENS))
    tokens = torch.randint(0, config.vocab_size, (1, length))
    timings = []
    for _ in range(4):  # the first is a warm-up
        start = time.perf_counter()
        network(input_ids=tokens, labels=tokens).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        timings.append(time.perf_counter() - start)
    per_token = sorted(timings[1:])[1] / length
    return Setting(
        per_token * rank_tokens,
        f"measured on this machine's CPU ({torch.get_num_threads()} threads): median of 3 AdamW steps of {length} "
        f"tokens, {per_token * 1e3:.3g} ms per token, x {rank_tokens:,} tokens per rank per step",
    )


def _header(plan: Plan, command: str, out: Path) -> list[str]:
    sites = plan.sites
    return [
        f"Planned by `{command}`.",
        f"N = {plan.num_parameters:.4g} parameters on {sites.workers} site(s) x {sites.gpus_per_site} GPU(s), the "
        f"slowest link {sites.link_gbit:g} Gbit/s; projected compute utilization {plan.sync.utilization:.1%}, "
        f"wall-clock {plan.wall_seconds / 3600:,.1f} h for {plan.tokens.value:.3g} tokens.",
        f"Every value's source is in the comment beside it and in {out.with_suffix('.md').name}. Run it on each site:",
        f"  torchrun --nnodes {sites.workers} --nproc_per_node {sites.gpus_per_site} --rdzv_backend c10d "
        f"--rdzv_endpoint HOST:29500 -m hf_diloco pretrain --config {out.name}",
    ]


def plan_json(plan: Plan, out: Path) -> dict[str, Any]:
    """The plan as data: every setting with its source, and the projection."""
    laws = plan.laws
    return {
        "yaml": str(out),
        "num_parameters": plan.num_parameters,
        "workers": plan.sites.workers,
        "gpus_per_site": plan.sites.gpus_per_site,
        "link_gbit": plan.sites.link_gbit,
        "step_seconds": vars(plan.step_seconds),
        "tokens": vars(plan.tokens),
        "max_steps": plan.max_steps,
        "per_device_train_batch_size": plan.per_device_batch,
        "global_batch_tokens": plan.global_batch_tokens,
        "scaling_laws": {name: vars(setting) for name, setting in laws.settings().items()},
        "choices": {name: vars(setting) for name, setting in plan.choices.items()},
        "sync": vars(plan.sync),
        "tried": [vars(t) for t in plan.tried],
        "wall_seconds": plan.wall_seconds,
        "warnings": list(laws.warnings),
    }
