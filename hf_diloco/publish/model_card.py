"""Model cards for models trained with hf_diloco.

`render_model_card` fills the repository's `model_cards/diloco_model_card.md` (a `string.Template`, installed as
`hf_diloco.model_cards`) with the DiLoCo settings, the data and the communication the run measured, next to what
plain data-parallel training would have sent; `write_model_card` saves it as the folder's `README.md`. The YAML front matter comes from
`huggingface_hub.ModelCardData` and carries the `diloco` tag. Nothing here touches the network.
"""

from __future__ import annotations

import math
import re
import string
from collections.abc import Mapping, Sequence
from importlib import metadata, resources
from pathlib import Path
from typing import Any

from huggingface_hub import EvalResult, ModelCard, ModelCardData

from ..integrations.settings import overlap_label

TEMPLATE_NAME = "diloco_model_card.md"
DILOCO_TAG = "diloco"
FP32_BYTES = 4
REQUIRED_SETTINGS = (
    "inner_steps",
    "num_fragments",
    "sync_delay",
    "merge_alpha",
    "compression",
    "overlap",
    "pipeline_stages",
    "data_parallel_per_worker",
)
NOT_RECORDED = "not recorded"
_FROM_PRETRAINED = re.compile(r'\.from_pretrained\("[^"\n]*"\)')
_TIMING_SUFFIXES = ("_runtime", "_samples_per_second", "_steps_per_second")
# What `Trainer.train()` reports beside `train_*` (all_results.json holds them next to the evaluation's metrics).
_TRAINING_FIGURES = ("epoch", "total_flos", "num_input_tokens_seen")


def template_text() -> str:
    """The model card template shipped with the package (the repository's model_cards/)."""
    return resources.files("hf_diloco.model_cards").joinpath(TEMPLATE_NAME).read_text(encoding="utf-8")


def ddp_allreduce_bytes(num_parameters: int, num_workers: int, steps: int) -> int:
    """
    Bytes one process sends in a ring all-reduce of fp32 gradients across `num_workers`, after each of `steps` steps.

    A ring all-reduce (reduce-scatter then all-gather) of N bytes over M peers sends 2 (M - 1) / M * N bytes per peer.
    """
    return round(steps * 2 * (num_workers - 1) / num_workers * num_parameters * FP32_BYTES)


def communication_summary(communication: Mapping[str, Any], num_workers: int) -> dict[str, float | None]:
    """
    Compare the bytes a run sent with what DDP would have sent for the same steps.

    Args:
        communication (`Mapping[str, Any]`):
            `bytes_sent` (bytes one process sent across workers for the outer sync), and optionally `steps`
            (inner optimizer steps), `num_parameters` (parameters that process exchanges), `outer_steps` and
            `sync_wait_seconds`.
        num_workers (`int`): M, the number of workers.

    Returns:
        `dict`: `bytes_sent`, `ddp_bytes` (None without `steps` and `num_parameters`), `ratio` (this run / DDP) and
        `reduction` (DDP / this run); a ratio is None where it is undefined (one worker, or nothing sent).
    """
    bytes_sent = int(communication["bytes_sent"])
    steps, num_parameters = communication.get("steps"), communication.get("num_parameters")
    ddp_bytes = None
    if steps is not None and num_parameters is not None:
        ddp_bytes = ddp_allreduce_bytes(int(num_parameters), num_workers, int(steps))
    ratio = bytes_sent / ddp_bytes if ddp_bytes else None
    reduction = ddp_bytes / bytes_sent if ddp_bytes and bytes_sent else None
    return {"bytes_sent": bytes_sent, "ddp_bytes": ddp_bytes, "ratio": ratio, "reduction": reduction}


