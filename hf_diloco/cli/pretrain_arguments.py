"""Command line of `hf-diloco pretrain`: every key of the YAML config is also a flag.

- `--config` (a file or a shipped config name), `--trainer`, `--auto_resume`: the config's top level.
- Every `TrainingArguments` field (`--max_steps`, `--output_dir`, ...) and, with `trainer: diloco`, every DiLoCo
  field (`--inner_steps`, `--compression`, ...): the `training:` and `diloco:` sections are their defaults. A DiLoCo
  field is taken from the first of: the command line > its `DILOCO_<FIELD>` environment variable > the `diloco:`
  section > the field's default (`DILOCO_*` variables with `trainer: ddp` are an error, not ignored).
- `--model.KEY`, `--tokenizer.KEY`, `--data.KEY` set a key of those sections (`--data.block_size 128`), and
  `--model.config.FIELD` one field of the model's config (`--model.config.hidden_size 64`). Values are read as YAML
  (`--data.data_files '{train: corpus.txt}'`).
- `output_dir`, when neither the config nor the command line sets it: `outputs/CONFIG` for one process,
  `outputs/CONFIG_<N>proc` for N, with `_SITE` after it for a site (`default_output_dir`).
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib.util
import math
import os
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, NoReturn

import yaml

from ..core.settings.config import ENV_PREFIX, DiLoCoConfig, diloco_field_names
from ..integrations.redaction import redact
from ..job.config_file import TRAINERS, LoadedConfig, apply_overrides, parse_bool_option, read_config
from .auto_settings import AutoRequest, refuse_auto_for, take_auto_values

DEFAULT_CONFIG = "tiny_diloco"
# The full help, with every TrainingArguments field (`--help` alone is quick; see `short_help`).
HELP_ALL = "--help_all"
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
        "seed": "Seed of the held-out split and of the subsets (default: --data_seed, else --seed).",
        "block_size": "Tokens per packed training sequence (at most the model's positions).",
        "num_proc": "Processes for tokenization (datasets.map).",
        "group_batch_size": "Documents concatenated before cutting them into blocks (default 1000).",
    },
}


@dataclasses.dataclass
class PretrainCommandLine:
    """What `hf-diloco pretrain` was asked to run: the config with every override applied, and the arguments."""

    config: LoadedConfig
    args: Any  # DiLoCoTrainingArguments, or BaselineTrainingArguments with trainer: ddp
    auto_resume: bool
    auto: AutoRequest = dataclasses.field(default_factory=lambda: AutoRequest({}))  # keys set to `auto`


def parse_command_line(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> PretrainCommandLine:
    """
    Parse the command line: read the config it names, check every override, then build the training arguments.

    Args:
        argv (`Sequence[str]`): the arguments after the command.
        environ (`Mapping[str, str]`, *optional*): where `DILOCO_*` variables are read from (default `os.environ`).

    Raises:
        `ValueError`: an unknown or misplaced key (in the file or given as a flag), naming the closest valid key; a
            DiLoCo value that is not valid, naming where it was set (flag, variable or file); a flag argparse does not
            know or a value it cannot read.
        `SystemExit`: `--help`.
    """
    environ = os.environ if environ is None else environ
    first = argparse.ArgumentParser(add_help=False)
    _refuse_instead_of_exiting(first)
    first.add_argument("--config", default=DEFAULT_CONFIG)
    first.add_argument("--trainer", choices=TRAINERS)
    known, _ = first.parse_known_args(argv)
    if {"-h", "--help"} & set(argv) and HELP_ALL not in argv:
        config = read_config(known.config, check_keys=False)
        print(short_help(config, known.trainer or config.trainer, environ))
        raise SystemExit(0)
    argv = ["--help" if token == HELP_ALL else token for token in argv]
    config = read_config(known.config)
    trainer = known.trainer or config.trainer
    config, argv, environ, auto = take_auto_values(config, argv, environ)
    if auto and trainer != "diloco":
        refuse_auto_for(trainer, auto)
    argv, model_config = _split_model_config_flags(argv)
    parser = build_parser(config, trainer, environ)
    _refuse_instead_of_exiting(parser)
    namespace = vars(parser.parse_args(argv))
    overrides = {key: namespace.pop(key) for key in list(namespace) if "." in key or key in ("trainer", "auto_resume")}
    overrides.update(model_config)
    namespace.pop("config")
    if namespace.get("output_dir") is None:
        namespace["output_dir"] = default_output_dir(known.config, environ, namespace.get("site") or "")
    if overrides:
        config = apply_overrides(config, overrides)
    if trainer == "diloco":
        check_diloco_values(namespace, *diloco_defaults(config, trainer, environ))
    (arguments_class,) = parser.dataclass_types
    return PretrainCommandLine(config, arguments_class(**namespace), config.auto_resume, auto)


def _refuse_instead_of_exiting(parser: argparse.ArgumentParser) -> None:
    """A flag argparse cannot read becomes a `ValueError`, a refusal like any other bad input: said once, by the main
    process (argparse's own error prints its usage on every process of a launch), exit status 2 all the same."""

    def refuse(message: str) -> NoReturn:
        raise ValueError(f"{message}. `hf-diloco pretrain --help` lists the flags.")

    parser.error = refuse


def default_output_dir(config: str, environ: Mapping[str, str], site: str = "") -> str:
    """
    The output folder of a run whose config and command line set none: `outputs/CONFIG` (the config's name, or its
    file's name without `.yaml`) for one process, `outputs/CONFIG_<N>proc` for the N processes a launcher started
    (`WORLD_SIZE`), and `_SITE` after it for a site of a job of sites (`--site`: several sites may run on one
    machine). A checkpoint resumes only with the process count that wrote it, so a run of the same config on another
    count trains in a folder of its own, and the same command run again finds its own run there.
    """
    name = Path(config).name.removesuffix(".yaml").removesuffix(".yml")
    processes = int(environ.get("WORLD_SIZE", "1") or 1)
    folder = f"outputs/{name}" if processes == 1 else f"outputs/{name}_{processes}proc"
    return f"{folder}_{site}" if site else folder


def build_parser(config: LoadedConfig, trainer: str, environ: Mapping[str, str] | None = None):
    """
    The `hf-diloco pretrain` parser: the training arguments of `trainer` (`diloco` or `ddp`) with the config's
    `training:` values and the DiLoCo values of `diloco_defaults` as defaults, plus the config's own flags.
    """
    from transformers import HfArgumentParser

    from ..integrations.trainer import DiLoCoTrainingArguments
    from .baseline_arguments import BaselineTrainingArguments

    use_diloco = trainer == "diloco"
    parser = HfArgumentParser(
        DiLoCoTrainingArguments if use_diloco else BaselineTrainingArguments,
        prog="hf-diloco pretrain",
        usage="hf-diloco pretrain [--config CONFIG] [--KEY VALUE ...] (every key of the config is a flag, below)",
        description=_description(config),
    )
    # argparse quotes what it could not read ("unrecognized arguments: --hub-tokn hf_..."): never with a secret.
    plain_error = parser.error
    parser.error = lambda message: plain_error(redact(message))
    diloco, _ = diloco_defaults(config, trainer, os.environ if environ is None else environ)
    defaults = {"report_to": default_report_to(), **config.section("training"), **diloco}
    parser.set_defaults(**defaults)
    for action in parser._actions:
        if action.dest in defaults:
            action.required = False
    _add_config_flags(parser, config)
    _order_help(parser)
    return parser


def short_help(config: LoadedConfig, trainer: str, environ: Mapping[str, str]) -> str:
    """
    `hf-diloco pretrain --help`: the config, its sections, the DiLoCo keys and the `training:` keys the config sets,
    read without importing transformers (which takes seconds); `--help_all` adds every `TrainingArguments` field.
    """
    parser = argparse.ArgumentParser(
        prog="hf-diloco pretrain",
        usage="hf-diloco pretrain [--config CONFIG] [--KEY VALUE ...] (every key of the config is a flag, below)",
        description=_description(config),
        epilog=(
            "Every field of transformers' TrainingArguments is a flag too (--max_steps, --output_dir, "
            f"--gradient_accumulation_steps, ...): {HELP_ALL} lists them all with their help. Without an output_dir "
            "in the config or on the command line, the run writes outputs/CONFIG (one process) or "
            "outputs/CONFIG_<N>proc (N processes)."
        ),
    )
    _add_config_flags(parser, config)
    if trainer == "diloco":
        diloco, _ = diloco_defaults(config, trainer, environ)
        group = parser.add_argument_group("The diloco: section of the config (DiLoCoConfig; DILOCO_* variables too)")
        for field in dataclasses.fields(DiLoCoConfig):
            value = diloco.get(field.name, field.default)
            text = field.metadata.get("help", "").replace("%", "%%")
            group.add_argument(f"--{field.name}", metavar="VALUE", help=f"{text} (default: {_inline_yaml(value)})")
    training = parser.add_argument_group(
        "The training: section of the config (transformers' TrainingArguments): the keys it sets"
    )
    for key, value in config.section("training").items():
        training.add_argument(f"--{key}", metavar="VALUE", help=f"(config: {_inline_yaml(value)})")
    return parser.format_help()


def default_report_to() -> str:
    """Where the job logs when the config does not say: TensorBoard (`OUTPUT_DIR/runs`) when it is installed (the
    `plots` extra), else nowhere but each checkpoint's `trainer_state.json` (`where_logs_go` says which)."""
    return "tensorboard" if importlib.util.find_spec("tensorboard") is not None else "none"


def where_logs_go(args: Any) -> str:
    """The start-up line that says where the run's scalars are written."""
    report_to = list(args.report_to or [])
    if "tensorboard" in report_to:
        logs = getattr(args, "logging_dir", None) or f"{args.output_dir}/runs"
        return (
            f"Logs: TensorBoard in {logs} (tensorboard --logdir {logs}); also trainer_state.json in each checkpoint."
        )
    if report_to:
        return f"Logs: {', '.join(report_to)}; also trainer_state.json in each checkpoint."
    return (
        "Logs: trainer_state.json in each checkpoint only (report_to: none). For TensorBoard install the plots "
        "extra (pip install 'hf_diloco[plots]') or set training.report_to."
    )


def _order_help(parser: argparse.ArgumentParser) -> None:
    """--help as a user reads it: the config and its sections first, then the DiLoCo keys, then the Trainer's.

    Only the grouping of the help text changes; parsing reads `parser._actions`, which stays as it was."""
    options, diloco_keys = parser._optionals, {f"--{name}" for name in diloco_field_names()}
    diloco = argparse._ArgumentGroup(
        parser, "The diloco: section of the config (DiLoCoConfig; DILOCO_* variables too)"
    )
    training = argparse._ArgumentGroup(parser, "The training: section of the config (transformers' TrainingArguments)")
    for action in list(options._group_actions):
        if action.dest != "help":
            options._group_actions.remove(action)
            (diloco if diloco_keys & set(action.option_strings) else training)._group_actions.append(action)
    # argparse prints the groups in their list's order: options (now --help alone), the config's own, then these.
    parser._action_groups.extend(group for group in (diloco, training) if group._group_actions)


def diloco_defaults(
    config: LoadedConfig, trainer: str, environ: Mapping[str, str]
) -> tuple[dict[str, Any], dict[str, str]]:
    """
    The DiLoCo values below the command line: `DILOCO_<FIELD>` variables over the config's `diloco:` section.

    Returns:
        `(values, origins)`: the fields either layer sets, and where each came from (the variable's name or the
        config's source).

    Raises:
        `ValueError`: a `DILOCO_*` variable names no field or does not parse (naming the closest variable), or is set
            with `trainer: ddp`, which has no DiLoCo settings.
    """
    variables = sorted(name for name in environ if name.startswith(ENV_PREFIX))
    if trainer != "diloco":
        if variables:
            raise ValueError(
                f"{', '.join(variables)} set in the environment, but this run has trainer: ddp, which has no DiLoCo "
                "settings: unset the DILOCO_* variables, or run trainer: diloco."
            )
        return {}, {}
    from_environment, sources = DiLoCoConfig.layered_fields({}, environ)
    values = config.section("diloco")
    origins = dict.fromkeys(values, config.source)
    for name, source in sources.items():
        if source != "default":
            values[name], origins[name] = from_environment[name], source
    return values, origins


def check_diloco_values(namespace: Mapping[str, Any], defaults: Mapping[str, Any], origins: Mapping[str, str]) -> None:
    """
    Validate the DiLoCo fields of a parsed command line before anything is built, including that
    `global_copy_device` is a device this machine has; a `ValueError` says where each field it names was set (the
    command line, a `DILOCO_*` variable or the config file).
    """
    values = {name: namespace[name] for name in diloco_field_names()}
    field_defaults = {f.name: f.default for f in dataclasses.fields(DiLoCoConfig)}
    set_by = {}
    for name, value in values.items():
        if name in defaults and _same(value, defaults[name]):
            set_by[name] = origins[name]
        elif not _same(value, defaults.get(name, field_defaults[name])):
            set_by[name] = "the command line"
    try:
        DiLoCoConfig(**values)
        check_device_exists(values["global_copy_device"], "global_copy_device")
    except ValueError as error:
        named = [f"{name} by {source}" for name, source in set_by.items() if re.search(rf"\b{name}\b", str(error))]
        raise ValueError(f"{error}" + (f" (set: {'; '.join(named)})" if named else "")) from None


def _same(value: Any, other: Any) -> bool:
    """Equal, a NaN included (`.nan` from a file is the file's value, not a change made on the command line)."""
    if isinstance(value, float) and isinstance(other, float) and math.isnan(value) and math.isnan(other):
        return True
    return value == other


def check_device_exists(name: str, setting: str) -> None:
    """Raise `ValueError` unless `name` is a torch device this machine has (`cpu`, `cuda`, `cuda:1`, ...)."""
    import torch

    way_out = (
        f"Set {setting} to cpu (host memory, the default) or to a device this machine has (cuda:N, N below its GPU "
        "count)."
    )
    try:
        device = torch.device(name)
    except (RuntimeError, TypeError) as error:
        raise ValueError(f"{setting} {name!r} is not a device: {error}. {way_out}") from None
    if device.type == "cpu":
        return
    backend = getattr(torch, device.type, None)
    count = backend.device_count() if device.type != "meta" and hasattr(backend, "device_count") else 0
    if count == 0 or (device.index is not None and device.index >= count):
        raise ValueError(
            f"{setting} {name!r} names a device this machine does not have ({count} {device.type} "
            f"device(s) here). {way_out}"
        )


def __getattr__(name: str) -> Any:
    # `training_args.bin` of a baseline run pickles the class under this module's name.
    if name == "BaselineTrainingArguments":
        from .baseline_arguments import BaselineTrainingArguments

        return BaselineTrainingArguments
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _add_config_flags(parser: argparse.ArgumentParser, config: LoadedConfig) -> None:
    """`--config`, `--trainer`, `--auto_resume` and the section flags; their help shows the config's values."""
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
        type=_auto_resume_flag,
        nargs="?",
        const=True,
        default=argparse.SUPPRESS,
        metavar="{true,false}",
        help=f"Resume from the newest complete checkpoint in output_dir. (config: {str(config.auto_resume).lower()})",
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


def _auto_resume_flag(text: str) -> bool:
    try:
        return parse_bool_option("auto_resume", text, source="--auto_resume")
    except ValueError as error:
        raise argparse.ArgumentTypeError(str(error)) from None


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
