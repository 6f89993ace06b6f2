"""`DiLoCoConfig` and its choices; defined in `hf_diloco.core.config` (the core owns its configuration)."""

from .core.config import (  # noqa: F401
    COMPRESSIONS,
    EAGER_ESTIMATES,
    EXCHANGE_PATTERNS,
    FRAGMENT_PATTERNS,
    OVERLAP_MODES,
    PIPELINE_SCHEDULES,
    SCALE_DTYPES,
    DiLoCoConfig,
    check_known_keys,
    diloco_field_names,
)
