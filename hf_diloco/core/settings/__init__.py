"""The settings: `DiLoCoConfig` with its validation and loading (`config.py`), the resume and peer checks that name
each differing field (`settings_check.py`), the DiLoCo scaling laws' rules (`scaling_rules.py`), the sync projection
`hf-diloco plan` uses (`projection.py`) and the outer learning rate's schedule (`outer_schedule.py`).

Floor 2: may import `layout` and `compression`.
"""
