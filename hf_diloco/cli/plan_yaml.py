"""The files `hf-diloco plan` writes: the job's YAML (each value's source as a comment) and the markdown table of
what to expect; and the Llama shape it gives a bare parameter count."""

from __future__ import annotations

import json
import math
from typing import Any

import yaml

from ..core.settings.scaling_rules import Setting
from .plan_model import DEFLATE_SOURCE, Plan, SyncProjection, projection_sources

HEAD_DIM = 64


def llama_parameters(hidden: int, layers: int, vocab_size: int) -> int:
    """Parameters of a Llama with tied embeddings, heads of 64, as many key/value heads and an MLP of 8/3 x hidden
    (rounded up to 64): embeddings, per layer q, k, v, o, gate, up, down and two norms, the final norm."""
    intermediate = _intermediate(hidden)
    return vocab_size * hidden + layers * (4 * hidden * hidden + 3 * hidden * intermediate + 2 * hidden) + hidden


def llama_shape(num_parameters: float, vocab_size: int, block_size: int) -> dict[str, Any]:
    """The Llama config closest to N parameters at this vocabulary, preferring hidden / layers near 128 (as Llama
    3.2 1B and Llama 2 7B) among shapes within 2% of N."""
    shapes = [
        (hidden, layers, llama_parameters(hidden, layers, vocab_size))
        for hidden in [*range(HEAD_DIM, 512, HEAD_DIM), *range(512, 16385, 2 * HEAD_DIM)]
        for layers in range(1, 129)
        if 16 <= hidden / layers <= 512
    ]
    error = {shape: abs(math.log(shape[2] / num_parameters)) for shape in shapes}
    close = [shape for shape in shapes if error[shape] <= math.log(1.02)]
    if close:
        hidden, layers, _ = min(close, key=lambda s: abs(math.log2(s[0] / s[1] / 128)))
    else:
        hidden, layers, _ = min(shapes, key=error.__getitem__)
    if error[(hidden, layers, llama_parameters(hidden, layers, vocab_size))] > math.log(1.5):
        raise ValueError(
            f"--params: no Llama with a {vocab_size}-token vocabulary has about {num_parameters:.3g} parameters (its "
            f"embeddings alone are {vocab_size * HEAD_DIM:,}); give a smaller --vocab_size or a --model config."
        )
    return {
        "model_type": "llama",
        "hidden_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": hidden // HEAD_DIM,
        "num_key_value_heads": hidden // HEAD_DIM,
        "intermediate_size": _intermediate(hidden),
        "max_position_embeddings": block_size,
        "tie_word_embeddings": True,
    }


def _intermediate(hidden: int) -> int:
    return math.ceil(8 * hidden / 3 / 64) * 64


