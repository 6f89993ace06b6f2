"""Pretrain a causal LM with DiLoCo (or the plain data-parallel baseline) from a YAML config.

    accelerate launch --cpu scripts/pretrain.py --config configs/tiny_diloco.yaml
    torchrun --nproc_per_node 2 scripts/pretrain.py --config configs/tiny_diloco.yaml --inner_steps 20

Every `TrainingArguments` field and every DiLoCo field can be overridden on the command line. The YAML sections:
`trainer` (diloco | ddp), `model`, `tokenizer`, `data` (see `hf_diloco.data` / `hf_diloco.modeling`), `training`
(TrainingArguments fields), `diloco` (DiLoCoConfig fields), `auto_resume` (resume from the newest checkpoint in
`output_dir` when there is one; default true, so a restarted job continues where it stopped).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
from pathlib import Path
from typing import Any

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

TOP_LEVEL_KEYS = {"trainer", "model", "tokenizer", "data", "training", "diloco", "auto_resume"}


def load_config(path: str) -> dict[str, Any]:
    config = yaml.safe_load(Path(path).read_text()) or {}
    if not isinstance(config, dict):
        raise ValueError(f"{path}: expected a mapping with sections {sorted(TOP_LEVEL_KEYS)}.")
    unknown = set(config) - TOP_LEVEL_KEYS
    if unknown:
        raise ValueError(f"{path}: unknown top-level key(s) {sorted(unknown)}; allowed: {sorted(TOP_LEVEL_KEYS)}.")
    if config.get("trainer", "diloco") not in ("diloco", "ddp"):
        raise ValueError(f"{path}: trainer must be 'diloco' or 'ddp', got {config['trainer']!r}.")
    return config


def parse_training_arguments(config: dict[str, Any], argv: list[str]):
    """YAML `training` + `diloco` sections are the defaults; command-line flags override them."""
    from transformers import HfArgumentParser, TrainingArguments

    from hf_diloco import DiLoCoTrainingArguments

    use_diloco = config.get("trainer", "diloco") == "diloco"
    if not use_diloco and config.get("diloco"):
        raise ValueError("A `diloco:` section needs `trainer: diloco`.")
    parser = HfArgumentParser(DiLoCoTrainingArguments if use_diloco else TrainingArguments)
    defaults = {**(config.get("training") or {}), **(config.get("diloco") or {})}
    known = {action.dest for action in parser._actions}
    unknown = set(defaults) - known
    if unknown:
        raise ValueError(f"Unknown training/diloco field(s) in the config: {sorted(unknown)}.")
    parser.set_defaults(**defaults)
    for action in parser._actions:
        if action.dest in defaults:
            action.required = False
    (args,) = parser.parse_args_into_dataclasses(args=argv)
    return args


def build_datasets(config: dict[str, Any], args, tokenizer_dir: Path):
    """Load the corpus, train (rank 0) or load the tokenizer, and pack the text into blocks."""
    from transformers import AutoTokenizer

    from hf_diloco.data import build_tokenizer, load_text_dataset, tokenize_and_group

    data_spec = dict(config.get("data") or {})
    raw = load_text_dataset(data_spec)
    with args.main_process_first(local=False, desc="training the tokenizer"):
        if args.process_index == 0:
            tokenizer = build_tokenizer(config.get("tokenizer"), raw["train"]["text"])
            tokenizer.save_pretrained(tokenizer_dir)
        else:
            tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    blocks = tokenize_and_group(
        raw,
        tokenizer,
        block_size=data_spec.get("block_size", 256),
        num_proc=data_spec.get("num_proc"),
        group_batch_size=data_spec.get("group_batch_size", 1000),
    )
    return tokenizer, blocks


def perplexity_hooks():
    """`compute_metrics` + `preprocess_logits_for_metrics` that score perplexity with the shipped evaluate module.

    Logits are reduced batch by batch to (NLL sum, token count) per example, so the evaluation never holds the
    vocabulary-sized logits of the whole eval set; the metric then takes exp(total NLL / total tokens).
    """
    import evaluate
    import torch

    from hf_diloco.metrics import perplexity_metric_path

    metric = evaluate.load(perplexity_metric_path())

    def nll_per_example(logits, labels):
        logits = logits[0] if isinstance(logits, tuple) else logits
        shifted_logits, shifted_labels = logits[:, :-1].float(), labels[:, 1:]
        losses = torch.nn.functional.cross_entropy(
            shifted_logits.transpose(1, 2), shifted_labels, ignore_index=-100, reduction="none"
        )
        mask = shifted_labels.ne(-100)
        return torch.stack([(losses * mask).sum(dim=1), mask.sum(dim=1).float()], dim=1)

    def compute_metrics(eval_prediction) -> dict[str, float]:
        sums = eval_prediction.predictions
        result = metric.compute(predictions=sums[:, 0].tolist(), references=sums[:, 1].astype("int64").tolist())
        return {"perplexity": result["perplexity"], "tokens": result["eval_tokens"]}

    return compute_metrics, nll_per_example


def last_checkpoint(output_dir: str, use_diloco: bool) -> str | None:
    """The newest checkpoint to resume from: for DiLoCo runs, the newest *complete* one (see hf_diloco.checkpointing)."""
    from transformers.trainer_utils import get_last_checkpoint

    from hf_diloco.checkpointing import last_complete_checkpoint

    if not os.path.isdir(output_dir):
        return None
    return last_complete_checkpoint(output_dir) if use_diloco else get_last_checkpoint(output_dir)


def main(argv: list[str] | None = None) -> dict[str, float]:
    cli = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    cli.add_argument("--config", default="configs/tiny_diloco.yaml", help="YAML config (see configs/).")
    known, rest = cli.parse_known_args(argv)
    config = load_config(known.config)
    args = parse_training_arguments(config, rest)

    from transformers import Trainer, default_data_collator

    from hf_diloco import DiLoCoTrainer
    from hf_diloco.data import check_enough_blocks
    from hf_diloco.modeling import build_model

    tokenizer, blocks = build_datasets(config, args, Path(args.output_dir) / "tokenizer")
    num_shards = args.world_size // (getattr(args, "pipeline_stages", 1) or 1)
    check_enough_blocks(len(blocks["train"]), num_shards, args.per_device_train_batch_size)
    check_enough_blocks(len(blocks["validation"]), 1, 1, split="validation")
    model = build_model(
        config.get("model"),
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        seed=args.seed,
    )
    trainer_class = DiLoCoTrainer if config.get("trainer", "diloco") == "diloco" else Trainer
    # A pipelined model has logits only on its last stage: it evaluates the loss (its perplexity is exp of it).
    pipelined = getattr(args, "pipeline_stages", 1) > 1
    compute_metrics, preprocess_logits = (None, None) if pipelined else perplexity_hooks()
    trainer = trainer_class(
        model=model,
        args=args,
        train_dataset=blocks["train"],
        eval_dataset=blocks["validation"],
        data_collator=default_data_collator,
        processing_class=tokenizer,
        compute_metrics=compute_metrics,
        preprocess_logits_for_metrics=preprocess_logits,
    )
    resume = args.resume_from_checkpoint
    if resume is None and config.get("auto_resume", True):
        resume = last_checkpoint(args.output_dir, trainer_class is DiLoCoTrainer)
    train_result = trainer.train(resume_from_checkpoint=resume)
    trainer.save_model()
    metrics = dict(train_result.metrics)
    eval_metrics = trainer.evaluate()
    eval_metrics.setdefault("eval_perplexity", math.exp(min(eval_metrics["eval_loss"], 50.0)))
    metrics.update(eval_metrics)
    trainer.log_metrics("all", metrics)
    trainer.save_metrics("all", metrics)
    if args.process_index == 0:
        print(json.dumps({"output_dir": args.output_dir, **metrics}, indent=2, default=str))
    _finish_distributed()
    return metrics


def _finish_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
