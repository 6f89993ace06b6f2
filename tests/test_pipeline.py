"""Pipeline stages of HF decoders (`hf_diloco.parallel.pipeline`) against the unsplit Hugging Face model.

Single-process tests chain the stages by hand; distributed tests run real gloo processes (one per stage, and a 2 x 2
stages x data-parallel grid) and compare every rank against an unsplit reference model trained in the same process
with plain torch (`model(**batch).loss.backward()`, `torch.nn.utils.clip_grad_norm_`, AdamW).
"""

from __future__ import annotations

import copy
import dataclasses
import datetime
import os
import socket
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    GPT2LMHeadModel,
    GPTNeoXConfig,
    GPTNeoXForCausalLM,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    MixtralConfig,
    MixtralForCausalLM,
    OPTConfig,
    OPTForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

from hf_diloco.parallel.pipeline import (
    PipelineMismatchError,
    PipelineRunner,
    PipelineStageModule,
    build_stages,
    causal_lm_loss,
    check_batch,
    check_stages,
    count_loss_tokens,
    plan_pipeline,
    stage_layer_ranges,
)

VOCAB, SEQ = 128, 16
LLAMA_SIZES = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=4, num_attention_heads=4)


def make_model(arch: str, tied: bool = True, attn: str = "sdpa", seed: int = 0) -> nn.Module:
    """A tiny random causal LM; dropout is 0 so a pipelined run can match the unsplit one."""
    builders = {
        "llama": lambda: LlamaForCausalLM(
            LlamaConfig(vocab_size=VOCAB, num_key_value_heads=2, tie_word_embeddings=tied, **LLAMA_SIZES)
        ),
        "mistral": lambda: MistralForCausalLM(
            MistralConfig(vocab_size=VOCAB, num_key_value_heads=2, sliding_window=4, **LLAMA_SIZES)
        ),
        "qwen2": lambda: Qwen2ForCausalLM(
            Qwen2Config(
                vocab_size=VOCAB,
                num_key_value_heads=2,
                use_sliding_window=True,
                sliding_window=4,
                max_window_layers=2,
                **LLAMA_SIZES,
            )
        ),
        "gpt2": lambda: GPT2LMHeadModel(
            GPT2Config(
                vocab_size=VOCAB,
                n_embd=32,
                n_layer=4,
                n_head=4,
                n_positions=64,
                resid_pdrop=0.0,
                embd_pdrop=0.0,
                attn_pdrop=0.0,
                bos_token_id=0,
                eos_token_id=0,
                tie_word_embeddings=tied,
            )
        ),
        "gpt_neox": lambda: GPTNeoXForCausalLM(
            GPTNeoXConfig(vocab_size=VOCAB, max_position_embeddings=64, tie_word_embeddings=tied, **LLAMA_SIZES)
        ),
        "opt": lambda: OPTForCausalLM(
            OPTConfig(
                vocab_size=VOCAB,
                hidden_size=32,
                ffn_dim=64,
                num_hidden_layers=4,
                num_attention_heads=4,
                max_position_embeddings=64,
                word_embed_proj_dim=16,
                dropout=0.0,
                bos_token_id=0,
                eos_token_id=0,
                pad_token_id=1,
            )
        ),
    }
    torch.manual_seed(seed)
    model = builders[arch]()
    model.config._attn_implementation = attn
    return model.train()


def padded_batch(generator: torch.Generator, batch: int = 4) -> dict[str, torch.Tensor]:
    """Random tokens with right padding on row 0 and left padding on the last row (labels -100 on padding)."""
    input_ids = torch.randint(0, VOCAB, (batch, SEQ), generator=generator)
    attention_mask = torch.ones_like(input_ids)
    attention_mask[0, SEQ - 5 :] = 0
    attention_mask[-1, :3] = 0
    labels = input_ids.masked_fill(attention_mask == 0, -100)
    return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


# ----------------------------------------------------------------------------------------------- single process


