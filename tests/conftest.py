"""The suite's tiers: `make test` runs everything (what CI runs); `make test-fast` leaves out the `slow` and `elastic`
tiers for the inner loop of a change.

- `slow`: the modules that run whole jobs end to end (the main job, Trainers on several processes, the built wheel,
  the benchmarks' smoke runs, subprocess launches). A module is slow by its name below, so a new end-to-end module
  joins the tier by adding one line here, and a test never carries a marker its neighbours lack.
- `elastic`: workers under a torchft Lighthouse; skipped, saying why, where torchft is not installed (the `elastic`
  extra).
- `gpu`: needs CUDA (registered in pyproject.toml); each such test skips with its reason where none is present.
"""

from __future__ import annotations

import importlib.util

import pytest

SLOW_MODULES = {
    "test_bench_flagship",
    "test_bench_package",
    "test_bench_seed_table",
    "test_bench_wan_smoke",
    "test_cli",
    "test_dropin",
    "test_faults",
    "test_peft",
    "test_pipeline_families",
    "test_pipeline_trainer",
    "test_plugin",
    "test_pretrain_script",
    "test_readme_snippet",
    "test_trainer",
    "test_trainer_fsdp",
    "test_trainer_guards",
    "test_trl",
    "test_wheel",
}
ELASTIC_MODULES = {"test_elastic", "test_readme_elastic", "test_heal_trust"}


def pytest_configure(config: pytest.Config) -> None:
    config.addinivalue_line("markers", "slow: runs whole jobs end to end; left out by `make test-fast`")
    config.addinivalue_line("markers", "elastic: workers under a torchft Lighthouse (the `elastic` extra)")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    without_torchft = importlib.util.find_spec("torchft") is None
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        if module in SLOW_MODULES:
            item.add_marker(pytest.mark.slow)
        if module in ELASTIC_MODULES:
            item.add_marker(pytest.mark.elastic)
            if without_torchft:
                item.add_marker(
                    pytest.mark.skip(reason="elastic workers need torchft: pip install 'hf_diloco[elastic]'")
                )
