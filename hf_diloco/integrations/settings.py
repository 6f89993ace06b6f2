"""The DiLoCo settings as every front-end holds them.

`DiLoCoTrainingArguments` (a `TrainingArguments`) and `DiLoCoPlugin` (filled from arguments, `DILOCO_*` variables
and YAML by `DiLoCoConfig.layered_fields`) both derive from `DiLoCoSettings`: the `DiLoCoConfig` fields, defined once
in the core, plus the conversion to the plain config the engine takes.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ..core.settings.config import LOCAL_ONLY_FIELDS, DiLoCoConfig

# DiLoCo settings each node may choose for itself (where theta_g lives, how long it waits for peers); the others must
# be the same on every rank.
NODE_LOCAL_FIELDS = LOCAL_ONLY_FIELDS


class DiLoCoSettings(DiLoCoConfig):
    """A [`DiLoCoConfig`] held by a front-end that adds fields or behaviour of its own (not a dataclass itself: the
    front-end's class is)."""

    def diloco_config(self) -> DiLoCoConfig:
        """The DiLoCo fields as a plain [`DiLoCoConfig`]."""
        return DiLoCoConfig(**self.diloco_dict())

    def shared_diloco_settings(self) -> dict[str, Any]:
        """The DiLoCo fields every rank must agree on (all but `NODE_LOCAL_FIELDS`)."""
        return {name: value for name, value in self.diloco_dict().items() if name not in NODE_LOCAL_FIELDS}


def overlap_label(settings: Mapping[str, Any]) -> str:
    """
    The overlap mode as a user should read it, from the DiLoCo fields (`diloco_dict()`): the start-up line and the
    model card both say this. Streaming with tau = 0 hides nothing: every exchange blocks. Eager names its estimate
    when it is not Kale et al.'s own share.
    """
    overlap = settings["overlap"]
    if overlap == "streaming" and int(settings["sync_delay"]) == 0:
        return "none (each exchange blocks)"
    if overlap == "eager" and settings.get("eager_estimate", "own_share") != "own_share":
        return f"eager ({settings['eager_estimate']} estimate of each round until its average arrives)"
    return overlap
