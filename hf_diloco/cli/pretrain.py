"""`hf-diloco pretrain`: pretrain a causal LM with DiLoCo (or the plain data-parallel baseline) from a YAML config.

    hf-diloco pretrain --config tiny_diloco
    torchrun --nproc_per_node 2 -m hf_diloco pretrain --config tiny_diloco --use_cpu --inner_steps 20
    accelerate launch --cpu scripts/pretrain.py --config path/to/my.yaml          # from a checkout

The YAML sections: `trainer` (diloco | ddp), `model`, `tokenizer`, `data` (see `hf_diloco.job.data` /
`hf_diloco.job.modeling`), `training` (TrainingArguments fields), `diloco` (DiLoCoConfig fields), `auto_resume` (resume
from the newest complete checkpoint in `output_dir` when there is one; default true, so a restarted job continues
where it stopped). `hf-diloco pretrain --help` lists every flag.

What the job guarantees: everything that can be checked without data is checked first (the config, every DiLoCo
value, the worker layout, the model's positions against `data.block_size`, the checkpoint to resume from); the run's
tokenizer is fixed at its first start that trains (`output_dir/tokenizer`); every rank must have built the same tokenizer and
data; a finished run's folder is left as it is; one job at a time uses an output folder (a lock,
`hf_diloco.integrations.output_lock`); and every wait for the other ranks is bounded.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch.distributed as dist

from ..integrations.global_points import check_ranks_agree, global_point_group, wait_for_all_ranks
from ..integrations.interruption import StoppedRun, rerun_or_resume_from, stop_on_signals
from ..integrations.output_lock import hold_output_folder
from ..integrations.run_summary import check_processes_joined, trained_apart
from ..job.config_file import LoadedConfig
from .auto_settings import AutoRequest, resolve_auto_values, say
from .pretrain_arguments import parse_command_line, where_logs_go

DEFAULT_BLOCK_SIZE = 256


def main(argv: Sequence[str] | None = None) -> int:
    """Run the main job; returns the exit status. SIGTERM and SIGINT end it at once with 143 and 130, rank 0 naming
    the last saved step and the command that resumes from it (`integrations/interruption.py`)."""
    with stop_on_signals(StoppedRun("hf-diloco")) as stopped:
        return run_job(sys.argv[1:] if argv is None else argv, stopped)


def run_job(argv: Sequence[str], stopped: StoppedRun) -> int:
    """The main job of `main`; `stopped` learns where its checkpoints go and how it resumes."""
    command_line = parse_command_line(argv)
    config, args = command_line.config, command_line.args
    stopped.output_dir, stopped.manifests = args.output_dir, config.trainer == "diloco"
    stopped.resume = rerun_or_resume_from(command_line.auto_resume)
    check_processes_joined(
        args.world_size,
        "On a machine without GPUs pass --use_cpu or set ACCELERATE_USE_CPU=1; for one worker, launch one process.",
    )
    _configure_logging(args)
    if args.process_index == 0:
        print(where_logs_go(args), file=sys.stderr)
    use_diloco = config.trainer == "diloco"
    check_before_building(config, args, use_diloco)
    points = JobGlobalPoints.of(args)
    # One job per folder: taken before the folder is read for a checkpoint or written, held until the job exits.
    hold_output_folder(args.output_dir, args.process_index == 0, points.group, points.timeout_seconds, points.bound)
    resume = args.resume_from_checkpoint
    if resume is None and command_line.auto_resume:
        resume = checkpoint_to_resume_from(args.output_dir, use_diloco)
    metrics = None
    if resume is not None and _run_finished(resume, args, use_diloco):
        say_run_finished(args, resume)
    else:
        if resume is not None:
            check_resumable(resume, args, use_diloco)
        metrics = train_and_evaluate(config, args, resume, points, command_line.auto)
        if metrics is not None and args.process_index == 0:
            print(json.dumps({"output_dir": args.output_dir, **metrics}, indent=2, default=str))
    points.wait("the end of the job")
    if dist.is_available() and dist.is_initialized():
        dist.destroy_process_group()
    return exit_status(metrics, args.process_index == 0)


def exit_status(metrics: dict | None, main_process: bool) -> int:
    """0, or 3 for an elastic site whose last rounds ran alone: its model is not the job's (`trained_apart`)."""
    if not metrics or not metrics.get("diloco_alone_rounds"):
        return 0
    if main_process:
        apart = {"rounds": metrics["diloco_alone_rounds"], "from_round": metrics["diloco_alone_from_round"]}
        print(f"hf-diloco: {trained_apart(metrics['diloco_site'], apart)}. Exit status 3.", file=sys.stderr)
    return 3