def render_model_card(
    settings: Mapping[str, Any],
    communication: Mapping[str, Any],
    data_description: str,
    base_model: str | None = None,
    training_results: Mapping[str, Any] | None = None,
    *,
    model_name: str | None = None,
    repo_id: str | None = None,
    extra_tags: Sequence[str] = (),
    datasets: Sequence[str] | None = None,
    dataset_name: str | None = None,
    license: str | None = None,
    language: str | Sequence[str] | None = None,
    task: str = "text-generation",
    evaluated: str = "after training",
    hyperparameters: Mapping[str, Any] | None = None,
    training_log: Sequence[Mapping[str, Any]] | None = None,
    tokens_seen: int | None = None,
    membership: Mapping[str, Any] | None = None,
    store: Mapping[str, Any] | None = None,
    run_summary: Sequence[str] = (),
) -> str:
    """
    Render the model card of a model trained with DiLoCo.

    Args:
        settings (`Mapping[str, Any]`):
            The DiLoCo fields (`DiLoCoConfig.diloco_dict()`): at least `inner_steps`, `num_fragments`, `sync_delay`,
            `merge_alpha`, `compression`, `overlap`, `pipeline_stages`, `data_parallel_per_worker`, plus
            `num_workers` (M) unless `communication` has it.
        communication (`Mapping[str, Any]`):
            What the run measured, see [`communication_summary`]; may also hold `num_workers`.
        data_description (`str`): what the model was trained on, in a sentence or a paragraph (Markdown).
        base_model (`str`, *optional*): the checkpoint training started from; `None` for a random initialisation.
        training_results (`Mapping[str, Any]`, *optional*):
            The run's results, e.g. `all_results.json`: metrics of an evaluation of exactly the weights the card
            describes (`{"eval_loss": 3.1, "eval_perplexity": 22.2}`, or `perplexity` as run_clm.py names it) fill the
            results table and the `model-index` of the front matter; every other figure (`train_*`, `epoch`,
            `total_flos`, `num_input_tokens_seen`, timings) is listed in a table of its own below them.
        model_name (`str`, *optional*): title of the card; defaults to the last part of `repo_id`.
        repo_id (`str`, *optional*): Hub id or local folder shown in the usage snippet.
        extra_tags (`Sequence[str]`, *optional*): tags added after the DiLoCo ones.
        datasets (`Sequence[str]`, *optional*): Hub dataset ids for the front matter.
        dataset_name (`str`, *optional*): the evaluation data's name in `model-index` (default: the first of
            `datasets`, else "training data").
        license (`str`, *optional*): license identifier for the front matter (e.g. `apache-2.0`).
        language (`str` or `Sequence[str]`, *optional*): language code(s) for the front matter.
        task (`str`, *optional*, defaults to `"text-generation"`): the task of `model-index` and the pipeline tag.
        evaluated (`str`, *optional*, defaults to `"after training"`): when `training_results` were measured.
        hyperparameters (`Mapping[str, Any]`, *optional*): the inner training hyperparameters, listed as the
            Trainer's cards list them.
        training_log (`Sequence[Mapping[str, Any]]`, *optional*): one row per evaluation during training (training
            loss, epoch, step, validation metrics), as the Trainer's cards show them.
        tokens_seen (`int`, *optional*): tokens trained on, all workers together.
        membership (`Mapping[str, Any]`, *optional*): with elastic workers, the run's membership history as
            `engine.elastic.log.summary()` gives it (exchanges, fewest and most workers, joins, drops, retries, heals);
            `None`: a fixed set of workers.
        store (`Mapping[str, Any]`, *optional*): through an object store (`exchange: store`), the run's rounds as
            `engine.store.summary()` gives them (rounds, fewest, most and mean sites per round, late contributions,
            rounds closed at the deadline, sites clipped, the store's URL).
        run_summary (`Sequence[str]`, *optional*): what the run met that a reader of the card must know, one
            sentence each (`integrations.run_summary.closing_summary`: workers scaled down by robust aggregation,
            processes refused from an elastic job); listed under the introduction.

    Returns:
        `str`: the card, YAML front matter included.
    """
    missing = [key for key in REQUIRED_SETTINGS if key not in settings]
    if missing:
        raise ValueError(f"settings is missing {', '.join(missing)} (pass DiLoCoConfig.diloco_dict()).")
    num_workers = settings.get("num_workers", communication.get("num_workers"))
    if num_workers is None:
        raise ValueError("num_workers must be given in settings or communication.")
    num_workers = int(num_workers)
    if "bytes_sent" not in communication:
        raise ValueError("communication must contain bytes_sent (the run's cross-worker bytes per process).")
    summary = communication_summary(communication, num_workers)
    if model_name is None:
        model_name = repo_id.rstrip("/").split("/")[-1] if repo_id else "DiLoCo model"
    results = _evaluation_metrics(training_results)
    others = {key: value for key, value in (training_results or {}).items() if key not in results}
    metadata = _card_data(
        settings,
        model_name=model_name,
        base_model=base_model,
        extra_tags=extra_tags,
        datasets=datasets,
        license=license,
        language=language,
        task=task,
        eval_results=_eval_results(results, task, dataset_name or (datasets[0] if datasets else None)),
    )
    values = {
        "front_matter": metadata.to_yaml(),
        "model_name": model_name,
        "algorithm": _algorithm_name(settings),
        "trained_from": f"initialised from `{base_model}`" if base_model else "trained from a random initialisation",
        "num_workers": num_workers,
        "inner_steps": settings["inner_steps"],
        "num_fragments": settings["num_fragments"],
        "fragment_pattern": settings.get("fragment_pattern", NOT_RECORDED),
        "sync_delay": settings["sync_delay"],
        "merge_alpha": _number(settings["merge_alpha"]),
        "overlap": overlap_label(settings),
        "outer_optimizer": _outer_optimizer(settings),
        "compression": _compression(settings),
        "pipeline_stages": settings["pipeline_stages"],
        "data_parallel_per_worker": settings["data_parallel_per_worker"],
        "membership": _membership(membership) if store is None else _store_rounds(store),
        "run_summary": "".join(f"**In this run:** {line}.\n\n" for line in run_summary),
        "world_size": num_workers * int(settings["pipeline_stages"]) * int(settings["data_parallel_per_worker"]),
        "data_description": data_description.strip() or NOT_RECORDED,
        "tokens_seen": _tokens(tokens_seen),
        "steps": _optional_int(communication.get("steps")),
        "outer_steps": _optional_int(communication.get("outer_steps")),
        "num_parameters": _optional_int(communication.get("num_parameters")),
        "bytes_sent": _bytes(summary["bytes_sent"]),
        "ddp_bytes": _bytes(summary["ddp_bytes"]),
        "bytes_ratio": _ratio(summary["ratio"], num_workers, summary["ddp_bytes"]),
        "reduction": f"{summary['reduction']:,.1f}x" if summary["reduction"] else "n/a",
        "sync_wait": _seconds(communication.get("sync_wait_seconds")),
        "evaluation": _evaluation_section(results, evaluated, training_log, others),
        "hyperparameters": _bullet_list(hyperparameters),
        "training_log": _markdown_table(training_log) or "No evaluation during training.",
        "framework_versions": _bullet_list(framework_versions()),
        "repo_hint": repo_id or "path/to/this/model",
    }
    return string.Template(template_text()).substitute(values)


