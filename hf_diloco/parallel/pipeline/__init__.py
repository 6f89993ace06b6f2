"""Pipeline parallelism inside one worker (DiLoCoX, arXiv 2506.21263) for any causal LM with a block stack.

A causal LM whose forward runs a stack of `config.num_hidden_layers` blocks (an `nn.ModuleList`; the blocks' classes
may differ, as in hybrid models) is cut into `num_stages` contiguous, balanced block ranges. Every stage runs the
model's *own* forward, with the parts that belong to other stages standing in:

- on every stage but the first, the modules that the forward calls before the blocks and whose parameters belong to
  the first stage (token and position embeddings, ...) return zeros of their output's shape (worked out on the meta
  device), and the blocks before the stage's range return the hidden state received from the previous stage;
- on every stage but the last, the forward stops as soon as the stage's last block returns: that block's hidden state
  is the stage's output;
- the last stage's forward runs to its end and returns the model's logits.

So whatever a family computes outside its blocks (embedding scales, rotary embeddings per layer type, padding and
sliding-window masks, ALiBi, MoE routing inside the blocks, a final logit soft-cap, logit scaling) is computed by the
family's own code where the model computes it, and every block receives exactly the arguments of the unsplit forward.
Tracing the model into one graph per stage (`torch.distributed.pipelining.pipeline`) was the alternative: an exported
graph is fixed to the micro-batch shape it was traced with (another sequence length or batch size needs a new trace),
and on the installed transformers it could not trace a Llama called with a padding mask. The eager forward takes any
shape, data-dependent control flow and attention implementation, and shares its parameters with the model.

Which stage holds what is found by structure and by one probe forward on a small padded batch, never by model class:

- the block stack is the `nn.ModuleList` of `num_hidden_layers` modules that holds the most parameters; the forward
  must run each block once, in index order;
- every other module that holds parameters is held by the first stage when the forward calls it before the blocks (or
  never), by the last stage when it calls it after them, by both when it calls it before and after;
- parameters set directly on a module that contains the block stack (not in one of its children) are held by the
  first and the last stage;
- a parameter held by two stages (a tied input and output embedding, recognised by identity: the same tensor) can only
  be shared by the first and the last stage; both keep a copy, their partial gradients are summed, and the outer loop
  syncs the first stage's copy. Any other parameter shared across stages, or a module with parameters that the forward
  calls between blocks, is refused with an error that names it.

Every stage's `named_parameters()` keep the model's names (`model.layers.3.mlp.up_proj.weight`, `lm_head.weight`), so
fragments, the global copy and checkpoints map a stage's parameters onto the full model.

A start-up check (`check_stages`, run by `build_stages`) chains the stages on the probe batch, each stage with the
parameters of the others released exactly as a real pipeline releases them, and compares the logits with the unsplit
model's on the real (unpadded) tokens; a difference beyond a tight tolerance, or a stage that fails, raises
`PipelineMismatchError` naming the model and the difference: a split is never silently wrong.

The micro-batch schedule (GPipe or 1F1B) comes from `torch.distributed.pipelining`. `PipelineRunner` adds a
token-weighted loss (the sum of per-token cross entropy over labels that are not -100, divided by `num_items_in_batch`
or by the batch's token count, so micro-batching changes nothing; broadcast to every rank of the pipeline), the tied
gradient sum, gradient clipping by the norm of the whole model (the tied matrix counted once), averaging over an
optional data-parallel group, and `gather_state_dict` / `load_stage_state` to write one normal model folder and to
reload it into any stage count.

Limits: a model whose output carries an auxiliary loss (MoE routers with `output_router_logits=True`) is refused, as
the router logits of the other stages never reach the last stage that would add that loss; set
`output_router_logits=False` (the default) to train on the language-model loss alone. `layerdrop` > 0 is refused
(stages would drop blocks independently). Dropout draws other random numbers than the unsplit model would: train with
dropout 0 when the two must match. The probe and the check run in eval mode.

The package is pure torch (it never imports `transformers`): `plan.py` finds the parts and where each runs,
`stages.py` builds the stage modules and checks them, `loss.py` has the loss and the clipping, `runner.py` the
runner.
"""

from __future__ import annotations

from .loss import causal_lm_loss, clip_grad_norm_, count_loss_tokens
from .plan import (
    IGNORE_INDEX,
    PipelineMismatchError,
    PipelinePlan,
    check_batch,
    find_block_stack,
    plan_pipeline,
    stage_layer_ranges,
)
from .runner import PipelineRunner
from .stages import PipelineStageModule, build_stages, check_stages, free_other_stages

__all__ = [
    "IGNORE_INDEX",
    "PipelineMismatchError",
    "PipelinePlan",
    "PipelineRunner",
    "PipelineStageModule",
    "build_stages",
    "causal_lm_loss",
    "check_batch",
    "check_stages",
    "clip_grad_norm_",
    "count_loss_tokens",
    "find_block_stack",
    "free_other_stages",
    "plan_pipeline",
    "stage_layer_ranges",
]
