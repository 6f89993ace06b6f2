"""The main job's YAML config: read once, by one reader, with errors that name the file, the line, the key and the fix.

A config is found by path (`--config my_run.yaml`) or by the name of a config shipped inside the package
(`--config tiny_diloco`). Its sections are `trainer`, `model`, `tokenizer`, `data`, `training`, `diloco` and
`auto_resume`; an unknown key in any of them is an error that names the key, the section, the file and the closest
valid key, so a typo never silently falls back to a default.

    config = read_config("tiny_diloco")              # or a path; LoadedConfig(values, source)
    config.section("data"), config.trainer, config.auto_resume
    config = apply_overrides(config, {"data.block_size": 128, "auto_resume": False})
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
import os
from collections.abc import Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..core.settings.config import check_known_keys, describe_yaml_error, diloco_field_names, load_yaml_strictly

__all__ = [
    "SECTIONS",
    "TRAINERS",
    "LoadedConfig",
    "apply_overrides",
    "parse_bool_option",
    "parse_config_text",
    "read_config",
    "read_config_file",
    "section_keys",
    "shipped_config_names",
    "shipped_config_text",
]

SHIPPED_CONFIGS_PACKAGE = "hf_diloco.configs"  # the repository's top-level configs/ (pyproject.toml's package-dir)
TRAINERS = ("diloco", "ddp")
SECTIONS = ("model", "tokenizer", "data", "training", "diloco")
TOP_LEVEL_KEYS = ("trainer", *SECTIONS, "auto_resume")

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


@dataclasses.dataclass
class LoadedConfig:
    """A parsed config and where it came from (`source` names the file in every message)."""

    values: dict[str, Any]
    source: str

    @property
    def trainer(self) -> str:
        return self.values.get("trainer", "diloco")

    @property
    def auto_resume(self) -> bool:
        """`auto_resume` as a checked boolean (default true): `"false"` is false, `flase` a `ValueError`."""
        return parse_bool_option("auto_resume", self.values.get("auto_resume", True), source=self.source)

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.values.get(name) or {})


def shipped_config_names() -> list[str]:
    """Names of the configs shipped inside the package (`tiny_diloco`, `streaming_diloco`, ...)."""
    folder = resources.files(SHIPPED_CONFIGS_PACKAGE)
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def shipped_config_text(name: str) -> str:
    """The YAML text of a shipped config, by name (with or without `.yaml`)."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if stem not in shipped_config_names():
        raise ValueError(_not_found_message(name))
    return resources.files(SHIPPED_CONFIGS_PACKAGE).joinpath(f"{stem}.yaml").read_text()