def write_model_card(folder: str | Path, **kwargs: Any) -> Path:
    """Render the card (same arguments as [`render_model_card`]) and write it as `folder/README.md`."""
    path = Path(folder) / "README.md"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(render_model_card(**kwargs), encoding="utf-8")
    return path


def has_diloco_tag(readme: str | Path) -> bool:
    """Whether a `README.md` exists and its YAML front matter lists the `diloco` tag."""
    path = Path(readme)
    if not path.is_file():
        return False
    tags = ModelCard.load(path, ignore_metadata_errors=True).data.tags or []
    return DILOCO_TAG in tags


def _card_data(
    settings: Mapping[str, Any],
    *,
    model_name: str,
    base_model: str | None,
    extra_tags: Sequence[str],
    datasets: Sequence[str] | None,
    license: str | None,
    language: str | Sequence[str] | None,
    task: str,
    eval_results: list[EvalResult] | None,
) -> ModelCardData:
    tags = [DILOCO_TAG, "hf_diloco"]
    if int(settings["num_fragments"]) > 1 or int(settings["sync_delay"]) > 0:
        tags.append("streaming-diloco")
    if settings["overlap"] in ("delayed", "eager"):
        tags.append(f"diloco-{settings['overlap']}-overlap")
    tags += [tag for tag in extra_tags if tag not in tags]
    return ModelCardData(
        model_name=model_name if eval_results else None,
        eval_results=eval_results,
        language=[language] if isinstance(language, str) else (list(language) if language else None),
        license=license,
        library_name="transformers",
        pipeline_tag=task,
        tags=tags,
        base_model=base_model,
        datasets=list(datasets) if datasets else None,
    )


def _evaluation_metrics(results: Mapping[str, Any] | None) -> dict[str, float]:
    """The numeric evaluation metrics of `results`: without the timing entries and the training figures."""
    return {
        key: value
        for key, value in (results or {}).items()
        if isinstance(value, (int, float))
        and not isinstance(value, bool)
        and not key.endswith(_TIMING_SUFFIXES)
        and not key.startswith("train_")
        and key not in _TRAINING_FIGURES
    }


