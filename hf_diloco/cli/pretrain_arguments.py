"""Command line of `hf-diloco pretrain`: every key of the YAML config is also a flag.

- `--config` (a file or a shipped config name), `--trainer`, `--auto_resume`: the config's top level.
- Every `TrainingArguments` field (`--max_steps`, `--output_dir`, ...) and, with `trainer: diloco`, every DiLoCo
  field (`--inner_steps`, `--compression`, ...): the `training:` and `diloco:` sections are their defaults.
- `--model.KEY`, `--tokenizer.KEY`, `--data.KEY` set a key of those sections (`--data.block_size 128`), and
  `--model.config.FIELD` one field of the model's config (`--model.config.hidden_size 64`). Values are read as YAML
  (`--data.data_files '{train: corpus.txt}'`).
"""

from __future__ import annotations

import argparse
import dataclasses
from collections.abc import Sequence
from typing import Any

import yaml

from .config_file import TRAINERS, LoadedConfig, apply_overrides, read_config

DEFAULT_CONFIG = "tiny_diloco"
MODEL_CONFIG_PREFIX = "--model.config."
SECTION_FLAGS: dict[str, dict[str, str]] = {
    "model": {
        "config": "The model's config as a YAML mapping with a model_type (random initialisation).",
        "config_name": "A local config folder or Hub name read with AutoConfig (random initialisation).",
        "model_name_or_path": "A checkpoint to start from (its weights and vocabulary).",
        "dtype": "dtype of the parameters, e.g. bfloat16 (default float32).",
    },
    "tokenizer": {
        "path": "An existing tokenizer (folder or Hub name) instead of training one.",
        "vocab_size": "Vocabulary size of the byte-level BPE tokenizer trained on the training split.",
        "min_frequency": "A pair seen fewer times is never merged.",
        "max_train_samples": "Train the tokenizer on at most this many documents.",
    },
    "data": {
        "source": "stdlib (the Python standard library's source files) or datasets (datasets.load_dataset).",
        "include_tests": "stdlib: also use the test files.",
        "path": "datasets.load_dataset path: a Hub dataset, a local folder, or a builder such as text or json.",
        "name": "datasets.load_dataset configuration name.",
        "data_files": "datasets.load_dataset data_files, e.g. '{train: corpus/*.txt}'.",
        "data_dir": "datasets.load_dataset data_dir.",
        "split": "datasets.load_dataset split.",
        "validation_split": "Name of the evaluation split (default validation).",
        "validation_split_percentage": "Percent of the training rows (stdlib: files) held out when there is no "
        "evaluation split (default 5).",
        "text_column": "The column holding the text (default text).",
        "max_train_samples": "Keep a seeded random subset of this many training rows (stdlib: files).",
        "max_eval_samples": "Keep a seeded random subset of this many evaluation rows (stdlib: files).",
        "seed": "Seed of the held-out split and of the subsets (default 0).",
        "block_size": "Tokens per packed training sequence (at most the model's positions).",
        "num_proc": "Processes for tokenization (datasets.map).",
        "group_batch_size": "Documents concatenated before cutting them into blocks (default 1000).",
    },
}


@dataclasses.dataclass
class PretrainCommandLine:
    """What `hf-diloco pretrain` was asked to run: the config with every override applied, and the arguments."""

    config: LoadedConfig
    args: Any  # DiLoCoTrainingArguments, or TrainingArguments with trainer: ddp
    auto_resume: bool


def parse_command_line(argv: Sequence[str]) -> PretrainCommandLine:
    """
    Parse the command line: read the config it names, check every override, then build the training arguments.

    Raises:
        `ValueError`: an unknown or misplaced key (in the file or given as a flag), naming the closest valid key.
        `SystemExit`: `--help`, or a flag argparse does not know.
    """
    first = argparse.ArgumentParser(add_help=False)
    first.add_argument("--config", default=DEFAULT_CONFIG)
    first.add_argument("--trainer", choices=TRAINERS)
    known, _ = first.parse_known_args(argv)
    config = read_config(known.config)
    argv, model_config = _split_model_config_flags(argv)
    parser = build_parser(config, known.trainer or config.trainer)
    namespace = vars(parser.parse_args(argv))
    overrides = {key: namespace.pop(key) for key in list(namespace) if "." in key or key in ("trainer", "auto_resume")}
    overrides.update(model_config)
    namespace.pop("config")
    if overrides:
        config = apply_overrides(config, overrides)
    (arguments_class,) = parser.dataclass_types
    return PretrainCommandLine(config, arguments_class(**namespace), config.values.get("auto_resume", True))


