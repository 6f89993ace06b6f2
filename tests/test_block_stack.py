"""The block stack of a hybrid model (blocks of several classes): the engine and the pipeline find it with one
finder, so a pipeline stage's fragments are exactly its part of the whole model's."""

from __future__ import annotations

from types import SimpleNamespace

import torch
from torch import nn

from hf_diloco.core.layout.fragments import find_block_stack, partition_fragments
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


class _TwoTowers(nn.Module):
    """A text decoder of `num_hidden_layers` blocks beside a larger audio tower and a vision tower of as many blocks;
    the forward on `input_ids` alone runs the decoder only."""

    def __init__(self, audio_blocks: int):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=2)
        self.embed = nn.Embedding(10, 4)
        self.decoder = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 4)])
        self.vision = nn.ModuleList([nn.Linear(4, 8), nn.Linear(8, 4)])  # more parameters than the decoder
        self.audio = nn.ModuleList([nn.Linear(16, 16) for _ in range(audio_blocks)])

    def forward(self, input_ids, use_cache=False):
        hidden = self.embed(input_ids)
        for block in self.decoder:
            hidden = block(hidden)
        return hidden


def test_the_stack_of_num_hidden_layers_wins_over_a_larger_list_and_a_batch_tells_equal_lists_apart():
    model = _TwoTowers(audio_blocks=3)  # one class, the most parameters, but not num_hidden_layers long
    assert find_block_stack(model) == "vision"  # the larger of the two lists of num_hidden_layers blocks
    assert find_block_stack(model, {"input_ids": torch.tensor([[1, 2, 3]])}) == "decoder"  # the one the forward runs
    assert model.training  # the probe gives every module its own mode back
    del model.config  # without a config: the largest list of blocks of one class
    assert find_block_stack(model) == "audio"