@dataclasses.dataclass
class JobGlobalPoints:
    """The job's own moments where every rank meets (the tokenizer, the start-up input check, the end), each bounded:
    `sync_timeout_seconds` with DiLoCo, `ddp_timeout` with the DDP baseline (see `integrations/global_points.py`)."""

    group: dist.ProcessGroup | None
    timeout_seconds: float
    bound: str

    @classmethod
    def of(cls, args: Any) -> JobGlobalPoints:
        """Every rank must call it at the same point (it creates a process group when the job is distributed)."""
        if hasattr(args, "sync_timeout_seconds"):
            timeout, bound = args.sync_timeout_seconds, "sync_timeout_seconds"
        else:
            timeout, bound = float(args.ddp_timeout), "ddp_timeout"
        return cls(global_point_group(timeout), timeout, bound)

    def wait(self, point: str) -> None:
        wait_for_all_ranks(self.group, point, self.timeout_seconds, self.bound)

    @contextlib.contextmanager
    def main_process_first(self, is_main_process: bool, point: str) -> Iterator[None]:
        """The main process runs the block first; the others wait for it (at most the bound), then run it."""
        if not is_main_process:
            self.wait(point)
        yield
        if is_main_process:
            self.wait(point)

    def check_agree(self, settings: Mapping[str, Any]) -> None:
        check_ranks_agree(settings, self.group, self.timeout_seconds, "the start of training", self.bound)


def check_before_building(config: LoadedConfig, args: Any, use_diloco: bool) -> None:
    """
    What can be checked before any data, tokenizer or model is built: the processes form whole workers (one process
    in all under elastic membership: each site is launched on its own), the model has positions for
    `data.block_size` tokens (a new model's config is built here without its vocabulary, which the tokenizer decides
    later), a run that pushes to the Hub is not in Hugging Face's offline mode, and an elastic site has the job's
    secret.
    """
    from ..core.diloco import check_store_given
    from ..core.layout.topology import RankLayout
    from ..core.settings.secret import elastic_secret
    from ..integrations.engine_session import check_one_process_per_site
    from ..job.modeling import build_model_config, check_block_size
    from ..publish.hub import refuse_offline_push

    if args.push_to_hub:
        refuse_offline_push("the final model (push_to_hub)", args.hub_model_id or Path(args.output_dir).name)
    if use_diloco:
        RankLayout(args.world_size, args.pipeline_stages, args.data_parallel_per_worker)
        diloco = args.diloco_config()
        check_one_process_per_site(diloco, args.world_size)
        check_store_given(diloco, store=None, membership=None, opening=True)
        if diloco.lighthouse:
            elastic_secret(insecure=diloco.insecure_no_secret)
    check_block_size(_block_size(config), build_model_config(config.section("model"), vocab_size=0))