def test_stage_layer_ranges_are_balanced_and_contiguous():
    assert stage_layer_ranges(10, 4) == [range(0, 3), range(3, 6), range(6, 8), range(8, 10)]
    assert stage_layer_ranges(4, 4) == [range(i, i + 1) for i in range(4)]
    assert stage_layer_ranges(4, 1) == [range(0, 4)]
    with pytest.raises(ValueError, match="fewer than pipeline_stages=5"):
        stage_layer_ranges(4, 5)


def test_unsupported_models_raise_value_error():
    with pytest.raises(ValueError, match="Cannot pipeline a Sequential: its config has no num_hidden_layers"):
        build_stages(nn.Sequential(nn.Linear(2, 2)), 2)
    model = make_model("llama")
    with pytest.raises(ValueError, match="4 decoder blocks, fewer than pipeline_stages=5"):
        build_stages(model, 5)
    with pytest.raises(ValueError, match="n_microbatches >= pipeline_stages"):
        PipelineRunner(model, 0, 2, schedule="1f1b", n_microbatches=1)
    layerdrop = make_model("opt")
    layerdrop.config.layerdrop = 0.1
    with pytest.raises(ValueError, match="OPTForCausalLM with layerdrop > 0"):
        build_stages(layerdrop, 2)


@pytest.mark.parametrize(
    "arch,tied,attn",
    [
        ("llama", False, "sdpa"),
        ("llama", True, "eager"),
        ("mistral", False, "sdpa"),
        ("qwen2", False, "sdpa"),
        ("gpt2", True, "sdpa"),
        ("gpt_neox", False, "eager"),
        ("opt", True, "sdpa"),
    ],
)
def test_chained_stages_match_unsplit_model(arch, tied, attn):
    """Three stages run one after another in one process give the model's loss, logits and gradients."""
    model = make_model(arch, tied=tied, attn=attn)
    reference = copy.deepcopy(model)
    batch = padded_batch(torch.Generator().manual_seed(0), batch=3)
    stages = build_stages(model, 3)
    assert bool(stages[0].plan.tied) == tied

    hidden = batch["input_ids"]
    for stage in stages:
        hidden = stage(hidden, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    loss = causal_lm_loss(hidden, batch["labels"], count_loss_tokens(batch["labels"]))
    loss.backward()
    expected = reference(**batch)
    expected.loss.backward()

    torch.testing.assert_close(loss, expected.loss, rtol=0, atol=1e-5)
    real = batch["attention_mask"].bool()
    torch.testing.assert_close(hidden[real], expected.logits[real], rtol=0, atol=1e-5)
    stage_names = [name for stage in stages for name in stage.state_dict()]
    assert sorted(stage_names) == sorted(reference.state_dict())
    reference_params = dict(reference.named_parameters(remove_duplicate=False))
    for stage in stages:
        for name, param in stage.named_parameters():
            torch.testing.assert_close(param.grad, reference_params[name].grad, rtol=0, atol=1e-5, msg=name)
    assert stages[-1].tied_copy_names == (("lm_head.weight",) if tied else ())


class _EmbeddingSkipBlock(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.linear = nn.Linear(width, width)

    def forward(self, hidden: torch.Tensor, embeddings: torch.Tensor) -> torch.Tensor:
        return hidden + torch.tanh(self.linear(hidden + embeddings))


class _EmbeddingSkipLM(nn.Module):
    """A pure-torch causal LM whose every block also reads the token embeddings (a skip from the model's input)."""

    def __init__(self, vocab: int = 16, width: int = 8, layers: int = 4):
        super().__init__()
        self.config = SimpleNamespace(num_hidden_layers=layers, vocab_size=vocab)
        self.embed = nn.Embedding(vocab, width)
        self.layers = nn.ModuleList(_EmbeddingSkipBlock(width) for _ in range(layers))
        self.head = nn.Linear(width, vocab)

    def forward(self, input_ids, attention_mask=None, use_cache=None):
        embeddings = self.embed(input_ids)
        hidden = embeddings
        for layer in self.layers:
            hidden = layer(hidden, embeddings)
        return SimpleNamespace(logits=self.head(hidden))


def test_start_up_check_refuses_a_model_whose_blocks_need_more_than_the_hidden_state():
    """The embeddings every block reads exist on the first stage only: the chained stages differ, so no stages."""
    torch.manual_seed(0)
    model = _EmbeddingSkipLM()
    with pytest.raises(PipelineMismatchError, match="stages of _EmbeddingSkipLM .* differ by up to"):
        build_stages(model, 2)
    (whole,) = build_stages(model, 1)  # one stage is the model itself
    batch = check_batch(model)
    assert torch.equal(whole(batch["input_ids"], **batch), model(**batch).logits)


def test_start_up_check_refuses_a_deliberately_wrong_split():
    """Stages that skip block 1 of a Llama are refused with the family and the size of the difference."""
    model = make_model("llama", tied=False)
    inputs = check_batch(model)
    plan, expected = plan_pipeline(model, 2, inputs)
    assert check_stages([PipelineStageModule(model, plan, s) for s in range(2)], inputs, expected) == 0.0
    wrong = dataclasses.replace(plan, ranges=(range(0, 1), range(2, 4)))
    with pytest.raises(
        PipelineMismatchError, match=r"of LlamaForCausalLM \(blocks \[\[0\], \[2, 3\]\]\).*differ by up"
    ):
        check_stages([PipelineStageModule(model, wrong, s) for s in range(2)], inputs, expected)
    # A stage that reads a parameter of another stage fails on the released parameter, and is refused too.
    reads_other = dataclasses.replace(plan, before_blocks=())
    with pytest.raises(PipelineMismatchError, match="failed when chained"):
        check_stages([PipelineStageModule(model, reads_other, s) for s in range(2)], inputs, expected)


def test_mixture_of_experts_auxiliary_loss_is_refused():
    config = MixtralConfig(vocab_size=VOCAB, num_key_value_heads=2, num_local_experts=4, **LLAMA_SIZES)
    config.output_router_logits = True
    with pytest.raises(ValueError, match="auxiliary loss .*output_router_logits=False"):
        build_stages(MixtralForCausalLM(config), 2)
    config.output_router_logits = False
    assert len(build_stages(MixtralForCausalLM(config), 2)) == 2


def test_chained_stages_match_unsplit_model_with_gradient_checkpointing():
    model = make_model("llama", tied=True)
    reference = copy.deepcopy(model)
    for m in (model, reference):
        m.activation_checkpointing_enable({"use_reentrant": False})
    assert model.model.layers[0].gradient_checkpointing
    batch = padded_batch(torch.Generator().manual_seed(4), batch=3)
    hidden = batch["input_ids"]
    for stage in build_stages(model, 2):
        hidden = stage(hidden, input_ids=batch["input_ids"], attention_mask=batch["attention_mask"])
    causal_lm_loss(hidden, batch["labels"], count_loss_tokens(batch["labels"])).backward()
    reference(**batch).loss.backward()
    expected = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, expected[name].grad, rtol=0, atol=1e-6, msg=name)


@pytest.mark.parametrize("norm_type", [2.0, float("inf")])
def test_clip_grad_norm_without_process_group_matches_torch(norm_type):
    model = make_model("llama", tied=False)
    reference = copy.deepcopy(model)
    batch = padded_batch(torch.Generator().manual_seed(5))
    runner = PipelineRunner(model, 0, 1, schedule="gpipe", n_microbatches=2)
    runner.train_step(batch)
    reference(**batch).loss.backward()
    expected = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.1, norm_type=norm_type)
    torch.testing.assert_close(runner.clip_grad_norm_(0.1, norm_type=norm_type), expected, rtol=1e-5, atol=1e-7)
    reference_params = dict(reference.named_parameters())
    for name, param in runner.stage_module.named_parameters():
        torch.testing.assert_close(param.grad, reference_params[name].grad, rtol=1e-5, atol=1e-7, msg=name)