def build_parser(config: LoadedConfig, trainer: str):
    """
    The `hf-diloco pretrain` parser: the training arguments of `trainer` (`diloco` or `ddp`) with the config's
    `training:` and `diloco:` values as defaults, plus the config's own flags.
    """
    from transformers import HfArgumentParser, TrainingArguments

    from ..trainer import DiLoCoTrainingArguments

    use_diloco = trainer == "diloco"
    parser = HfArgumentParser(
        DiLoCoTrainingArguments if use_diloco else TrainingArguments,
        prog="hf-diloco pretrain",
        description=_description(config),
    )
    defaults = {**config.section("training"), **(config.section("diloco") if use_diloco else {})}
    parser.set_defaults(**defaults)
    for action in parser._actions:
        if action.dest in defaults:
            action.required = False
    _add_config_flags(parser, config)
    return parser


def _add_config_flags(parser: argparse.ArgumentParser, config: LoadedConfig) -> None:
    """`--config`, `--trainer`, `--auto_resume` and the section flags; their help shows the config's values."""
    from transformers.hf_argparser import string_to_bool

    group = parser.add_argument_group("The config file and its top level")
    group.add_argument(
        "--config",
        default=DEFAULT_CONFIG,
        help="A YAML config file, or the name of a shipped config (hf-diloco configs lists them).",
    )
    group.add_argument(
        "--trainer",
        choices=TRAINERS,
        default=argparse.SUPPRESS,
        help=f"diloco, or ddp (the plain Trainer). (config: {config.trainer})",
    )
    group.add_argument(
        "--auto_resume",
        type=string_to_bool,
        nargs="?",
        const=True,
        default=argparse.SUPPRESS,
        metavar="{true,false}",
        help="Resume from the newest complete checkpoint in output_dir. "
        f"(config: {str(config.values.get('auto_resume', True)).lower()})",
    )
    for section, keys in SECTION_FLAGS.items():
        values = config.section(section)
        title = f"The {section}: section of the config (values are read as YAML)"
        description = (
            f"{MODEL_CONFIG_PREFIX}FIELD VALUE sets one field of the model's config, e.g. "
            f"{MODEL_CONFIG_PREFIX}hidden_size 64."
            if section == "model"
            else None
        )
        group = parser.add_argument_group(title, description)
        for key, text in keys.items():
            shown = f" (config: {_inline_yaml(values[key])})" if key in values else ""
            group.add_argument(
                f"--{section}.{key}", type=_yaml_value, default=argparse.SUPPRESS, metavar="VALUE", help=text + shown
            )


def _inline_yaml(value: Any) -> str:
    text = yaml.safe_dump(value, default_flow_style=True, width=10_000).strip()
    return text.removesuffix("\n...").removesuffix(" ...").replace("%", "%%")


def _split_model_config_flags(argv: Sequence[str]) -> tuple[list[str], dict[str, Any]]:
    """Take `--model.config.FIELD VALUE` (or `=VALUE`) out of `argv`: FIELD is any field of the model's config."""
    rest, found = [], {}
    tokens = list(argv)
    while tokens:
        token = tokens.pop(0)
        if not token.startswith(MODEL_CONFIG_PREFIX):
            rest.append(token)
            continue
        key, has_value, value = token[2:].partition("=")
        if not has_value:
            if not tokens:
                raise ValueError(f"{token} needs a value, e.g. {MODEL_CONFIG_PREFIX}hidden_size 64.")
            value = tokens.pop(0)
        found[key] = _yaml_value(value)
    return rest, found


def _yaml_value(text: str) -> Any:
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError:
        return text


def _description(config: LoadedConfig) -> str:
    return (
        "Pretrain a causal LM from a YAML config: one process is one DiLoCo worker unless the config says "
        "otherwise. Every key of the config is also a flag; a flag given here overrides the config. Defaults shown "
        f"below are those of {config.source}. Several processes: torchrun --nproc_per_node N -m hf_diloco pretrain "
        "... --use_cpu (or accelerate launch --multi_gpu --num_processes N -m hf_diloco pretrain ...)."
    )