def plan_yaml(plan: Plan, model: dict[str, Any], vocab_size: int, output_dir: str, header: list[str]) -> str:
    """The job's YAML, accepted by `read_config` as is; every planned value carries its source as a comment."""
    laws, choices, sync = plan.laws, plan.choices, plan.sync
    rounds = plan.max_steps // sync.inner_steps
    every = sync.inner_steps * max(1, rounds // 10)  # a whole number of rounds, about ten times a run
    training = [
        ("output_dir", output_dir, None),
        ("max_steps", plan.max_steps, f"{plan.tokens.value:.3g} tokens ({plan.tokens.source}), whole rounds"),
        ("per_device_train_batch_size", plan.per_device_batch, _batch_comment(plan)),
        ("per_device_eval_batch_size", plan.per_device_batch, None),
        ("learning_rate", float(f"{laws.inner_learning_rate.value:.4g}"), laws.inner_learning_rate.source),
        ("adam_beta1", 0.9, "the paper's AdamW (section 3)"),
        ("adam_beta2", 0.99, "the paper's AdamW (section 3)"),
        ("weight_decay", 0.1, "as the shipped configs"),
        ("max_grad_norm", 1.0, None),
        ("warmup_steps", int(laws.warmup_steps.value), laws.warmup_steps.source),
        ("lr_scheduler_type", "cosine", "the paper decays to 5% of the peak; transformers' cosine to 0"),
        ("logging_steps", max(1, min(10, sync.inner_steps)), None),
        ("eval_strategy", "steps", None),
        ("eval_steps", every, "whole rounds"),
        ("save_strategy", "steps", None),
        ("save_steps", every, "whole rounds"),
        ("save_total_limit", 2, None),
        ("include_num_input_tokens_seen", True, None),
        ("seed", 42, None),
        ("dataloader_num_workers", 0, None),
    ]
    if plan.on_gpus:
        training.append(("bf16", True, "bf16 autocast on the GPUs, as the step time assumes"))
    diloco = [
        ("inner_steps", sync.inner_steps, choices["inner_steps"].source),
        ("outer_lr", laws.outer_learning_rate.value, laws.outer_learning_rate.source),
        ("outer_momentum", laws.outer_momentum.value, laws.outer_momentum.source),
        ("outer_nesterov", True, None),
        ("round_policy", choices["round_policy"].value, choices["round_policy"].source),
        ("num_fragments", sync.fragments, choices["num_fragments"].source),
        ("fragment_pattern", "balanced" if sync.fragments > 1 else "strided", _pattern_comment(sync.fragments)),
        ("sync_delay", sync.sync_delay, choices["sync_delay"].source),
        ("merge_alpha", 0.5, None),
        ("overlap", "streaming", "tau > 0 overlaps each exchange with tau steps; 0 blocks"),
        ("compression", sync.compression, choices["compression"].source),
        ("compression_block_size", 128, None),
        ("compression_scale_dtype", "bf16", None),
        ("error_feedback", False, None),
        ("entropy_coding", sync.entropy_coding, choices["entropy_coding"].source),
        ("exchange_pattern", "reduce_scatter", None),
        ("data_parallel_per_worker", plan.sites.gpus_per_site, "GPUs per site: each site is one DiLoCo worker"),
    ]
    lines = [f"# {line}" if line else "#" for line in header]
    lines += ["trainer: diloco", "", "model:"]
    lines += ["  " + line for line in yaml.safe_dump(model, sort_keys=False).splitlines()]
    lines += [
        "",
        "tokenizer:",
        "  # A byte-level BPE tokenizer trained on the training split; `path: <folder>` loads an existing one instead.",
        f"  vocab_size: {vocab_size}",
        "  min_frequency: 2",
        "",
        "data:",
        "  # The stdlib's .py files, a placeholder that starts the run: give your corpus (path / data_files /",
        f"  # text_column, see the shipped configs), at least {plan.tokens.value:.3g} tokens for the budget.",
        "  source: stdlib",
        "  validation_split_percentage: 5",
        f"  block_size: {plan.block_size}",
        "",
        "training:",
        *_entries(training),
        "",
        "diloco:",
        *_entries(diloco),
    ]
    return "\n".join(lines) + "\n"


def _entries(entries: list[tuple[str, Any, str | None]]) -> list[str]:
    lines = []
    for key, value, comment in entries:
        text = json.dumps(value) if isinstance(value, (bool, str)) else _number(value)
        lines.append(f"  {key}: {text}" + (f"   # {comment}" if comment else ""))
    return lines


def _number(value: float) -> str:
    if isinstance(value, int):
        return str(value)
    text = f"{value:.6g}"
    return text if any(c in text for c in ".e") else f"{text}.0"


def _batch_comment(plan: Plan) -> str:
    laws = plan.laws
    return (
        f"{laws.global_batch_tokens.value:,.0f} tokens = {laws.global_batch_sequences.value:.1f} sequences of "
        f"{plan.block_size} over {plan.sites.workers} site(s) x {plan.sites.gpus_per_site} GPU(s), rounded "
        f"({plan.global_batch_tokens:,} tokens per step); {laws.global_batch_tokens.source}"
    )


def _pattern_comment(fragments: int) -> str:
    if fragments == 1:
        return "one fragment: the pattern does not matter"
    return 'every fragment 1/P of the model, as the shipped streaming_diloco config (BENCHMARKS.md "Bytes")'


def plan_table(plan: Plan, command: str) -> str:
    """The markdown the command prints and writes beside the YAML: the settings, then what to expect."""
    laws, sync, sites = plan.laws, plan.sync, plan.sites
    settings: list[tuple[str, Any, str]] = [
        ("N (parameters)", f"{plan.num_parameters:,.0f}", "--params / --model"),
        ("sites x GPUs", f"{sites.workers} x {sites.gpus_per_site}", "--workers, --gpus_per_site"),
        (
            "link (slowest site)",
            f"{sites.link_gbit:g} Gbit/s, latency {sites.latency_seconds * 1e3:g} ms",
            "--link, --latency_ms",
        ),  # fmt: skip
        ("step time (fastest site)", f"{plan.step_seconds.value:.3g} s", plan.step_seconds.source),
        ("inner learning rate", f"{laws.inner_learning_rate.value:.4g}", laws.inner_learning_rate.source),
        (
            "global batch",
            f"{plan.global_batch_tokens:,} tokens ({plan.per_device_batch} x {plan.block_size} per GPU)",
            laws.global_batch_tokens.source,
        ),  # fmt: skip
        (
            "outer lr / momentum",
            f"{laws.outer_learning_rate.value:.3g} / {laws.outer_momentum.value:g}",
            laws.outer_learning_rate.source,
        ),  # fmt: skip
        ("warmup", f"{laws.warmup_steps.value:.0f} steps", laws.warmup_steps.source),
        ("max_steps", f"{plan.max_steps:,}", f"{plan.tokens.value:.3g} tokens: {plan.tokens.source}"),
    ]
    settings += [(name, _show(choice), choice.source) for name, choice in plan.choices.items()]
    sources = projection_sources()
    codec = _codec(sync)
    expect = [
        ("bytes per sync", f"{sync.bytes_per_sync / 1e9:.3g} GB per site's link, "
         f"{sync.bytes_per_sync / sites.gpus_per_site / 1e9:.3g} GB per rank ({codec}, 1/{sync.fragments} of the model)",
         "reduce_scatter: 2 (M - 1) / M x the encoded fragment, each of the D ranks its 1/D share "
         "(hf_diloco.core.settings.projection)" + (f"; {DEFLATE_SOURCE}" if sync.entropy_coding else "")),
        ("time per sync", f"{sync.transfer:.3g} s", sources["link efficiency"]),
        ("host CPU per sync per rank", f"{sync.main:.3g} s training thread + {sync.exchange:.3g} s exchange",
         f"{sources['host rates']}; a rank handles 1/{sites.gpus_per_site} of the fragment"),
        ("inside a site per sync", f"{sync.inside_site:.3g} s", sources["inside a site"]),
        ("compute per sync period", f"{sync.period:.3g} s (H / P = {sync.inner_steps // sync.fragments} steps), "
         f"{sync.window:.3g} s overlapped", "the step time above"),
        ("compute utilization", f"{sync.utilization:.1%}",
         "period / (period + training thread + max(0, exchange + transfer - overlap)), hf_diloco.core.settings.projection"),
        ("wall-clock", f"{plan.wall_seconds / 3600:,.1f} h ({plan.max_steps:,} steps)",
         "max_steps x step time / utilization" + (" (the slowest site's step under steps)" if len(set(sites.speeds)) > 1
                                                  else "")),
    ]  # fmt: skip
    tried = "\n".join(
        f"| {t.inner_steps} | {t.fragments} | {t.sync_delay} | {_codec(t)} | {t.period:.3g} s | {t.transfer:.3g} s | "
        f"{t.utilization:.1%}{' (chosen)' if t is sync else ''} |"
        for t in plan.tried
    )
    warnings = "".join(f"\n- {warning}" for warning in laws.warnings)
    return (
        f"# hf-diloco plan\n\n`{command}`\n\n## Settings\n\n{_table(settings)}\n\n## What to expect\n\n{_table(expect)}"
        "\n\n## Options, in order of preference (the first to reach the target is chosen)\n\n"
        "| H | P | tau | codec | compute per sync | time per sync | utilization |\n|---|---|---|---|---|---|---|\n"
        f"{tried}\n" + (f"\n## Extrapolations\n{warnings}\n" if warnings else "")
    )


def _codec(sync: SyncProjection) -> str:
    return sync.compression + (" + deflate" if sync.entropy_coding else "")


def _table(rows: list[tuple[str, Any, str]]) -> str:
    return "\n".join(["| | value | source |", "|---|---|---|", *(f"| {a} | {b} | {c} |" for a, b, c in rows)])


def _show(choice: Setting) -> str:
    return str(choice.value).lower() if isinstance(choice.value, bool) else str(choice.value)
