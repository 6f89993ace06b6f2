"""`DiLoCoPlugin` for a raw Accelerate loop; defined in `hf_diloco.integrations.accelerate_plugin`."""

from .core.config import ENV_PREFIX
from .integrations.accelerate_plugin import DiLoCoPlugin
from .integrations.rank_state import RANK_STATE_NAME as STATE_NAME

__all__ = ["DiLoCoPlugin", "ENV_PREFIX", "STATE_NAME"]