def train_and_evaluate(
    config: LoadedConfig, args: Any, resume: str | None, points: JobGlobalPoints, auto: AutoRequest | None = None
):
    """
    Build data, tokenizer and model, train, evaluate the final weights, save them with their card and metrics.

    Returns:
        `dict[str, float]` or `None`: the metrics; `None` when `resume` is the last checkpoint of a finished run whose
        final model is in the folder already (then nothing is written).
    """

    from ..integrations.atomic_checkpoints import final_model_matches_checkpoint, refuse_a_damaged_final_model
    from ..integrations.trainer import DiLoCoTrainer
    from ..job.data import (
        check_enough_blocks,
        dataset_fingerprint,
        keep_run_tokenizer,
        set_model_max_length,
        tokenizer_fingerprint,
    )
    from ..job.modeling import build_model
    from ..publish.model_card import never_improved

    tokenizer, blocks = build_datasets(config, args, points)
    model = build_model(
        config.section("model"),
        len(tokenizer),
        tokenizer.bos_token_id,
        tokenizer.eos_token_id,
        tokenizer.pad_token_id,
        seed=args.seed,
    )
    # `auto` values need the model's parameter count; the batch they give is checked against the data below.
    lines = resolve_auto_values(auto, args, model, _block_size(config), config.trainer) if auto else []
    if args.process_index == 0:
        say(lines)
    num_shards = args.world_size // (getattr(args, "pipeline_stages", 1) or 1)
    check_enough_blocks(len(blocks["train"]), num_shards, args.per_device_train_batch_size)
    check_enough_blocks(len(blocks["validation"]), 1, 1, split="validation")
    set_model_max_length(tokenizer, model.config)
    trainer = build_trainer(config, args, model, tokenizer, blocks)
    # Ranks without a shared disk each build their tokenizer and data: they must have built the same ones.
    inputs = {
        "tokenizer": tokenizer_fingerprint(tokenizer),
        "train_data": dataset_fingerprint(blocks["train"]),
        "validation_data": dataset_fingerprint(blocks["validation"]),
    }
    if isinstance(trainer, DiLoCoTrainer):
        for name, value in inputs.items():
            trainer.require_agreement(name, value)
    else:
        points.check_agree(inputs)
    if args.process_index == 0:  # training starts: the tokenizer is this run's for good (see load_or_train_tokenizer)
        keep_run_tokenizer(run_tokenizer_folder(args))
    train_result = trainer.train(resume_from_checkpoint=resume)
    if getattr(trainer, "resumed_a_finished_run", False):
        if final_model_matches_checkpoint(args.output_dir, resume):
            say_run_finished(args, resume)
            return None
        # The job stopped before its final save (the final model is absent): save it now, never over a damaged one.
        refuse_a_damaged_final_model(args.output_dir, resume)
        if args.process_index == 0:
            print(
                f"{args.output_dir} holds a finished run without its final model: saving {Path(resume).name}'s "
                "model, its evaluation and card (nothing is trained).",
                file=sys.stderr,
            )
    # The final weights are evaluated before they are saved, so the card in the folder quotes their numbers.
    during = [(entry.get("step"), entry["eval_loss"]) for entry in trainer.state.log_history if "eval_loss" in entry]
    eval_metrics = trainer.evaluate()
    eval_metrics.setdefault("eval_perplexity", math.exp(min(eval_metrics["eval_loss"], 50.0)))
    if args.process_index == 0:
        _say_which_evaluation_is_final(during, trainer.state.global_step, eval_metrics["eval_loss"])
    warning = never_improved(during, eval_metrics["eval_loss"])
    if warning is not None and args.process_index == 0:
        print(f"Warning: {warning} (in {args.output_dir})", file=sys.stderr)
    trainer.save_model()
    if args.process_index == 0:
        _record_final_model(args, trainer.state.global_step)
    metrics = {**train_result.metrics, **eval_metrics}
    elastic = getattr(getattr(trainer, "diloco", None), "elastic", None)
    if elastic is not None and elastic.log.apart() is not None:  # in all_results.json, and the exit status
        apart = elastic.log.apart()
        metrics.update(diloco_site=elastic.log.site, diloco_alone_rounds=apart["rounds"])
        metrics["diloco_alone_from_round"] = apart["from_round"]
    trainer.log_metrics("all", metrics)
    trainer.save_metrics("all", metrics)
    if args.push_to_hub:
        trainer.push_to_hub()
    return metrics


def build_trainer(config: LoadedConfig, args: Any, model: Any, tokenizer: Any, blocks: Any):
    """`DiLoCoTrainer` (or the plain `Trainer` with `trainer: ddp`) on the packed blocks, scoring perplexity."""
    from transformers import Trainer, default_data_collator

    from ..integrations.trainer import DiLoCoTrainer

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
    return trainer


def build_datasets(config: LoadedConfig, args: Any, points: JobGlobalPoints):
    """
    Load the corpus (its held-out split and subsets drawn from `data.seed`, else the Trainer's `data_seed`, else its
    `seed`), fix the run's tokenizer (trained once into `output_dir/tokenizer` by the main process, kept
    once training starts, then loaded from there at every start) and pack the text into blocks.
    """
    from ..job.data import load_or_train_tokenizer, load_text_dataset, split_seed, tokenize_and_group

    data_spec = split_seed(config.section("data"), args.seed, args.data_seed)
    raw = load_text_dataset(data_spec)
    with points.main_process_first(args.process_index == 0, "the run's tokenizer (trained or loaded by rank 0 first)"):
        tokenizer = load_or_train_tokenizer(
            run_tokenizer_folder(args),
            config.section("tokenizer"),
            raw["train"]["text"],
            retrain_provisional=args.process_index == 0,
        )
    blocks = tokenize_and_group(
        raw,
        tokenizer,
        block_size=_block_size(config),
        num_proc=data_spec.get("num_proc"),
        group_batch_size=data_spec.get("group_batch_size", 1000),
    )
    return tokenizer, blocks


