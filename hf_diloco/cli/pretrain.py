"""`hf-diloco pretrain`: pretrain a causal LM with DiLoCo (or the plain data-parallel baseline) from a YAML config.

    hf-diloco pretrain --config tiny_diloco
    torchrun --nproc_per_node 2 -m hf_diloco pretrain --config tiny_diloco --use_cpu --inner_steps 20
    accelerate launch --cpu scripts/pretrain.py --config path/to/my.yaml          # from a checkout

The YAML sections: `trainer` (diloco | ddp), `model`, `tokenizer`, `data` (see `hf_diloco.data` /
`hf_diloco.modeling`), `training` (TrainingArguments fields), `diloco` (DiLoCoConfig fields), `auto_resume` (resume
from the newest checkpoint in `output_dir` when there is one; default true, so a restarted job continues where it
stopped). `hf-diloco pretrain --help` lists every flag.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..run_summary import check_processes_joined
from ..job_config import LoadedConfig
from .pretrain_arguments import parse_command_line


def main(argv: Sequence[str] | None = None) -> int:
    """Run the main job; returns the exit status."""
    command_line = parse_command_line(sys.argv[1:] if argv is None else argv)
    config, args = command_line.config, command_line.args
    check_processes_joined(
        args.world_size,
        "On a machine without GPUs pass --use_cpu or set ACCELERATE_USE_CPU=1; for one worker, launch one process.",
    )
    _configure_logging(args)
    use_diloco = config.trainer == "diloco"
    resume = args.resume_from_checkpoint
    if resume is None and command_line.auto_resume:
        resume = last_checkpoint(args.output_dir, use_diloco)
    if resume is not None and _already_finished(resume, args):
        _finish_distributed()
        return 0
    if resume is not None:
        check_resumable(resume, args, use_diloco)
    metrics = train_and_evaluate(config, args, resume)
    if args.process_index == 0:
        print(json.dumps({"output_dir": args.output_dir, **metrics}, indent=2, default=str))
    _finish_distributed()
    return 0


def train_and_evaluate(config: LoadedConfig, args: Any, resume: str | None) -> dict[str, float]:
    """Build data, tokenizer and model, train, evaluate the final weights, save them with their card and metrics."""
    from transformers import Trainer, default_data_collator

    from ..data import check_enough_blocks, set_model_max_length
    from ..modeling import build_model
    from ..trainer import DiLoCoTrainer

    tokenizer, blocks = build_datasets(config, args, Path(args.output_dir) / "tokenizer")
    num_shards = args.world_size // (getattr(args, "pipeline_stages", 1) or 1)
    check_enough_blocks(len(blocks["train"]), num_shards, args.per_device_train_batch_size)
    check_enough_blocks(len(blocks["validation"]), 1, 1, split="validation")
    model = build_model(
        config.section("model"),
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        seed=args.seed,
    )
    set_model_max_length(tokenizer, model.config)
    trainer_class = DiLoCoTrainer if config.trainer == "diloco" else Trainer
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
    if isinstance(trainer, DiLoCoTrainer):
        trainer.model_card_kwargs.update(card_data(config))
    train_result = trainer.train(resume_from_checkpoint=resume)
    # The final weights are evaluated before they are saved, so the card in the folder quotes their numbers.
    eval_metrics = trainer.evaluate()
    eval_metrics.setdefault("eval_perplexity", math.exp(min(eval_metrics["eval_loss"], 50.0)))
    trainer.save_model()
    metrics = {**train_result.metrics, **eval_metrics}
    trainer.log_metrics("all", metrics)
    trainer.save_metrics("all", metrics)
    if args.push_to_hub:
        trainer.push_to_hub()
    return metrics


def build_datasets(config: LoadedConfig, args: Any, tokenizer_dir: Path):
    """Load the corpus, train (rank 0) or load the tokenizer, and pack the text into blocks."""
    from transformers import AutoTokenizer

    from ..data import build_tokenizer, load_text_dataset, tokenize_and_group

    data_spec = config.section("data")
    raw = load_text_dataset(data_spec)
    with args.main_process_first(local=False, desc="training the tokenizer"):
        if args.process_index == 0:
            tokenizer = build_tokenizer(config.section("tokenizer"), raw["train"]["text"])
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


def card_data(config: LoadedConfig) -> dict[str, Any]:
    """What the model card says about the training data: its name, Hub id (when it is one) and a description."""
    data = config.section("data")
    block_size = data.get("block_size", 256)
    if data.get("source", "datasets" if data.get("path") else "stdlib") == "stdlib":
        tests = "included" if data.get("include_tests") else "excluded"
        return {
            "dataset": "Python standard library source",
            "language": "code",
            "data_description": "The `.py` source files of the Python standard library of the training machine (test "
            f"directories {tests}), packed into blocks of {block_size} tokens; whole files held out for evaluation.",
        }
    from datasets.packaged_modules import _PACKAGED_DATASETS_MODULES

    path, name = str(data["path"]), data.get("name")
    on_hub = path not in _PACKAGED_DATASETS_MODULES and not Path(path).exists()
    return {
        "dataset": path if name is None else f"{path} ({name})",
        "dataset_tags": [path] if on_hub else None,
        "data_description": f"`{path}`{f' (configuration `{name}`)' if name else ''} through "
        f"`datasets.load_dataset`, packed into blocks of {block_size} tokens.",
    }


def perplexity_hooks():
    """`compute_metrics` + `preprocess_logits_for_metrics` that score perplexity with the shipped evaluate module.

    Logits are reduced batch by batch to (NLL sum, token count) per example, so the evaluation never holds the
    vocabulary-sized logits of the whole eval set; the metric then takes exp(total NLL / total tokens).
    """
    import evaluate
    import torch

    from ..metrics import perplexity_metric_path

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

    from ..checkpointing import last_complete_checkpoint

    if not os.path.isdir(output_dir):
        return None
    return last_complete_checkpoint(output_dir) if use_diloco else get_last_checkpoint(output_dir)


def check_resumable(checkpoint: str, args: Any, use_diloco: bool) -> None:
    """
    Refuse, before any work, a checkpoint this run cannot continue: written by another number of processes, or by
    the other trainer. The message names the ways out (`--output_dir`, `--auto_resume false`).
    """
    ranks = sorted(Path(checkpoint).glob("diloco_state_rank*.pt"))
    problem = None
    if ranks and not use_diloco:
        problem = "it was written by a DiLoCo run and this run has trainer: ddp"
    elif use_diloco and ranks and len(ranks) != args.world_size:
        problem = f"it was written by {len(ranks)} processes and this run has {args.world_size}"
    if problem is not None:
        raise ValueError(
            f"Cannot resume from {checkpoint}: {problem}. Relaunch the run that wrote it with the same settings, "
            f"or give this run its own folder with --output_dir, or pass --auto_resume false to train from step 0 "
            f"in {args.output_dir} (its checkpoints may then be rotated away)."
        )


def _already_finished(checkpoint: str, args: Any) -> bool:
    """True (after saying so on the main process) when `checkpoint` is at or past this run's last step."""
    state_file = Path(checkpoint) / "trainer_state.json"
    if args.max_steps <= 0 or not state_file.is_file():
        return False
    step = json.loads(state_file.read_text()).get("global_step", 0)
    if step < args.max_steps:
        return False
    if args.process_index == 0:
        print(
            f"{args.output_dir} already holds a finished run ({Path(checkpoint).name}, step {step} of max_steps "
            f"{args.max_steps}); nothing to train, the folder is left as it is. To train again, pass --output_dir "
            "with a new folder or --auto_resume false; to train longer, raise --max_steps.",
            file=sys.stderr,
        )
    return True


def _configure_logging(args: Any) -> None:
    """Log levels per rank (`log_level` / `log_level_replica`) and progress bars on the main process only."""
    import datasets
    import transformers

    level = args.get_process_log_level()
    transformers.utils.logging.set_verbosity(level)
    datasets.utils.logging.set_verbosity(level)
    if not args.should_log:
        datasets.disable_progress_bars()
        transformers.utils.logging.disable_progress_bar()


def _finish_distributed() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