# ------------------------------------------------------------------------------------------------- distributed


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def init_worker(rank: int, world_size: int, port: int) -> None:
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=world_size,
        timeout=datetime.timedelta(seconds=90),  # a hung collective fails the test instead of waiting for ever
    )


def reference_step(model: nn.Module, optimizer, batches: list[dict], max_norm: float):
    """Plain unsplit training step: the mean of the replicas' HF losses, torch's clipping, the optimizer step."""
    losses = [model(**b).loss for b in batches]
    torch.stack(losses).mean().backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
    optimizer.step()
    optimizer.zero_grad()
    return [loss.detach() for loss in losses], norm


def assert_tied_copies_identical(runner: PipelineRunner, group) -> None:
    """The first and the last stage (of a 2-stage pipeline) hold bitwise-equal copies of a tied embedding."""
    (weight,) = (param.detach() for param in runner.tied_parameters())
    copies = [torch.empty_like(weight) for _ in range(dist.get_world_size(group))]
    dist.all_gather(copies, weight, group=group)
    assert torch.equal(copies[0], copies[-1])


TWO_STAGE_SCENARIOS = [("llama", False, "1f1b"), ("llama", True, "gpipe"), ("gpt2", True, "1f1b")]


def two_stage_worker(rank: int, port: int, save_dir: str) -> None:
    # One process group for every scenario: spawning and importing transformers costs more than the training.
    init_worker(rank, 2, port)
    for arch, tied, schedule in TWO_STAGE_SCENARIOS:
        try:
            check_two_stage_training(rank, arch, tied, schedule, os.path.join(save_dir, f"{arch}-{tied}"))
        except AssertionError as error:
            raise AssertionError(f"{arch} tied={tied} schedule={schedule}: {error}") from error
    dist.destroy_process_group()


