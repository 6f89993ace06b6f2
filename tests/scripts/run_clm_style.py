"""An ordinary causal-LM training script in the style of transformers' `examples/pytorch/language-modeling/run_clm.py`.

The HF version and the DiLoCo version differ only in which `Trainer` / `TrainingArguments` are imported: pass
`--use_diloco` (and any DiLoCo field, e.g. `--inner_steps 4`) to swap them. Everything else (argument parsing,
callbacks, `compute_metrics`, `preprocess_logits_for_metrics`, checkpointing and resuming, saving) is unchanged.

The model is a tiny random Llama built from its config and the data are arithmetic token sequences (learnable, no
downloads). `--stop_at_step` stops training as a preempted job would, to test resuming.
"""

import json
import logging
import sys
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from datasets import Dataset
from transformers import HfArgumentParser, LlamaConfig, LlamaForCausalLM, TrainerCallback, default_data_collator

if "--use_diloco" in sys.argv:
    sys.argv.remove("--use_diloco")
    from hf_diloco import DiLoCoTrainer as Trainer
    from hf_diloco import DiLoCoTrainingArguments as TrainingArguments
else:
    from transformers import Trainer, TrainingArguments

logger = logging.getLogger(__name__)


@dataclass
class ModelArguments:
    vocab_size: int = field(default=128, metadata={"help": "Vocabulary size of the random model."})
    hidden_size: int = field(default=32)
    num_hidden_layers: int = field(default=2)
    use_lora: bool = field(default=False, metadata={"help": "Train LoRA adapters (peft) instead of all weights."})


@dataclass
class DataTrainingArguments:
    block_size: int = field(default=16)
    num_train_rows: int = field(default=256)
    num_eval_rows: int = field(default=16)
    data_seed_offset: int = field(default=0)


@dataclass
class RunArguments:
    stop_at_step: int = field(default=0, metadata={"help": "Stop after this step, as a preempted job would (0: off)."})


class EventRecorder(TrainerCallback):
    """Records which callback events fired (and at which step), written per rank at the end of training."""

    def __init__(self):
        self.events = []

    def _record(self, name, state, **extra):
        self.events.append({"event": name, "step": state.global_step, **extra})

    def on_train_begin(self, args, state, control, **kwargs):
        self._record("train_begin", state)

    def on_step_end(self, args, state, control, **kwargs):
        self._record("step_end", state)

    def on_evaluate(self, args, state, control, metrics=None, **kwargs):
        self._record("evaluate", state, metrics=sorted(metrics or {}))

    def on_save(self, args, state, control, **kwargs):
        self._record("save", state)

    def on_log(self, args, state, control, logs=None, **kwargs):
        self._record("log", state, keys=sorted(logs or {}))

    def on_train_end(self, args, state, control, **kwargs):
        self._record("train_end", state)
        out = Path(args.output_dir) / f"events_rank{args.process_index}.json"
        out.write_text(json.dumps(self.events))


class StopAtStep(TrainerCallback):
    def __init__(self, step):
        self.step = step

    def on_step_end(self, args, state, control, **kwargs):
        if self.step and state.global_step >= self.step:
            control.should_training_stop = True


def arithmetic_rows(num_rows, block_size, vocab_size, seed):
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab_size, (num_rows, 1), generator=generator)
    stride = torch.randint(1, 5, (num_rows, 1), generator=generator)
    ids = ((start + stride * torch.arange(block_size)) % vocab_size).tolist()
    return Dataset.from_dict({"input_ids": ids, "labels": ids})


def preprocess_logits_for_metrics(logits, labels):
    if isinstance(logits, tuple):
        logits = logits[0]
    return logits.argmax(dim=-1)


def compute_metrics(eval_preds):
    preds, labels = eval_preds
    labels = labels[:, 1:].reshape(-1)
    preds = preds[:, :-1].reshape(-1)
    return {"accuracy": float(np.mean(preds == labels))}


def main():
    parser = HfArgumentParser((ModelArguments, DataTrainingArguments, RunArguments, TrainingArguments))
    model_args, data_args, run_args, training_args = parser.parse_args_into_dataclasses()
    logging.basicConfig(level=logging.WARNING)

    config = LlamaConfig(
        vocab_size=model_args.vocab_size,
        hidden_size=model_args.hidden_size,
        intermediate_size=2 * model_args.hidden_size,
        num_hidden_layers=model_args.num_hidden_layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=data_args.block_size,
    )
    torch.manual_seed(training_args.seed)
    model = LlamaForCausalLM(config)
    if model_args.use_lora:
        from peft import LoraConfig, get_peft_model

        model = get_peft_model(model, LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj"]))

    seed = training_args.seed + data_args.data_seed_offset
    train_dataset = arithmetic_rows(data_args.num_train_rows, data_args.block_size, model_args.vocab_size, seed)
    eval_dataset = arithmetic_rows(data_args.num_eval_rows, data_args.block_size, model_args.vocab_size, seed + 1)

    trainer = Trainer(
        model=model,
        args=training_args,
        train_dataset=train_dataset if training_args.do_train else None,
        eval_dataset=eval_dataset if training_args.do_eval else None,
        data_collator=default_data_collator,
        compute_metrics=compute_metrics if training_args.do_eval else None,
        preprocess_logits_for_metrics=preprocess_logits_for_metrics if training_args.do_eval else None,
        callbacks=[EventRecorder(), StopAtStep(run_args.stop_at_step)],
    )

    if training_args.do_train:
        train_result = trainer.train(resume_from_checkpoint=training_args.resume_from_checkpoint)
        trainer.save_model()
        metrics = train_result.metrics
        metrics["train_samples"] = len(train_dataset)
        trainer.log_metrics("train", metrics)
        trainer.save_metrics("train", metrics)
        trainer.save_state()

    if training_args.do_eval:
        metrics = trainer.evaluate()
        metrics["perplexity"] = float(np.exp(min(metrics["eval_loss"], 50.0)))
        trainer.log_metrics("eval", metrics)
        trainer.save_metrics("eval", metrics)

    params = {name: p.detach().float().clone() for name, p in trainer.model.named_parameters()}
    torch.save(params, Path(training_args.output_dir) / f"final_params_rank{training_args.process_index}.pt")


if __name__ == "__main__":
    main()
