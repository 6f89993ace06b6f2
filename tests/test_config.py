"""DiLoCoConfig: defaults from the papers, validation that names the field, YAML loading, schedule arithmetic."""

from __future__ import annotations

import pytest

from hf_diloco import DiLoCoConfig
from hf_diloco.core.fragments import fragments_launched_at, launch_offset, partition_fragments
from hf_diloco.core.topology import RankLayout


def test_defaults_follow_the_papers():
    config = DiLoCoConfig()
    assert (config.inner_steps, config.outer_lr, config.outer_momentum, config.outer_nesterov) == (100, 0.7, 0.9, True)
    assert (config.num_fragments, config.fragment_pattern, config.sync_delay, config.merge_alpha) == (
        1,
        "strided",
        0,
        0.5,
    )


BAD_VALUES = [
    ({"inner_steps": 0}, "inner_steps"),
    ({"inner_steps": -3}, "inner_steps"),
    ({"inner_steps": 2.5}, "inner_steps"),
    ({"inner_steps": 10, "num_fragments": 3}, "num_fragments"),
    ({"num_fragments": 0}, "num_fragments"),
    ({"inner_steps": 12, "num_fragments": 4, "sync_delay": 3}, "sync_delay"),
    ({"sync_delay": -1}, "sync_delay"),
    ({"merge_alpha": 1.5}, "merge_alpha"),
    ({"merge_alpha": -0.1}, "merge_alpha"),
    ({"outer_lr": -0.1}, "outer_lr"),
    ({"outer_lr": float("nan")}, "outer_lr"),
    ({"outer_momentum": 1.0}, "outer_momentum"),
    ({"outer_momentum": -0.5}, "outer_momentum"),
    ({"compression": "int4"}, "compression"),
    ({"fragment_pattern": "random"}, "fragment_pattern"),
    ({"overlap": "async"}, "overlap"),
    ({"compression_block_size": 1}, "compression_block_size"),
    ({"compression_block_size": 33}, "compression_block_size"),
    ({"compression_scale_dtype": "fp8"}, "compression_scale_dtype"),
    ({"pipeline_stages": 0}, "pipeline_stages"),
    ({"data_parallel_per_worker": 0}, "data_parallel_per_worker"),
    ({"sync_timeout_seconds": 0}, "sync_timeout_seconds"),
    ({"overlap": "eager", "sync_delay": 1, "inner_steps": 10}, "sync_delay"),
    ({"entropy_coding": "yes"}, "entropy_coding"),
    ({"error_feedback": 1}, "error_feedback"),
    ({"outer_nesterov": "false"}, "outer_nesterov"),
]


@pytest.mark.parametrize("kwargs, field_name", BAD_VALUES)
def test_bad_values_raise_naming_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        DiLoCoConfig(**kwargs)


def test_fingerprint_of_earlier_settings_is_unchanged_by_later_fields():
    """Checkpoints written before `entropy_coding` existed carry these fingerprints; they must still load."""
    assert DiLoCoConfig().fingerprint() == "cc7e5fdcd52c7e36"
    streaming = DiLoCoConfig(inner_steps=8, num_fragments=4, sync_delay=1, compression="fp4")
    assert streaming.fingerprint() == "d02001ce26961651"
    assert DiLoCoConfig(entropy_coding=True).fingerprint() != DiLoCoConfig().fingerprint()  # workers must agree on it