def _eval_results(results: Mapping[str, float], task: str, dataset_name: str | None) -> list[EvalResult] | None:
    if not results:
        return None
    name = dataset_name or "training data"
    return [
        EvalResult(
            task_type=task,
            dataset_type=name,
            dataset_name=name,
            metric_type=_metric_type(key),
            metric_value=value,
            metric_name=key,
        )
        for key, value in results.items()
    ]


def _metric_type(key: str) -> str:
    return key.split("_", 1)[1] if key.startswith("eval_") else key


def never_improved(evaluations: Sequence[tuple[Any, float]], final_loss: float | None) -> str | None:
    """A warning when no evaluation after the first (the final one included) scored a lower loss than the first did,
    else None: a model that never improved on its initial evaluation (diverged, or a learning rate of 0) is flagged
    instead of being saved as if finished.

    Args:
        evaluations: (step, validation loss) of each evaluation during training, in order.
        final_loss: the validation loss of the final weights (None: not evaluated).
    """
    if not evaluations or final_loss is None:
        return None
    (first_step, first_loss), later = evaluations[0], [loss for _, loss in evaluations[1:]] + [final_loss]
    best = min(later, key=lambda loss: float("inf") if math.isnan(loss) else loss)
    if not (math.isnan(best) or best >= first_loss):
        return None
    return (
        f"This model never improved on its first evaluation (validation loss {_number(first_loss)} at step "
        f"{first_step}; the best after it {_number(best)}, the final one {_number(final_loss)}): training did not "
        "work. Check the learning rates (inner and outer) and the data before using it."
    )


def _evaluation_section(
    results: Mapping[str, float],
    evaluated: str,
    training_log: Sequence[Mapping[str, Any]] | None = None,
    others: Mapping[str, Any] | None = None,
) -> str:
    evaluations = [(row.get("Step"), row["Validation Loss"]) for row in training_log or [] if "Validation Loss" in row]
    warning = never_improved(evaluations, results.get("eval_loss")) if results else None
    section = _measured_section(results, evaluated)
    if others:
        rows = [f"| {key} | {_number(value)} |" for key, value in others.items()]
        header = "The run's other figures (the training loss and the token count are one worker's):"
        section += "\n\n" + "\n".join([header, "", "| Figure | Value |", "| --- | --- |", *rows])
    return section if warning is None else f"**Warning:** {warning}\n\n{section}"


def _measured_section(results: Mapping[str, float], evaluated: str) -> str:
    if not results:
        return (
            "Not evaluated after the last outer sync of training. An evaluation taken before the end of training "
            "describes other weights (the last sync changes them); evaluate the saved model, e.g. with "
            "`trainer.evaluate()`, to fill this section."
        )
    rows = [f"| {key} | {_number(value)} |" for key, value in results.items()]
    header = f"Evaluation of the weights in this folder, {evaluated}:"
    return "\n".join([header, "", "| Metric | Value |", "| --- | --- |", *rows])


def _store_rounds(summary: Mapping[str, Any]) -> str:
    fewest, most = summary["fewest_sites"], summary["most_sites"]
    sites = f"{most}" if fewest == most else f"{fewest}-{most}"
    text = (
        f"sites per round {sites} (mean {summary['mean_sites']:g}) over {summary['rounds']} rounds through the store "
        f"{summary['store']}; {summary['late_contributions']} contribution(s) applied late, "
        f"{summary['closed_at_deadline']} round(s) closed at the deadline"
    )
    if summary.get("clipped"):
        text += f"; contributions of {', '.join(summary['clipped'])} scaled down by robust clipping"
    return text


def _membership(summary: Mapping[str, Any] | None) -> str:
    if summary is None:
        return "fixed"
    fewest, most = summary["fewest_workers"], summary["most_workers"]
    workers = f"{most}" if fewest == most else f"{fewest}-{most}"
    healed = f"{summary['heals']} time(s), {_bytes(summary['heal_bytes'])}" if summary["heals"] else "never"
    alone = (
        f"; its last {summary['alone_rounds']} round(s), from round {summary['alone_from_round']}, ran alone: this "
        "model differs from the job's"
        if summary.get("alone_rounds")
        else ""
    )
    return (
        f"elastic: {summary['exchanges']} exchanges among {workers} workers; {summary['drops']} drop(s), "
        f"{summary['joins']} join(s), {summary['retries']} exchange(s) retried; this worker healed from a peer "
        f"{healed}{alone}"
    )