def check_two_stage_training(rank: int, arch: str, tied: bool, schedule: str, save_dir: str) -> None:
    max_norm, steps = 0.5, 3
    model, reference = make_model(arch, tied=tied), make_model(arch, tied=tied)
    runner = PipelineRunner(model, rank, 2, schedule=schedule, n_microbatches=2)
    runner.place_own_stage()  # as a rank with an accelerator starts: the other stages freed, then moved
    assert sum(p.numel() for p in model.parameters()) == sum(p.numel() for p in runner.stage_module.parameters())
    assert all(p.device == runner.device for p in runner.stage_module.parameters())
    optimizer = torch.optim.AdamW(runner.stage_module.parameters(), lr=1e-2, weight_decay=0.1)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2, weight_decay=0.1)
    generator = torch.Generator().manual_seed(1)
    for _ in range(steps):
        batch = padded_batch(generator)
        loss = runner.train_step(batch)
        norm = runner.clip_grad_norm_(max_norm)
        optimizer.step()
        optimizer.zero_grad()
        (ref_loss,), ref_norm = reference_step(reference, ref_optimizer, [batch], max_norm)
        torch.testing.assert_close(loss, ref_loss, rtol=0, atol=1e-5)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
        assert ref_norm > max_norm  # clipping really scaled the gradients

    ref_state = reference.state_dict()
    for name, param in runner.stage_module.named_parameters():
        torch.testing.assert_close(param.detach(), ref_state[name], rtol=0, atol=1e-4, msg=name)
    if tied:
        assert_tied_copies_identical(runner, None)
    torch.testing.assert_close(runner.eval_loss(batch), reference(**batch).loss.detach(), rtol=0, atol=1e-5)

    full = runner.gather_state_dict(dst=0)
    if rank == 0:
        assert sorted(full) == sorted(ref_state)
        runner_state = dict(runner.stage_module.state_dict())
        fresh = make_model(arch, tied=tied, seed=123)
        fresh.load_state_dict(full)
        fresh.save_pretrained(save_dir)
        loaded = AutoModelForCausalLM.from_pretrained(save_dir, attn_implementation="sdpa")
        for name, tensor in loaded.state_dict().items():
            torch.testing.assert_close(tensor, ref_state[name], rtol=0, atol=1e-4, msg=name)
            if name in runner_state:
                assert torch.equal(tensor, runner_state[name]), name
    else:
        assert full is None

    # A 1-stage runner inside a multi-process world stays local (its clipping reduces over nothing), and its
    # checkpoint loads into 2 stages (the tied head may be missing, as in safetensors files).
    single_model = make_model(arch, tied=tied, seed=7)
    single_reference = copy.deepcopy(single_model)
    single = PipelineRunner(single_model, 0, 1, n_microbatches=2)
    torch.testing.assert_close(single.train_step(batch), single_reference(**batch).loss.detach(), rtol=0, atol=1e-5)
    single_reference(**batch).loss.backward()
    expected_norm = torch.nn.utils.clip_grad_norm_(single_reference.parameters(), max_norm)
    torch.testing.assert_close(single.clip_grad_norm_(max_norm), expected_norm, rtol=1e-5, atol=1e-6)
    one_stage_state = single.gather_state_dict()
    if tied:
        del one_stage_state["lm_head.weight"]
    target = PipelineRunner(make_model(arch, tied=tied, seed=8), rank, 2, schedule=schedule, n_microbatches=2)
    target.load_stage_state(one_stage_state)
    first_name = {last: first for first, last in target.plan.tied}
    for name, tensor in target.stage_module.state_dict().items():
        assert torch.equal(tensor, one_stage_state[name if name in one_stage_state else first_name[name]]), name
    expected = single.eval_loss(batch)
    torch.testing.assert_close(target.eval_loss(batch), expected, rtol=0, atol=1e-5)