def test_yaml_loading_with_section_and_overrides(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("training:\n  learning_rate: 0.1\ndiloco:\n  inner_steps: 20\n  num_fragments: 4\n")
    config = DiLoCoConfig.from_yaml(path, sync_delay=2)
    assert (config.inner_steps, config.num_fragments, config.sync_delay) == (20, 4, 2)
    path.write_text("inner_steps: 7\n")
    assert DiLoCoConfig.from_yaml(path).inner_steps == 7
    path.write_text("inner_steps: 0\n")
    with pytest.raises(ValueError, match="inner_steps"):
        DiLoCoConfig.from_yaml(path)


def test_fingerprint_tracks_shared_fields_only():
    assert DiLoCoConfig().fingerprint() == DiLoCoConfig(sync_timeout_seconds=5).fingerprint()
    assert DiLoCoConfig().fingerprint() != DiLoCoConfig(inner_steps=50).fingerprint()


def test_schedule_launches_one_fragment_every_h_over_p_steps_in_order():
    H, P = 12, 4
    launches = [(t, fragments_launched_at(t, H, P)) for t in range(1, 2 * H + 1)]
    launched = [(t, f[0]) for t, f in launches if f]
    assert launched == [(3, 0), (6, 1), (9, 2), (12, 3), (15, 0), (18, 1), (21, 2), (24, 3)]
    assert [launch_offset(p, 100, 1) for p in range(1)] == [0]


def test_fragment_partition_patterns():
    names = ["embed.weight"] + [f"model.layers.{i}.w" for i in range(6)] + ["norm.weight"]
    strided = partition_fragments(names, 3, "strided", "model.layers")
    assert strided == [
        ["embed.weight", "model.layers.0.w", "model.layers.3.w", "norm.weight"],
        ["model.layers.1.w", "model.layers.4.w"],
        ["model.layers.2.w", "model.layers.5.w"],
    ]
    sequential = partition_fragments(names, 3, "sequential", "model.layers")
    assert sequential[1] == ["model.layers.2.w", "model.layers.3.w"]
    with pytest.raises(ValueError, match="num_fragments"):
        partition_fragments(names, 7, "strided", "model.layers")
    assert partition_fragments(["a", "b", "c", "d"], 2) == [["a", "b"], ["c", "d"]]


def test_balanced_pattern_evens_out_fragment_sizes():
    blocks = [f"model.layers.{i}.w" for i in range(6)]
    equal = {name: 10 for name in blocks}
    # Without parameters outside the stack, and equal blocks, balanced is strided.
    assert partition_fragments(blocks, 3, "balanced", "model.layers", sizes=equal) == partition_fragments(
        blocks, 3, "strided", "model.layers"
    )
    names = ["embed.weight", *blocks, "norm.weight"]
    sizes = {**equal, "embed.weight": 15, "norm.weight": 1}
    # Fragment 0 starts at 16: blocks 0-3 go to fragments 1, 2, 1, 2 (ties to the lowest index), making them 20 each;
    # block 4 to fragment 0 (16), block 5 to fragment 1. Sizes 26, 30, 20 where strided gives 36, 20, 20.
    assert partition_fragments(names, 3, "balanced", "model.layers", sizes=sizes) == [
        ["embed.weight", "model.layers.4.w", "norm.weight"],
        ["model.layers.0.w", "model.layers.2.w", "model.layers.5.w"],
        ["model.layers.1.w", "model.layers.3.w"],
    ]
    with pytest.raises(ValueError, match="balanced"):
        partition_fragments(names, 3, "balanced", "model.layers")


def test_rank_layout():
    layout = RankLayout(world_size=8, pipeline_stages=2, data_parallel=2)
    assert layout.num_workers == 2
    assert layout.worker_ranks(1) == [4, 5, 6, 7]
    assert layout.outer_ranks(dp=1, stage=0) == [2, 6]
    assert layout.data_parallel_ranks(worker=0, stage=1) == [1, 3]
    assert layout.pipeline_ranks(worker=1, dp=0) == [4, 5]
    with pytest.raises(ValueError, match="not divisible"):
        RankLayout(world_size=6, pipeline_stages=2, data_parallel=2)


def test_readme_config_reference_is_current():
    """README's table is generated by scripts/config_reference.py; regenerate it when a field changes."""
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parent.parent
    sys.path.insert(0, str(root / "scripts"))
    from config_reference import config_table

    assert config_table() in (root / "README.md").read_text()


@pytest.mark.parametrize(
    "momentum, inner_steps, total, warns",
    [
        (0.9, 50, 400, True),  # 8 rounds, memory 10 rounds
        (0.9, 50, 1000, False),  # 20 rounds = 2 x memory
        (0.5, 50, 150, True),  # 3 rounds, memory 2 rounds
        (0.5, 50, 200, False),  # 4 rounds = 2 x memory
        (0.0, 50, 50, False),  # no momentum, nothing to remember
    ],
)
def test_short_run_warning_compares_rounds_with_momentum_memory(momentum, inner_steps, total, warns):
    config = DiLoCoConfig(inner_steps=inner_steps, outer_momentum=momentum)
    warning = config.short_run_warning(total)
    assert (warning is not None) == warns
    if warns:
        assert f"outer_momentum={momentum:g}" in warning and f"only {total // inner_steps}" in warning
