"""Who takes part: the start-up agreement and initial broadcast (`agreement.py`), the `Membership` protocol
(`membership.py`), the engine's rules under elastic membership (`elastic.py`) and its exchange behind the inner steps
(`elastic_background.py`). Backends live outside the core (`hf_diloco.backends`).

Floor 5: may import every room below it.
"""

from .. import names_of_modules  # noqa: E402

# `hf_diloco.core.membership` was once a module of its own: its names stay importable from here, loaded on first use.
__getattr__ = names_of_modules(__name__, ("membership",))
