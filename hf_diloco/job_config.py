"""Reading the main job's YAML file and its yes/no options, with errors that name the file, the key and the fix.

config = read_config_file("configs/tiny_diloco.yaml")
auto_resume = parse_bool_option("auto_resume", config.get("auto_resume", True), source="configs/tiny_diloco.yaml")
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import yaml

__all__ = ["parse_bool_option", "read_config_file"]

_TRUE, _FALSE = ("true", "yes", "on", "1"), ("false", "no", "off", "0")


def read_config_file(path: str | os.PathLike) -> dict[str, Any]:
    """
    Read a job's YAML config: a mapping of sections.

    Args:
        path (`str` or `os.PathLike`): the YAML file.

    Returns:
        `dict[str, Any]`: the sections.

    Raises:
        `FileNotFoundError`: when there is no such file.
        `ValueError`: on a YAML syntax error (naming the file, line and column), a YAML tag (only plain YAML is read),
            an empty file (which would otherwise run the whole default job without a word) or a file that is not a
            mapping.
    """
    path = Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"Config file {path} does not exist.")
    try:
        config = yaml.safe_load(path.read_text())
    except yaml.YAMLError as error:
        mark = getattr(error, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(error, "problem", None) or str(error).splitlines()[0]
        raise ValueError(f"{path} is not valid YAML{where}: {problem}. Fix the file and rerun.") from None
    if config is None:
        raise ValueError(
            f"{path} is empty: it would run the whole default job without saying so. Write the sections you mean "
            "(at least `trainer: diloco` to run the defaults on purpose)."
        )
    if not isinstance(config, dict):
        raise ValueError(
            f"{path} must be a mapping of sections (`trainer:`, `model:`, ...), not a {type(config).__name__}."
        )
    return config


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