def run_tokenizer_folder(args: Any) -> Path:
    """Where the run keeps the tokenizer it trains: `output_dir/tokenizer`."""
    return Path(args.output_dir) / "tokenizer"


def _block_size(config: LoadedConfig) -> int:
    return config.section("data").get("block_size", DEFAULT_BLOCK_SIZE)


def card_data(config: LoadedConfig) -> dict[str, Any]:
    """What the model card says about the training data: its name, Hub id (when it is one) and a description."""
    data = config.section("data")
    block_size = _block_size(config)
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


def checkpoint_to_resume_from(output_dir: str, use_diloco: bool) -> str | None:
    """
    The checkpoint an `auto_resume` run continues from. DiLoCo: the newest complete one, and a `CheckpointError` when
    the folder holds checkpoints of which none verifies (see `integrations/atomic_checkpoints.py`), so a
    run never starts over where an earlier run's state exists. The DDP baseline's checkpoints have no manifest: its
    newest one.
    """
    from transformers.trainer_utils import get_last_checkpoint

    from ..integrations.atomic_checkpoints import checkpoint_to_resume

    if not Path(output_dir).is_dir():
        return None
    return checkpoint_to_resume(output_dir) if use_diloco else get_last_checkpoint(output_dir)


def check_resumable(checkpoint: str, args: Any, use_diloco: bool) -> None:
    """
    Refuse, before any work, a checkpoint this run cannot continue: holding pickled objects (not one this project
    wrote), written by another number of processes, or by the other trainer. The message names the ways out
    (`--output_dir`, `--auto_resume false`).
    """
    from ..integrations.atomic_checkpoints import refuse_foreign_pickles

    refuse_foreign_pickles(checkpoint, args.output_dir)
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


def say_run_finished(args: Any, checkpoint: str) -> None:
    """Tell (on the main process) that `output_dir` holds a finished run that is left as it is, and the ways out."""
    from ..integrations.atomic_checkpoints import read_trainer_state

    if args.process_index != 0:
        return
    step = read_trainer_state(checkpoint).get("global_step")
    print(
        f"{args.output_dir} already holds a finished run ({Path(checkpoint).name}, step {step} of max_steps "
        f"{args.max_steps}); nothing to train, the folder is left as it is. To train again, pass --output_dir "
        "with a new folder or --auto_resume false; to train longer, raise --max_steps.",
        file=sys.stderr,
    )


def _say_which_evaluation_is_final(during: list[tuple[Any, float]], last_step: int, final_loss: float) -> None:
    """An evaluation logged during training (`during`: (step, eval_loss)) at the last step was taken before `close()`
    applied the last outer sync: say that the final model's (in all_results.json and the card) is the other one."""
    at_the_end = [loss for step, loss in during if step == last_step]
    if at_the_end and at_the_end[-1] != final_loss:
        print(
            f"Final model: eval_loss {final_loss:.4f} (all_results.json, the card), after the last outer sync; the "
            f"evaluation logged at step {last_step} during training ({at_the_end[-1]:.4f}) came before it.",
            file=sys.stderr,
        )


def _record_final_model(args: Any, global_step: int) -> None:
    """Record the saved final model in the checkpoint of the last step, the one a re-run of the finished run finds."""
    from ..integrations.atomic_checkpoints import MANIFEST_NAME, record_final_model

    last = Path(args.output_dir) / f"checkpoint-{global_step}"
    if 0 < args.max_steps <= global_step and (last / MANIFEST_NAME).is_file():
        record_final_model(args.output_dir, last)


def _run_finished(checkpoint: str, args: Any, use_diloco: bool) -> bool:
    """
    Whether `checkpoint` is the last one of a finished run whose folder needs nothing: its step is `max_steps` and
    (with DiLoCo) the folder's final model is the checkpoint's. Decided before the process count is compared, so a
    finished run is finished whatever the re-run's process count. The plain Trainer resumed at its last step would
    train one step more: the DDP baseline stops here too. A DiLoCo run finished without its final model goes on to
    the trainer, which saves the model (with the process count that wrote the checkpoint).
    """
    from ..integrations.atomic_checkpoints import final_model_matches_checkpoint, read_trainer_state

    if not 0 < args.max_steps <= read_trainer_state(checkpoint).get("global_step", 0):
        return False
    return not use_diloco or final_model_matches_checkpoint(args.output_dir, checkpoint)


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
