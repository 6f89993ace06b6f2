"""The YAML config of `hf-diloco pretrain`: shipped configs by name, strict keys, command-line overrides.

A config is found by path (`--config my_run.yaml`) or by the name of a config shipped inside the package
(`--config tiny_diloco`). Its sections are `trainer`, `model`, `tokenizer`, `data`, `training`, `diloco` and
`auto_resume`; an unknown key in any of them is an error that names the key, the section, the file and the closest
valid key, so a typo never silently falls back to a default.
"""

from __future__ import annotations

import copy
import dataclasses
import difflib
from collections.abc import Iterable, Mapping
from importlib import resources
from pathlib import Path
from typing import Any

import yaml

from ..config import diloco_field_names

SHIPPED_CONFIGS_PACKAGE = "hf_diloco"
SHIPPED_CONFIGS_FOLDER = "configs"
TRAINERS = ("diloco", "ddp")
SECTIONS = ("model", "tokenizer", "data", "training", "diloco")
TOP_LEVEL_KEYS = ("trainer", *SECTIONS, "auto_resume")


@dataclasses.dataclass
class LoadedConfig:
    """A parsed config and where it came from (`source` names the file in every message)."""

    values: dict[str, Any]
    source: str

    @property
    def trainer(self) -> str:
        return self.values.get("trainer", "diloco")

    def section(self, name: str) -> dict[str, Any]:
        return dict(self.values.get(name) or {})


def shipped_config_names() -> list[str]:
    """Names of the configs shipped inside the package (`tiny_diloco`, `streaming_diloco`, ...)."""
    folder = resources.files(SHIPPED_CONFIGS_PACKAGE).joinpath(SHIPPED_CONFIGS_FOLDER)
    return sorted(entry.name[: -len(".yaml")] for entry in folder.iterdir() if entry.name.endswith(".yaml"))


def shipped_config_text(name: str) -> str:
    """The YAML text of a shipped config, by name (with or without `.yaml`)."""
    stem = name[: -len(".yaml")] if name.endswith(".yaml") else name
    if stem not in shipped_config_names():
        raise ValueError(_not_found_message(name))
    return resources.files(SHIPPED_CONFIGS_PACKAGE).joinpath(SHIPPED_CONFIGS_FOLDER, f"{stem}.yaml").read_text()


def read_config(name_or_path: str) -> LoadedConfig:
    """
    Read and check a config given as a file path or as the name of a shipped config.

    Args:
        name_or_path (`str`): a YAML file, or a shipped config name such as `tiny_diloco` (see `hf-diloco configs`).

    Returns:
        `LoadedConfig`: the values and a description of the source for messages.

    Raises:
        `ValueError`: the file does not exist and no shipped config has that name, the YAML does not parse, or a key
            or value is not valid (the message names the key, the section, the file and the closest valid key).
    """
    path = Path(name_or_path)
    if path.is_file():
        text, source = path.read_text(), str(path)
    else:
        text = shipped_config_text(name_or_path)
        source = f"shipped config {Path(name_or_path).stem!r}"
    try:
        values = yaml.safe_load(text)
    except yaml.YAMLError as error:
        raise ValueError(f"{source} is not valid YAML: {error}") from None
    config = LoadedConfig(values=values if values is not None else {}, source=source)
    check_config(config)
    return config


def check_config(config: LoadedConfig) -> None:
    """Raise `ValueError` on an unknown key or a misplaced one in any section, naming the closest valid key."""
    values, source = config.values, config.source
    if not isinstance(values, dict):
        raise ValueError(
            f"{source}: expected a mapping with the keys {list(TOP_LEVEL_KEYS)}, got {type(values).__name__}."
        )
    _check_keys(values, TOP_LEVEL_KEYS, "top level", source)
    if config.trainer not in TRAINERS:
        raise ValueError(f"{source}: trainer must be one of {list(TRAINERS)}, got {config.trainer!r}.")
    auto_resume = values.get("auto_resume", True)
    if not isinstance(auto_resume, bool):
        raise ValueError(
            f"{source}: auto_resume must be true or false (unquoted), got {auto_resume!r} of type "
            f"{type(auto_resume).__name__}."
        )
    valid = section_keys()
    for section in SECTIONS:
        content = values.get(section)
        if content is None:
            continue
        if not isinstance(content, dict):
            raise ValueError(f"{source}: the {section}: section must be a mapping of keys to values, got {content!r}.")
        _check_keys(content, valid[section], f"{section}:", source, other_sections=valid)
    if config.trainer == "ddp" and values.get("diloco"):
        raise ValueError(f"{source}: a diloco: section needs trainer: diloco (this config has trainer: ddp).")


def _check_keys(
    mapping: Mapping[str, Any],
    valid: Iterable[str],
    section: str,
    source: str,
    other_sections: Mapping[str, Iterable[str]] | None = None,
) -> None:
    """Raise `ValueError` for the first key of `mapping` not in `valid`, with the closest valid key."""
    valid = sorted(valid)
    for key in mapping:
        if key in valid:
            continue
        elsewhere = [name for name, keys in (other_sections or {}).items() if key in keys]
        if elsewhere:
            hint = f"it belongs in the {elsewhere[0]}: section"
        else:
            close = difflib.get_close_matches(str(key), valid, n=1)
            hint = f"did you mean {close[0]!r}?" if close else f"valid keys: {', '.join(valid)}"
        raise ValueError(f"{source}: unknown key {key!r} in the {section} section; {hint}")


def section_keys() -> dict[str, frozenset[str]]:
    """The keys each section accepts."""
    from transformers import TrainingArguments

    from ..data import DATA_SPEC_KEYS, TOKENIZER_SPEC_KEYS
    from ..modeling import MODEL_SPEC_KEYS

    return {
        "model": MODEL_SPEC_KEYS,
        "tokenizer": TOKENIZER_SPEC_KEYS,
        "data": DATA_SPEC_KEYS,
        "training": frozenset(f.name for f in dataclasses.fields(TrainingArguments) if f.init),
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
