"""Evaluating, saving and publishing the global model theta_g from `DiLoCoTrainer`, with its DiLoCo model card.

`evaluate`, `predict`, `save_model` (and so every checkpoint) see theta_g, identical on every rank, instead of a
worker's local parameters. After `train()` the model holds theta_g (or the best checkpoint's weights with
`load_best_model_at_end`), which is then left as it is. The card (`README.md` of every saved folder) quotes only
evaluations of the weights in that folder.
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

from torch import nn
from transformers.modelcard import extract_hyperparameters_from_trainer
from transformers.utils.hub import hf_api

from ...publish.hub import push_folder_to_hub
from ...publish.model_card import has_diloco_tag, write_model_card
from ..run_summary import closing_summary

ALL_RESULTS_NAME = "all_results.json"


class GlobalModel:
    """Mixin of [`DiLoCoTrainer`]: evaluation and saving on theta_g, the model card and the push to the Hub.

    Reads `diloco_run.model_is_global` and `every_rank_saves_the_model`, fills `final_metrics`. Calls `_get_topology`
    (`EngineLifecycle`) and `_gathers_on_global_points` (`WorkerCollectives`).

    Attributes:
        model_card_kwargs (`dict`): the arguments of `create_model_card` (and `push_to_hub`), kept for every later
            card.
    """

    @property
    def model_card_kwargs(self) -> dict[str, Any]:
        """The arguments of `create_model_card` (and `push_to_hub`), kept for every later card."""
        return self.diloco_run.model_card_kwargs

    @model_card_kwargs.setter
    def model_card_kwargs(self, value: dict[str, Any]) -> None:
        self.diloco_run.model_card_kwargs = value

    def _global_weights(self) -> contextlib.AbstractContextManager:
        # After training the model already holds theta_g, or the best checkpoint's weights with
        # `load_best_model_at_end`, which swapping in the engine's last theta_g would silently replace.
        if self.diloco is None or self.diloco_run.model_is_global:
            return contextlib.nullcontext()
        return self.diloco.global_weights()

    def evaluate(self, *args, **kwargs) -> dict[str, float]:
        with self._global_weights(), self._gathers_on_global_points():
            metrics = super().evaluate(*args, **kwargs)
        if self.diloco_run.model_is_global:
            self.diloco_run.final_metrics.update(metrics)
        return metrics

    def predict(self, *args, **kwargs):
        with self._global_weights(), self._gathers_on_global_points():
            return super().predict(*args, **kwargs)

    def save_model(self, output_dir: str | None = None, _internal_call: bool = False) -> None:
        """Save the global model theta_g and, on the saving process, its DiLoCo model card as `README.md`."""
        # With D > 1 ranks per worker each holds 1/D of theta_g, and swapping it in is a collective inside the worker.
        spread = self._get_topology().data_parallel_size > 1
        takes_part = self.args.should_save or self.diloco_run.every_rank_saves_the_model or spread
        with self._global_weights() if takes_part else contextlib.nullcontext():
            super().save_model(output_dir, _internal_call=_internal_call)
        if self.args.should_save:
            self._write_model_card(output_dir or self.args.output_dir)

    # ---- the model card ----

    def create_model_card(
        self,
        language: str | None = None,
        license: str | None = None,
        tags: str | list[str] | None = None,
        model_name: str | None = None,
        finetuned_from: str | None = None,
        tasks: str | list[str] | None = None,
        dataset_tags: str | list[str] | None = None,
        dataset: str | list[str] | None = None,
        dataset_args: str | list[str] | None = None,
    ) -> None:
        """
        Write the DiLoCo model card (`publish/model_card.py`: the `diloco` tag, the DiLoCo settings, the measured
        communication, the inner hyperparameters, the training log and the evaluation of the saved weights) to
        `output_dir/README.md`, instead of the Trainer's generic card. `push_to_hub` calls it before uploading.

        Every argument is honoured as in `Trainer.create_model_card` (front matter `language`, `license`, `tags`,
        `base_model` from `finetuned_from`, `datasets` from `dataset_tags`; `model_name` is the title; `tasks` the
        task of `model-index`; `dataset` / `dataset_args` name the evaluation data) and kept in `model_card_kwargs`
        for the cards written later (every `save_model`).
        """
        given = dict(
            language=language,
            license=license,
            tags=tags,
            model_name=model_name,
            finetuned_from=finetuned_from,
            tasks=tasks,
            dataset_tags=dataset_tags,
            dataset=dataset,
            dataset_args=dataset_args,
        )
        self.model_card_kwargs.update({key: value for key, value in given.items() if value is not None})
        if self.is_world_process_zero():
            self._write_model_card(self.args.output_dir)

    def save_metrics(self, split: str, metrics: dict[str, float], combined: bool = True) -> None:
        """`Trainer.save_metrics`; after training, the card in `output_dir` then quotes every figure of
        `all_results.json` (a metric a script adds under its own name, run_clm.py's `perplexity`, included)."""
        super().save_metrics(split, metrics, combined)
        folder = Path(self.args.output_dir)
        results_file, card = folder / ALL_RESULTS_NAME, folder / "README.md"
        if not (self.is_world_process_zero() and self.diloco_run.model_is_global and results_file.is_file()):
            return
        results = json.loads(results_file.read_text())
        if results and has_diloco_tag(card):
            self.diloco_run.final_metrics = results
            self._write_model_card(folder)

    def _write_model_card(self, folder: str) -> None:
        write_model_card(folder, **self._model_card_arguments(folder))

    def _model_card_arguments(self, folder: str) -> dict[str, Any]:
        """What `render_model_card` needs, from the run and from `model_card_kwargs`."""
        topology = self._get_topology()
        stats = self.diloco.stats if self.diloco is not None else {}
        # What this rank exchanges (one pipeline stage when pipelined), the same parameters DDP would all-reduce here.
        exchanged = sum(p.numel() for p in self.diloco_module.parameters() if p.requires_grad)
        options = self.model_card_kwargs
        results, evaluated = self._card_results()
        tasks = _as_list(options.get("tasks"))
        elastic = self.diloco.elastic if self.diloco is not None else None
        membership = elastic.log.summary() if elastic is not None else None
        store = self.diloco.store.summary() if self.diloco is not None and self.diloco.store is not None else None
        num_workers = (
            membership["most_workers"] if membership else store["most_sites"] if store else topology.num_workers
        )
        return {
            "settings": {**self.args.diloco_dict(), "num_workers": num_workers},
            "membership": membership,
            "store": store,
            "run_summary": closing_summary(self.diloco) if self.diloco is not None else [],
            "communication": {
                "bytes_sent": stats.get("bytes_sent", 0),
                "steps": self.diloco.inner_step if self.diloco is not None else 0,
                "num_parameters": exchanged,
                "outer_steps": stats.get("outer_steps", 0),
                "sync_wait_seconds": stats.get("sync_wait_seconds", 0.0),
            },
            "data_description": options.get("data_description") or _describe_dataset(self.train_dataset),
            "base_model": options.get("finetuned_from") or _base_model_id(self.model),
            "training_results": results,
            "evaluated": evaluated,
            "model_name": options.get("model_name") or self._card_title(),
            "repo_id": self.hub_model_id or self.args.hub_model_id or str(folder),
            "extra_tags": _as_list(options.get("tags")),
            "datasets": _as_list(options.get("dataset_tags")) or None,
            "dataset_name": _dataset_name(options.get("dataset"), options.get("dataset_args")),
            "license": options.get("license"),
            "language": options.get("language"),
            "task": tasks[0] if tasks else "text-generation",
            "hyperparameters": extract_hyperparameters_from_trainer(self),
            "training_log": _training_log(self.state.log_history),
            "tokens_seen": self._tokens_of_all_workers(),
        }

    def _tokens_of_all_workers(self) -> int:
        """This worker's `num_input_tokens_seen` x M; under `round_policy: balanced`, where workers run different
        numbers of steps, x (every worker's steps) / (this worker's): every step trains the same tokens."""
        own = self.state.num_input_tokens_seen
        engine = self.diloco
        if engine is not None and engine.round_policy.balanced and engine.inner_step:
            return own * sum(engine.round_policy.steps_done) // engine.inner_step
        return own * self._get_topology().num_workers

    def _card_results(self) -> tuple[dict[str, float], str]:
        """Metrics of an evaluation of exactly the weights being saved, and when it was taken."""
        if self.diloco_run.model_is_global:
            return dict(self.diloco_run.final_metrics), "after training"
        # During training a checkpoint holds theta_g of its step, which an evaluation at that step scored.
        step, results = self.state.global_step, {}
        for entry in self.state.log_history:
            if entry.get("step") == step:
                results.update({k: v for k, v in entry.items() if k.startswith("eval_")})
        return results, f"at step {step}"

    def _card_title(self) -> str:
        if self.args.hub_model_id:
            return self.args.hub_model_id.rstrip("/").split("/")[-1]
        if self.args.run_name and self.args.run_name != self.args.output_dir:
            return self.args.run_name
        return Path(self.args.output_dir).name

    def push_to_hub(
        self,
        commit_message: str | None = "End of training",
        blocking: bool = True,
        token: str | None = None,
        revision: str | None = None,
        private: bool | None = None,
        include_logs: bool | None = None,
        **kwargs: Any,
    ):
        """
        `Trainer.push_to_hub`, uploading what a user publishes ([`hf_diloco.publish.hub.files_to_publish`]): the global
        weights, config, generation config, tokenizer, the DiLoCo card and the results files; not the checkpoints,
        optimizer, RNG or DiLoCo state or `training_args.bin`.

        Args:
            include_logs (`bool`, *optional*): also upload the TensorBoard logs under `runs/` (default: when
                `report_to` includes tensorboard).
            **kwargs: passed to [`~DiLoCoTrainer.create_model_card`].
        """
        self.callback_handler.on_push_begin(self.args, self.state, self.control)
        token = token if token is not None else self.args.hub_token
        if self.hub_model_id is None:
            self.init_hf_repo(token=token, private=private)
        self.save_model(_internal_call=True)
        if not self.is_world_process_zero():
            return None
        tags = _as_list(kwargs.pop("tags", None)) + list(getattr(self.model, "model_tags", None) or [])
        self.create_model_card(tags=list(dict.fromkeys(tags)) or None, **kwargs)
        self._finish_current_push()
        if include_logs is None:
            include_logs = "tensorboard" in (self.args.report_to or [])
        return push_folder_to_hub(
            self.args.output_dir,
            self.hub_model_id,
            token=token,
            commit_message=commit_message,
            include_logs=include_logs,
            revision=revision if revision is not None else self.args.hub_revision,
            run_as_future=not blocking,
            api=hf_api(),
            create_repo=False,  # init_hf_repo created it
        )


def _training_log(log_history: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """One row per evaluation during training, as the Trainer's cards show them (last training loss, epoch, step,
    the validation metrics)."""
    rows, training_loss = [], "No log"
    for entry in log_history:
        if "train_loss" in entry:  # the summary of a finished train(); later entries are not during training
            break
        training_loss = entry.get("loss", training_loss)
        if "eval_loss" not in entry:
            continue
        row = {"Training Loss": training_loss, "Epoch": entry.get("epoch"), "Step": entry.get("step")}
        for key, value in entry.items():
            if key.startswith("eval_") and not key.endswith(("_runtime", "_per_second")):
                name = (
                    "Validation Loss" if key == "eval_loss" else " ".join(p.capitalize() for p in key.split("_")[1:])
                )
                row[name] = value
        rows.append(row)
    return rows


def _as_list(value: str | list[str] | None) -> list[str]:
    return [value] if isinstance(value, str) else list(value or [])


def _dataset_name(dataset: str | list[str] | None, dataset_args: str | list[str] | None) -> str | None:
    names, configs = _as_list(dataset), _as_list(dataset_args)
    if not names:
        return None
    return ", ".join(
        f"{name} ({config})" if config else name for name, config in zip(names, configs + [""] * len(names))
    )


def _describe_dataset(dataset: Any) -> str:
    if dataset is None:
        return "Not recorded."
    info = getattr(dataset, "info", None)
    name = getattr(info, "dataset_name", None) or getattr(info, "builder_name", None)
    try:
        size = f"{len(dataset):,} training examples"
    except TypeError:
        size = "a streamed dataset"
    return f"`{name}`, {size}." if name else f"{size[0].upper()}{size[1:]}."


def _base_model_id(model: nn.Module) -> str | None:
    # A Hub id the training started from; not a random initialisation (empty) or a local folder.
    name = getattr(getattr(model, "config", None), "_name_or_path", "") or ""
    return name if name and not os.path.isdir(name) and not os.path.isabs(name) else None
