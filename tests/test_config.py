"""DiLoCoConfig: defaults from the papers, validation that names the field, YAML loading, schedule arithmetic."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from hf_diloco import DiLoCoConfig
from hf_diloco.core.layout.fragments import (
    Piece,
    find_block_stack,
    fragments_launched_at,
    launch_offset,
    partition_fragments,
)
from hf_diloco.core.layout.topology import RankLayout
from tests.engine_common import tiny_llama


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
    ({"compression": "sign", "compression_block_size": 12}, "compression_block_size"),
    ({"compression_scale_dtype": "fp8"}, "compression_scale_dtype"),
    ({"exchange_pattern": "ring"}, "exchange_pattern"),
    ({"pipeline_stages": 0}, "pipeline_stages"),
    ({"data_parallel_per_worker": 0}, "data_parallel_per_worker"),
    ({"sync_timeout_seconds": 0}, "sync_timeout_seconds"),
    ({"overlap": "eager", "sync_delay": 1, "inner_steps": 10}, "sync_delay"),
    ({"overlap": "eager", "eager_estimate": "oracle"}, "eager_estimate"),
    ({"eager_estimate": "fitted"}, "eager_estimate"),
    ({"overlap": "delayed", "eager_estimate": "fitted"}, "eager_estimate"),
    ({"entropy_coding": "yes"}, "entropy_coding"),
    ({"error_feedback": 1}, "error_feedback"),
    ({"outer_nesterov": "false"}, "outer_nesterov"),
]


@pytest.mark.parametrize("kwargs, field_name", BAD_VALUES)
def test_bad_values_raise_naming_the_field(kwargs, field_name):
    with pytest.raises(ValueError, match=field_name):
        DiLoCoConfig(**kwargs)


def test_fingerprint_of_earlier_settings_is_unchanged_by_later_fields():
    """Checkpoints written before `entropy_coding` existed carry these fingerprints; they must still load (with the
    settings they were written with, robust clipping off, named here)."""
    assert DiLoCoConfig(robust_clip_factor=0.0).fingerprint() == "cc7e5fdcd52c7e36"
    streaming = DiLoCoConfig(inner_steps=8, num_fragments=4, sync_delay=1, compression="fp4", robust_clip_factor=0.0)
    assert streaming.fingerprint() == "d02001ce26961651"
    assert DiLoCoConfig().fingerprint() != DiLoCoConfig(robust_clip_factor=0.0).fingerprint()  # workers agree on it
    assert DiLoCoConfig(entropy_coding=True).fingerprint() != DiLoCoConfig().fingerprint()  # workers must agree on it
    eager = DiLoCoConfig(overlap="eager")
    assert DiLoCoConfig(overlap="eager", eager_estimate="fitted").fingerprint() != eager.fingerprint()


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


def _names(fragments) -> list[list[str]]:
    return [[piece.name for piece in pieces] for pieces in fragments]


def test_fragment_partition_patterns():
    names = ["embed.weight"] + [f"model.layers.{i}.w" for i in range(6)] + ["norm.weight"]
    shapes = {name: (4, 2) for name in names}
    strided = partition_fragments(shapes, 3, "strided", "model.layers")
    assert _names(strided) == [
        ["embed.weight", "model.layers.0.w", "model.layers.3.w", "norm.weight"],
        ["model.layers.1.w", "model.layers.4.w"],
        ["model.layers.2.w", "model.layers.5.w"],
    ]
    assert all(piece == Piece(piece.name, 0, 4) for pieces in strided for piece in pieces)
    sequential = partition_fragments(shapes, 3, "sequential", "model.layers")
    assert _names(sequential)[1] == ["model.layers.2.w", "model.layers.3.w"]
    with pytest.raises(ValueError, match="num_fragments"):
        partition_fragments(shapes, 7, "strided", "model.layers")
    assert partition_fragments({"a": (), "b": (3,), "c": (2, 2), "d": (1,)}, 2) == [
        [Piece("a", 0, 1), Piece("b", 0, 3)],
        [Piece("c", 0, 2), Piece("d", 0, 1)],
    ]


def test_balanced_pattern_cuts_the_embeddings_and_evens_out_fragment_sizes():
    blocks = {f"model.layers.{i}.w": (5, 2) for i in range(6)}
    # Without parameters outside the stack, and equal blocks, balanced is strided.
    assert partition_fragments(blocks, 3, "balanced", "model.layers") == partition_fragments(
        blocks, 3, "strided", "model.layers"
    )
    # A 7 x 3 embedding is cut into rows [0, 2), [2, 4), [4, 7): 6, 6 and 9 elements; the 1-D norm (1 element) and
    # the 2 x 3 matrix with fewer rows than fragments (6) stay whole in fragment 0 (13). Blocks of 10 then go to
    # fragments 1, 2, 0, 1, 2, 0 (lightest first, ties to the lowest index): 33, 26, 29 where strided gives 48, 20, 20.
    shapes = {"embed.weight": (7, 3), **blocks, "norm.weight": (1,), "tiny.weight": (2, 3)}
    fragments = partition_fragments(shapes, 3, "balanced", "model.layers")
    assert fragments == [
        [Piece("embed.weight", 0, 2), Piece("model.layers.2.w", 0, 5), Piece("model.layers.5.w", 0, 5)]
        + [Piece("norm.weight", 0, 1), Piece("tiny.weight", 0, 2)],
        [Piece("embed.weight", 2, 4), Piece("model.layers.0.w", 0, 5), Piece("model.layers.3.w", 0, 5)],
        [Piece("embed.weight", 4, 7), Piece("model.layers.1.w", 0, 5), Piece("model.layers.4.w", 0, 5)],
    ]
    sizes = [sum(math.prod(piece.shape(shapes[piece.name])) for piece in pieces) for pieces in fragments]
    assert sizes == [33, 26, 29] and sum(sizes) == sum(math.prod(shape) for shape in shapes.values())


def test_balanced_pattern_reaches_one_over_p_on_a_tied_embedding_model():
    """A tied 4096 x 32 embedding is 76% of this model: strided's fragment 0 is 3.3x 1/P, balanced's 1/P."""
    model = tiny_llama(4096, layers=4, max_positions=64, tie_word_embeddings=True)
    shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
    total = sum(math.prod(shape) for shape in shapes.values())
    for pattern, bound in [("strided", 3.4), ("balanced", 1.002)]:
        fragments = partition_fragments(shapes, 4, pattern, find_block_stack(model))
        largest = max(sum(math.prod(p.shape(shapes[p.name])) for p in pieces) for pieces in fragments)
        assert 4 * largest / total <= bound, pattern
        covered = {}
        for pieces in fragments:
            for piece in pieces:
                covered.setdefault(piece.name, []).append((piece.start, piece.stop))
        for name, ranges in covered.items():  # every row of every parameter in exactly one piece
            ranges.sort()
            assert ranges[0][0] == 0 and ranges[-1][1] == shapes[name][0], name
            assert all(a[1] == b[0] for a, b in zip(ranges, ranges[1:])), name


def test_rank_layout():
    layout = RankLayout(world_size=8, pipeline_stages=2, data_parallel=2)
    assert layout.num_workers == 2
    assert layout.worker_ranks(1) == [4, 5, 6, 7]
    assert layout.outer_ranks(dp=1, stage=0) == [2, 6]
    assert layout.data_parallel_ranks(worker=0, stage=1) == [1, 3]
    assert layout.pipeline_ranks(worker=1, dp=0) == [4, 5]
    with pytest.raises(ValueError, match="not divisible"):
        RankLayout(world_size=6, pipeline_stages=2, data_parallel=2)


def test_the_configuration_reference_is_generated_from_the_dataclass(capsys):
    """The docs' configuration reference holds no hand-written field table: the site's build puts there the table
    `hf-diloco configs --fields` prints, generated from `DiLoCoConfig` and its `help` metadata (docs/hooks.py)."""
    import importlib.util
    from types import SimpleNamespace

    from hf_diloco.cli import configs

    assert configs.main(["--fields"]) == 0
    table = capsys.readouterr().out.strip()
    assert table == configs.diloco_fields_table() and "| `inner_steps` | `100` |" in table
    page = Path(__file__).resolve().parent.parent / "docs" / "reference" / "configuration.md"
    source = page.read_text()
    assert "<!-- diloco-fields -->" in source and "| `inner_steps` |" not in source
    spec = importlib.util.spec_from_file_location("docs_hooks", page.parents[1] / "hooks.py")
    hooks = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(hooks)
    page_object = SimpleNamespace(file=SimpleNamespace(abs_src_path=str(page), src_path="reference/configuration.md"))
    assert table in hooks.on_page_markdown(source, page_object, None, None)


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


def test_topk_needs_error_feedback_and_the_all_gather_pattern():
    topk = {"compression": "topk", "error_feedback": True, "exchange_pattern": "all_gather"}
    assert DiLoCoConfig(**topk, topk_density=0.03).fingerprint() != DiLoCoConfig(**topk).fingerprint()
    for change, message in [
        ({"error_feedback": False}, "needs error_feedback: true"),
        ({"exchange_pattern": "reduce_scatter"}, "needs exchange_pattern: all_gather"),
        ({"lowrank_rank": 2}, "cannot be combined with lowrank_rank"),
        ({"topk_density": 0.0}, "topk_density must be a number in"),
    ]:
        with pytest.raises(ValueError, match=message):
            DiLoCoConfig(**{**topk, **change})


def test_error_feedback_decay_is_in_zero_one_and_keeps_the_default_fingerprint():
    base = DiLoCoConfig(compression="sign", error_feedback=True)
    assert DiLoCoConfig(compression="sign", error_feedback=True, error_feedback_decay=1.0).fingerprint() == (
        base.fingerprint()
    )
    assert DiLoCoConfig(compression="sign", error_feedback=True, error_feedback_decay=0.95).fingerprint() != (
        base.fingerprint()
    )
    for value, message in [(0.0, "must be > 0"), (1.5, "must be <= 1"), (float("nan"), "must be a finite number")]:
        with pytest.raises(ValueError, match=f"error_feedback_decay {message}"):
            DiLoCoConfig(error_feedback_decay=value)
