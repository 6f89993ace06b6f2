"""Settings compared by name: a checkpoint (or a live peer) against this run, each difference named with both values.

A checkpoint stores the settings themselves (a small JSON-able mapping) beside the fingerprint hash, so a resume with
another `compression` or `inner_steps` is refused naming the field, the checkpoint's value and this run's, instead of
two hashes. States written before the settings were stored carry only the hash; they are still compared by it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from .config import diloco_defaults

if TYPE_CHECKING:
    from .config import DiLoCoConfig


def check_same_settings(
    config: DiLoCoConfig, state: dict, what: str, way_out: str, theirs: str = "the checkpoint", ours: str = "this run"
) -> None:
    """Raise naming each DiLoCo field that differs between `state` and `config`, both values and `way_out` (only the
    hashes for a state written before the fields themselves were stored).

    Args:
        what: the state's owner and verb, e.g. "This DiLoCo checkpoint was written".
        theirs, ours: how the message names the state's side and this process's side.
    """
    mine = {"settings": config.shared_settings(), "fingerprint": config.fingerprint()}
    check_same_published(mine, state, what, way_out, theirs, ours)


def check_same_published(
    mine: dict, state: dict, what: str, way_out: str, theirs: str = "the checkpoint", ours: str = "this run"
) -> None:
    """`check_same_settings` with this side's settings given as the `{"settings", "fingerprint"}` a state carries."""
    if "settings" in state:
        changes = setting_changes(state["settings"], mine["settings"], diloco_defaults())
        if changes:
            raise ValueError(
                f"{what} with other DiLoCo settings ({describe_changes(changes, theirs, ours)}): {way_out} "
                f"({saved_values(changes)})."
            )
    elif state["fingerprint"] != mine["fingerprint"]:
        raise ValueError(
            f"{what} with different DiLoCo settings (fingerprint {state['fingerprint']} != {mine['fingerprint']}); "
            f"{way_out}."
        )


# A value missing on one side (a field added after the state was written) counts as this marker's default.
_ABSENT = object()


def setting_changes(
    saved: Mapping[str, Any], mine: Mapping[str, Any], defaults: Mapping[str, Any] | None = None
) -> list[tuple[str, Any, Any]]:
    """The (name, saved value, this run's value) of every setting that differs, in name order.

    A name present on one side only is compared with `defaults[name]` on the other (a field added since the state
    was written holds its default there), and skipped when there is no default.
    """
    defaults = defaults or {}
    changes = []
    for name in sorted(set(saved) | set(mine)):
        old = saved.get(name, defaults.get(name, _ABSENT))
        new = mine.get(name, defaults.get(name, _ABSENT))
        if old is _ABSENT or new is _ABSENT:
            continue
        if _canonical(old) != _canonical(new):
            changes.append((name, old, new))
    return changes


def describe_changes(
    changes: list[tuple[str, Any, Any]], theirs: str = "the checkpoint", ours: str = "this run"
) -> str:
    """`inner_steps: 4 in the checkpoint, 2 in this run; compression: "none" in ..., "int8" in ...`."""
    return "; ".join(f"{name}: {_shown(old)} in {theirs}, {_shown(new)} in {ours}" for name, old, new in changes)


def saved_values(changes: list[tuple[str, Any, Any]]) -> str:
    """`inner_steps=4, compression="none"`: the values to resume with."""
    return ", ".join(f"{name}={_shown(old)}" for name, old, _ in changes)


def _canonical(value: Any) -> str:
    # Tuples and lists (a value read back from JSON) compare equal; so do 1 and 1.0 as JSON writes them.
    return json.dumps(value, sort_keys=True, default=str)


def _shown(value: Any) -> str:
    text = json.dumps(value, sort_keys=True, default=str)
    return text if len(text) <= 120 else text[:117] + "..."
