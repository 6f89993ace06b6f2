"""The DiLoCo settings as every front-end holds them.

`DiLoCoTrainingArguments` (a `TrainingArguments`) and `DiLoCoPlugin` (filled from arguments, `DILOCO_*` variables
and YAML by `DiLoCoConfig.layered_fields`) both derive from `DiLoCoSettings`: the `DiLoCoConfig` fields, defined once
in the core, plus the conversion to the plain config the engine takes.
"""

from __future__ import annotations

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