def read_config(name_or_path: str | os.PathLike, check_keys: bool = True) -> LoadedConfig:
    """
    Read and check a config given as a file path or as the name of a shipped config.

    Args:
        name_or_path (`str` or `os.PathLike`): a YAML file, or a shipped config name such as `tiny_diloco` (see
            `hf-diloco configs`).
        check_keys (`bool`, *optional*): check every key and value (`check_config`, which imports transformers for
            the `training:` keys); `--help` reads the file without it, the run itself checks.

    Returns:
        `LoadedConfig`: the values and a description of the source for messages.

    Raises:
        `ValueError`: the file does not exist and no shipped config has that name, the YAML does not parse (naming
            the line and column), the file is empty, or a key or value is not valid (naming the key, the section, the
            file and the closest valid key).
    """
    path = Path(name_or_path)
    if path.is_file():
        config = LoadedConfig(values=read_config_file(path), source=str(path))
    else:
        source = f"shipped config {path.stem!r}"
        config = LoadedConfig(values=parse_config_text(shipped_config_text(str(name_or_path)), source), source=source)
    if check_keys:
        check_config(config)
    return config


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """
    Read a job's YAML config file: a mapping of sections (not checked further; `read_config` checks the keys).

    Raises:
        `FileNotFoundError`: when there is no such file.
        `ValueError`: see `parse_config_text`.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Config file {path} does not exist.")
    return parse_config_text(path.read_text(), str(path))


def parse_config_text(text: str, source: str) -> dict[str, Any]:
    """
    Parse the YAML text of a job's config (the one reader of every config the main job reads).

    Args:
        text (`str`): the YAML.
        source (`str`): the file (or shipped config) it came from, named in every message.

    Raises:
        `ValueError`: on a YAML syntax error or a key written twice in one mapping, a duplicate section included
            (naming the line and column), a YAML tag (only plain YAML is read), an
            empty text (which would otherwise run the whole default job without a word) or a text that is not a
            mapping.
    """
    try:
        values = load_yaml_strictly(text)
    except yaml.YAMLError as error:
        raise ValueError(describe_yaml_error(error, source)) from None
    if values is None:
        raise ValueError(
            f"{source} is empty: it would run the whole default job without saying so. Write the sections you mean "
            "(at least `trainer: diloco` to run the defaults on purpose)."
        )
    if not isinstance(values, dict):
        raise ValueError(
            f"{source} must be a mapping of sections (`trainer:`, `model:`, ...), not a {type(values).__name__}."
        )
    return values


def parse_bool_option(name: str, value: Any, source: str = "the config") -> bool:
    """
    A yes/no option from YAML or the command line: a YAML boolean, or one of the words true/false, yes/no, on/off,
    1/0 (any case). `"false"` is false, unlike Python's `bool("false")`.

    Raises:
        `ValueError`: on anything else, naming the option, its value and `source`.
    """
    if isinstance(value, bool):
        return value
    word = str(value).strip().lower()
    if word in _TRUE:
        return True
    if word in _FALSE:
        return False
    raise ValueError(f"{name} in {source} must be true or false, got {value!r}.")


def check_config(config: LoadedConfig) -> None:
    """Raise `ValueError` on an unknown key or a misplaced one in any section, naming the closest valid key."""
    values, source = config.values, config.source
    check_known_keys(values, TOP_LEVEL_KEYS, f"{source} (top level)")
    if config.trainer not in TRAINERS:
        raise ValueError(f"{source}: trainer must be one of {list(TRAINERS)}, got {config.trainer!r}.")
    parse_bool_option("auto_resume", values.get("auto_resume", True), source=source)
    valid = section_keys()
    for section in SECTIONS:
        content = values.get(section)
        if content is None:
            continue
        if not isinstance(content, dict):
            raise ValueError(f"{source}: the {section}: section must be a mapping of keys to values, got {content!r}.")
        _check_section_keys(content, section, source, valid)
    if config.trainer == "ddp" and values.get("diloco"):
        raise ValueError(f"{source}: a diloco: section needs trainer: diloco (this config has trainer: ddp).")


def _check_section_keys(
    content: Mapping[str, Any], section: str, source: str, valid: Mapping[str, frozenset[str]]
) -> None:
    for key in content:
        home = next((name for name, keys in valid.items() if key in keys and name != section), None)
        if key not in valid[section] and home is not None:
            raise ValueError(f"{source}: the key {key!r} of the {section}: section belongs in the {home}: section.")
    check_known_keys(content, sorted(valid[section]), f"{source} (section {section}:)")


def section_keys() -> dict[str, frozenset[str]]:
    """The keys each section accepts."""
    from transformers import TrainingArguments

    from ..integrations.inner_optimizer import InnerOptimizerSettings
    from .data import DATA_SPEC_KEYS, TOKENIZER_SPEC_KEYS
    from .modeling import MODEL_SPEC_KEYS

    return {
        "model": MODEL_SPEC_KEYS,
        "tokenizer": TOKENIZER_SPEC_KEYS,
        "data": DATA_SPEC_KEYS,
        "training": frozenset(
            f.name for cls in (TrainingArguments, InnerOptimizerSettings) for f in dataclasses.fields(cls) if f.init
        ),
        "diloco": frozenset(diloco_field_names()),
    }


def apply_overrides(config: LoadedConfig, overrides: Mapping[str, Any]) -> LoadedConfig:
    """
    A copy of `config` with command-line values set: `trainer`, `auto_resume`, and dotted keys of the `model`,
    `tokenizer` and `data` sections (`data.block_size`, `model.config.hidden_size`, ...). The result is checked.
    """
    values = copy.deepcopy(config.values)
    for dotted, value in overrides.items():
        *parents, leaf = dotted.split(".")
        node = values
        for part in parents:
            node = node.setdefault(part, {})
            if not isinstance(node, dict):
                raise ValueError(f"--{dotted}: {'.'.join(parents)} in {config.source} is not a mapping.")
        node[leaf] = value
    updated = LoadedConfig(values=values, source=f"{config.source} with command-line overrides")
    check_config(updated)
    return updated


def _not_found_message(name: str) -> str:
    names = shipped_config_names()
    close = difflib.get_close_matches(Path(name).stem, names, n=1)
    hint = f" Did you mean {close[0]!r}?" if close else ""
    return (
        f"--config {name!r} is neither a file nor the name of a shipped config ({', '.join(names)}).{hint} "
        "`hf-diloco configs NAME` prints a shipped config to start your own from."
    )