@pytest.mark.timeout(300)
def test_two_stages_match_unsplit_training(tmp_path):
    """2 stages vs no pipeline, for each of `TWO_STAGE_SCENARIOS` (Llama untied and tied, GPT-2 tied; 1F1B and
    GPipe): same losses on both ranks, same clipped norm, parameters within 1e-4 after AdamW steps on padded batches,
    identical tied copies; the gathered state saves and reloads as a normal HF folder; 1-stage state loads into 2
    stages."""
    mp.spawn(two_stage_worker, args=(free_port(), str(tmp_path)), nprocs=2)


def stage_by_data_parallel_worker(rank: int, port: int) -> None:
    """World of 4 = 2 data-parallel replicas x 2 stages (rank = dp * 2 + stage), as `core/layout/topology.py` lays it out."""
    init_worker(rank, 4, port)
    stage, replica = rank % 2, rank // 2
    pipeline_groups = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    dp_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    model, reference = make_model("llama", tied=True), make_model("llama", tied=True)
    runner = PipelineRunner(
        model, stage, 2, pipeline_groups[replica], "1f1b", n_microbatches=2, data_parallel_group=dp_groups[stage]
    )
    optimizer = torch.optim.AdamW(runner.stage_module.parameters(), lr=1e-2)
    ref_optimizer = torch.optim.AdamW(reference.parameters(), lr=1e-2)
    generator = torch.Generator().manual_seed(3)
    for _ in range(2):
        batch = padded_batch(generator)
        halves = [{k: v[2 * r : 2 * r + 2] for k, v in batch.items()} for r in range(2)]
        loss = runner.train_step(halves[replica])
        norm = runner.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        ref_losses, ref_norm = reference_step(reference, ref_optimizer, halves, 1.0)
        torch.testing.assert_close(loss, ref_losses[replica], rtol=0, atol=1e-5)
        torch.testing.assert_close(norm, ref_norm, rtol=1e-5, atol=1e-6)
    ref_state = reference.state_dict()
    for name, param in runner.stage_module.named_parameters():
        torch.testing.assert_close(param.detach(), ref_state[name], rtol=0, atol=1e-4, msg=name)
    assert_tied_copies_identical(runner, pipeline_groups[replica])
    dist.destroy_process_group()


@pytest.mark.timeout(300)
def test_pipeline_composes_with_data_parallel():
    mp.spawn(stage_by_data_parallel_worker, args=(free_port(),), nprocs=4)
