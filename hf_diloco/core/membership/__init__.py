"""Who takes part: the start-up agreement and initial broadcast (`agreement.py`), the `Membership` protocol
(`membership.py`), the engine's rules under elastic membership (`elastic.py`) and its exchange behind the inner steps
(`elastic_background.py`). Backends live outside the core (`hf_diloco.backends`).

Floor 5: may import every room below it.
"""