def framework_versions() -> dict[str, str]:
    """Installed versions of the libraries a run depends on, by display name."""
    names = {
        "hf_diloco": "hf_diloco",
        "Transformers": "transformers",
        "PyTorch": "torch",
        "Accelerate": "accelerate",
        "Datasets": "datasets",
        "Tokenizers": "tokenizers",
    }
    versions = {}
    for label, distribution in names.items():
        try:
            versions[label] = metadata.version(distribution)
        except metadata.PackageNotFoundError:
            continue
    return versions


def _algorithm_name(settings: Mapping[str, Any]) -> str:
    if settings["overlap"] == "delayed":
        return "DiLoCo with one-step delayed overlap (DiLoCoX)"
    if settings["overlap"] == "eager":
        return "DiLoCo with eager overlapped updates"
    if int(settings["num_fragments"]) > 1 or int(settings["sync_delay"]) > 0:
        return "Streaming DiLoCo"
    return "DiLoCo"


def _outer_optimizer(settings: Mapping[str, Any]) -> str:
    if "outer_lr" not in settings:
        return NOT_RECORDED
    nesterov = ", Nesterov" if settings.get("outer_nesterov", True) else ""
    return f"SGD (lr {_number(settings['outer_lr'])}, momentum {_number(settings.get('outer_momentum', 0))}{nesterov})"


def _compression(settings: Mapping[str, Any]) -> str:
    codec = settings["compression"]
    extras = ["deflated (lossless entropy coding)"] if settings.get("entropy_coding") else []
    if settings.get("exchange_pattern") == "all_gather":
        extras.append("every worker's vector sent to every worker (quantized once)")
    if codec == "none":
        return ", ".join(["none (fp32)", *extras])
    details = []
    if "compression_block_size" in settings:
        details.append(f"{settings['compression_block_size']} values per scale block")
    if "compression_scale_dtype" in settings:
        details.append(f"{settings['compression_scale_dtype']} scales")
    if "error_feedback" in settings:
        details.append(f"error feedback {'on' if settings['error_feedback'] else 'off'}")
    return ", ".join([f"{codec} ({', '.join(details)})" if details else codec, *extras])


def _markdown_table(rows: Sequence[Mapping[str, Any]] | None) -> str:
    if not rows:
        return ""
    columns = list(rows[0])
    lines = ["| " + " | ".join(columns) + " |", "| " + " | ".join("---" for _ in columns) + " |"]
    lines += ["| " + " | ".join(_number(row.get(column, "")) for column in columns) + " |" for row in rows]
    return "\n".join(lines)


def _bullet_list(values: Mapping[str, Any] | None) -> str:
    if not values:
        return NOT_RECORDED.capitalize() + "."
    return "\n".join(f"- {key}: {_number(value)}" for key, value in values.items())


def _tokens(value: int | None) -> str:
    if not value:
        return "not counted (set `include_num_input_tokens_seen` to count them)"
    # The Trainer's `num_input_tokens_seen` (logs, all_results.json) counts one worker's tokens; the card counts all.
    return f"{int(value):,}, all workers together (`num_input_tokens_seen` in the logs counts one worker's)"


def _number(value: Any) -> str:
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return str(value)
    if isinstance(value, int):
        return f"{value:,}"
    return f"{value:.6g}" if math.isfinite(value) else str(value)


def _optional_int(value: Any) -> str:
    return NOT_RECORDED if value is None else f"{int(value):,}"


def _bytes(value: float | None) -> str:
    if value is None:
        return NOT_RECORDED
    scaled, unit = float(value), "B"
    for unit in ("B", "KB", "MB", "GB", "TB", "PB"):
        if abs(scaled) < 1000 or unit == "PB":
            break
        scaled /= 1000
    human = f"{int(value)} B" if unit == "B" else f"{scaled:.2f} {unit}"
    return f"{human} ({int(value):,} bytes)"


def _ratio(ratio: float | None, num_workers: int, ddp_bytes: float | None) -> str:
    if ratio is not None:
        return f"{ratio:.4g} ({100 * ratio:.3g}%)"
    if num_workers == 1:
        return "n/a (one worker: DDP would send nothing across workers)"
    return "n/a" if ddp_bytes is not None else NOT_RECORDED


def _seconds(value: Any) -> str:
    return NOT_RECORDED if value is None else f"{float(value):.2f} s"


def point_card_at_repo(card_text: str, repo_id: str) -> str:
    """The card with its usage snippet loading from `repo_id` (the Hub repository it is pushed to)."""
    return _FROM_PRETRAINED.sub(f'.from_pretrained("{repo_id}")', card_text)
