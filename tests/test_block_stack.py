"""The block stack of a hybrid model (blocks of several classes): the engine and the pipeline find it with one
finder, so a pipeline stage's fragments are exactly its part of the whole model's."""

from __future__ import annotations

from hf_diloco.core.fragments import find_block_stack, partition_fragments
from hf_diloco.parallel.pipeline import build_stages
from hf_diloco.parallel.pipeline import find_block_stack as pipeline_block_stack
from tests.test_pipeline_families import TRAINED_FAMILIES, families


def _tiny_jamba():
    """The tiny Jamba the pipeline-family tests train: Mamba and attention blocks, mixture-of-experts MLPs."""
    with families.quiet():
        return families.build_tiny("jamba", **TRAINED_FAMILIES["jamba"])


def _fragment_of(fragments) -> dict[str, int]:
    return {piece.name: index for index, pieces in enumerate(fragments) for piece in pieces}


def test_hybrid_stages_partition_like_the_whole_model():
    model = _tiny_jamba()
    layers = model.config.num_hidden_layers
    assert len({type(block) for block in model.model.layers}) == 2  # Mamba and attention blocks in one stack
    assert pipeline_block_stack is find_block_stack
    assert find_block_stack(model) == "model.layers"
    for pattern in ("strided", "sequential"):
        shapes = {name: tuple(p.shape) for name, p in model.named_parameters()}
        whole = _fragment_of(partition_fragments(shapes, 2, pattern, find_block_stack(model)))
        assert {whole[name] for name in whole if name.startswith("model.layers.1.")} == {
            1 if pattern == "strided" else 0
        }
        staged: dict[str, int] = {}
        for stage in build_stages(model, 2):
            stage_shapes = {name: tuple(p.shape) for name, p in stage.named_parameters()}
            block_stack = find_block_stack(stage)
            assert block_stack == "model.layers"
            staged.update(_fragment_of(partition_fragments(stage_shapes, 2, pattern, block_stack, num_blocks=layers)))
        assert staged == whole, pattern
