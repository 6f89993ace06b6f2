"""Model card rendering: settings, data, measured communication vs DDP, front matter."""

import json
import math
import re

import pytest
import yaml
from huggingface_hub import ModelCard

from hf_diloco.core.settings.config import DiLoCoConfig
from hf_diloco.publish.model_card import (
    communication_summary,
    ddp_allreduce_bytes,
    has_diloco_tag,
    never_improved,
    render_model_card,
    template_text,
    write_model_card,
)

pytestmark = pytest.mark.timeout(60)


def _settings(num_workers: int = 4, **overrides) -> dict:
    fields = {"inner_steps": 20, "num_fragments": 2, "sync_delay": 1, "merge_alpha": 0.25, "compression": "int8"}
    fields.update(overrides)
    settings = DiLoCoConfig(**fields).diloco_dict()
    settings["num_workers"] = num_workers
    return settings


def _front_matter(card: str) -> dict:
    match = re.match(r"^---\n(.*?)\n---\n", card, flags=re.S)
    assert match, "card must start with YAML front matter"
    return yaml.safe_load(match.group(1))


def _table_value(card: str, label: str) -> str:
    for line in card.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 2 and cells[0] == label:
            return cells[1]
    raise AssertionError(f"no table row {label!r} in card")


COMMUNICATION = {"bytes_sent": 123_456, "steps": 100, "num_parameters": 10_000, "outer_steps": 10}


def test_front_matter_has_diloco_tag_library_and_base_model():
    card = render_model_card(_settings(), COMMUNICATION, "stdlib", "org/base-model", None)
    meta = _front_matter(card)
    assert meta["library_name"] == "transformers"
    assert meta["tags"][0] == "diloco"
    assert "streaming-diloco" in meta["tags"]
    assert meta["base_model"] == "org/base-model"
    assert ModelCard(card).data.tags == meta["tags"]


def test_membership_is_fixed_or_the_elastic_history():
    fixed = render_model_card(_settings(), COMMUNICATION, "d", None, None)
    assert _table_value(fixed, "Worker membership") == "fixed"
    history = {"exchanges": 8, "fewest_workers": 2, "most_workers": 3, "joins": 1, "drops": 1, "retries": 1,
               "heals": 1, "heal_bytes": 363_932, "heal_seconds": 0.01}  # fmt: skip
    elastic = render_model_card(_settings(), COMMUNICATION, "d", None, None, membership=history)
    assert _table_value(elastic, "Worker membership") == (
        "elastic: 8 exchanges among 2-3 workers; 1 drop(s), 1 join(s), 1 exchange(s) retried; this worker healed "
        "from a peer 1 time(s), 363.93 KB (363,932 bytes)"
    )
    apart = render_model_card(
        _settings(), COMMUNICATION, "d", None, None, membership={**history, "alone_rounds": 4, "alone_from_round": 9}
    )
    assert _table_value(apart, "Worker membership").endswith(
        "; its last 4 round(s), from round 9, ran alone: this model differs from the job's"
    )


def test_what_the_run_met_is_said_under_the_introduction():
    lines = [
        "robust aggregation scaled down the pseudo-gradient of worker 1 in 2 exchanges (robust_clip_factor 5)",
        "site-a trained 4 rounds alone from round 9 to its end: its model differs from the job's (no other site was "
        "in its exchanges since)",
    ]
    card = render_model_card(_settings(), COMMUNICATION, "d", None, None, run_summary=lines)
    introduction, rest = card.split("## Evaluation results", 1)
    assert introduction.endswith(f"copy.\n\n**In this run:** {lines[0]}.\n\n**In this run:** {lines[1]}.\n\n")
    assert "**In this run:**" not in render_model_card(_settings(), COMMUNICATION, "d", None, None)


def test_settings_and_data_rendered():
    card = render_model_card(
        _settings(num_workers=3, pipeline_stages=2, data_parallel_per_worker=4),
        COMMUNICATION,
        "The CPython standard library sources.",
        None,
        None,
    )
    assert _table_value(card, "Inner steps between syncs (H)") == "20"
    assert _table_value(card, "Fragments (P), pattern") == "2, strided"
    assert _table_value(card, "Sync delay (τ)") == "1"
    assert _table_value(card, "Merge weight (α)") == "0.25"
    assert _table_value(card, "Overlap mode") == "streaming"
    assert _table_value(card, "Compression of the exchanged pseudo-gradient").startswith("int8")
    assert _table_value(card, "Workers (M)") == "3"
    assert _table_value(card, "Pipeline stages per worker") == "2"
    assert _table_value(card, "Data-parallel replicas per worker") == "4"
    assert _table_value(card, "Processes in total") == str(3 * 2 * 4)
    assert "The CPython standard library sources." in card
    assert "base_model" not in _front_matter(card)
    assert "$" not in card.split("```")[0], "every placeholder must be filled"


def test_compression_row_names_codec_scales_and_entropy_coding():
    label = "Compression of the exchanged pseudo-gradient"
    fp4 = _settings(compression="fp4", compression_scale_dtype="bf16", entropy_coding=True)
    assert _table_value(render_model_card(fp4, COMMUNICATION, "d", None, None), label) == (
        "fp4 (128 values per scale block, bf16 scales, error feedback off), deflated (lossless entropy coding)"
    )
    plain = render_model_card(_settings(compression="none"), COMMUNICATION, "d", None, None)
    assert _table_value(plain, label) == "none (fp32)"
    sign = _settings(
        compression="sign", compression_block_size=256, error_feedback=True, exchange_pattern="all_gather"
    )
    assert _table_value(render_model_card(sign, COMMUNICATION, "d", None, None), label) == (
        "sign (256 values per scale block, fp32 scales, error feedback on), every worker's vector sent to every "
        "worker (quantized once)"
    )


def test_communication_against_hand_computed_ddp_bytes():
    card = render_model_card(_settings(num_workers=4), COMMUNICATION, "d", None, {"eval_loss": 3.25})
    # Ring all-reduce of fp32 gradients over M=4: 2 * 3/4 * 10_000 params * 4 bytes, for 100 steps.
    ddp = 100 * 2 * 3 / 4 * 10_000 * 4
    assert ddp == 6_000_000
    assert "(6,000,000 bytes)" in _table_value(card, "Bytes DDP would have sent (same steps, per process)")
    assert "(123,456 bytes)" in _table_value(card, "Bytes sent across workers (this run, per process)")
    assert _table_value(card, "This run / DDP").startswith(f"{123_456 / ddp:.4g}")
    assert _table_value(card, "Reduction factor (DDP / this run)") == f"{ddp / 123_456:,.1f}x"
    assert _table_value(card, "Outer syncs") == "10"
    assert _table_value(card, "eval_loss") == "3.25"


def test_communication_summary_and_single_worker():
    assert ddp_allreduce_bytes(1_000, 2, 3) == 3 * 1 * 1_000 * 4
    summary = communication_summary({"bytes_sent": 0, "steps": 5, "num_parameters": 7}, num_workers=1)
    assert summary["ddp_bytes"] == 0 and summary["ratio"] is None and summary["reduction"] is None
    card = render_model_card(_settings(num_workers=1), {"bytes_sent": 0}, "d", None, None)
    assert _table_value(card, "Bytes DDP would have sent (same steps, per process)") == "not recorded"


def test_missing_settings_raise():
    settings = _settings()
    del settings["sync_delay"]
    with pytest.raises(ValueError, match="sync_delay"):
        render_model_card(settings, COMMUNICATION, "d", None, None)
    settings = _settings()
    del settings["num_workers"]
    with pytest.raises(ValueError, match="num_workers"):
        render_model_card(settings, COMMUNICATION, "d", None, None)


def test_write_model_card(tmp_path):
    path = write_model_card(
        tmp_path / "model",
        settings=_settings(overlap="eager", sync_delay=0),
        communication=COMMUNICATION,
        data_description="d",
        base_model=None,
        training_results=None,
        repo_id="me/tiny",
    )
    assert path == tmp_path / "model" / "README.md"
    assert has_diloco_tag(path)
    loaded = ModelCard.load(path)
    assert "diloco-eager-overlap" in loaded.data.tags
    assert 'from_pretrained("me/tiny")' in loaded.text
    assert "DiLoCo with eager overlapped updates" in loaded.text
    assert "| Overlap mode | eager |" in loaded.text
    fitted = render_model_card(_settings(overlap="eager", sync_delay=0, eager_estimate="fitted"), COMMUNICATION, "d")
    assert "| Overlap mode | eager (fitted estimate of each round until its average arrives) |" in fitted


def test_template_ships_inside_the_package():
    assert template_text().startswith("---\n$front_matter\n---")


# ------------------------------------------------------------------------------------------------ front matter


def test_front_matter_carries_license_language_datasets_and_model_index():
    results = {"eval_loss": 3.25, "eval_perplexity": 25.79, "eval_runtime": 1.5}
    card = render_model_card(
        _settings(),
        COMMUNICATION,
        "d",
        None,
        results,
        model_name="tiny",
        license="apache-2.0",
        language="en",
        datasets=["org/corpus"],
        extra_tags=["tiny"],
    )
    meta = _front_matter(card)
    assert (meta["license"], meta["language"], meta["datasets"]) == ("apache-2.0", ["en"], ["org/corpus"])
    assert "tiny" in meta["tags"]
    [index] = meta["model-index"]
    assert index["name"] == "tiny"
    [result] = index["results"]
    assert result["task"]["type"] == "text-generation" and result["dataset"]["name"] == "org/corpus"
    metrics = {metric["name"]: (metric["type"], metric["value"]) for metric in result["metrics"]}
    assert metrics == {"eval_loss": ("loss", 3.25), "eval_perplexity": ("perplexity", 25.79)}  # no timings
    assert _table_value(card, "eval_perplexity") == "25.79"


def test_card_without_final_evaluation_says_so_and_has_no_model_index():
    card = render_model_card(_settings(), COMMUNICATION, "d", None, None)
    assert "Not evaluated after the last outer sync" in card
    assert "model-index" not in _front_matter(card)


def test_training_procedure_sections():
    card = render_model_card(
        _settings(),
        COMMUNICATION,
        "d",
        hyperparameters={"learning_rate": 0.001, "train_batch_size": 8},
        training_log=[{"Training Loss": 6.5, "Epoch": 0.1, "Step": 4, "Validation Loss": 6.25}],
        tokens_seen=1_234_567,
    )
    assert "- learning_rate: 0.001" in card and "- train_batch_size: 8" in card
    assert "| 6.5 | 0.1 | 4 | 6.25 |" in card
    assert "Tokens trained on: 1,234,567, all workers together (`num_input_tokens_seen` in the logs counts one" in card
    assert "- Transformers: " in card and "- PyTorch: " in card and "- hf_diloco: " in card


# ------------------------------------------------------------------------------------------------ DiLoCoTrainer


def _trainer(tmp_path, **overrides):
    import torch
    from datasets import Dataset

    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments
    from tests.engine_common import cpu_trainer_args, tiny_llama

    ids = torch.randint(0, 64, (24, 8), generator=torch.Generator().manual_seed(0)).tolist()
    data = Dataset.from_dict({"input_ids": ids, "labels": ids})
    values = {"max_steps": 6, "per_device_train_batch_size": 2, "inner_steps": 4, "sync_delay": 1, "num_fragments": 2}
    values.update(eval_strategy="steps", eval_steps=3, include_num_input_tokens_seen=True)
    values.update(overrides)
    args = DiLoCoTrainingArguments(**cpu_trainer_args(tmp_path / "out", **values))
    return DiLoCoTrainer(
        model=tiny_llama(64, layers=2, max_positions=8), args=args, train_dataset=data, eval_dataset=data
    )


@pytest.mark.timeout(120)
def test_trainer_card_quotes_the_evaluation_of_the_saved_weights(tmp_path):
    """6 steps with H=4 and tau=1: close() changes theta_g after the evaluation at step 6. The card of the saved
    folder quotes only an evaluation of the final weights, and agrees with all_results.json after save_metrics."""
    trainer = _trainer(tmp_path)
    trainer.train()
    during = [e["eval_loss"] for e in trainer.state.log_history if "eval_loss" in e and e["step"] == 6]
    trainer.save_model()
    card = (tmp_path / "out" / "README.md").read_text()
    assert "Not evaluated after the last outer sync" in card
    assert str(during[-1])[:6] in card.split("### Training results")[1]  # listed as an evaluation during training
    metrics = trainer.evaluate()
    assert metrics["eval_loss"] != during[-1]
    trainer.save_model()
    assert f"| eval_loss | {metrics['eval_loss']:.6g} |" in (tmp_path / "out" / "README.md").read_text()
    trainer.save_metrics("all", {**metrics, "eval_perplexity": 99.5})
    card = (tmp_path / "out" / "README.md").read_text()
    quoted = {m["name"]: m["value"] for m in _front_matter(card)["model-index"][0]["results"][0]["metrics"]}
    assert quoted == {"eval_loss": metrics["eval_loss"], "eval_perplexity": 99.5}
    assert "Tokens trained on: 96, all workers together" in card  # 6 steps x 2 rows x 8 tokens, one worker
    assert 'from_pretrained("' + str(tmp_path / "out") + '")' in card
    assert "- training_steps: 6" in card


@pytest.mark.timeout(120)
def test_the_card_keeps_every_metric_of_all_results_json(tmp_path):
    """What a run_clm.py-style script saves: the training metrics, then the evaluation with `perplexity` added under
    its own name. Every figure of all_results.json is in the card; the evaluation's (not its timings) in model-index."""
    trainer = _trainer(tmp_path, eval_strategy="no")
    train_metrics = trainer.train().metrics
    trainer.save_model()
    trainer.save_metrics("train", train_metrics)
    metrics = trainer.evaluate()
    metrics["perplexity"] = math.exp(metrics["eval_loss"])
    trainer.save_metrics("eval", metrics)
    results = json.loads((tmp_path / "out" / "all_results.json").read_text())
    assert {"perplexity", "train_loss", "epoch", "eval_runtime"} <= set(results)
    card = (tmp_path / "out" / "README.md").read_text()
    for key, value in results.items():
        assert float(_table_value(card, key).replace(",", "")) == pytest.approx(value, rel=1e-5), key
    quoted = {m["name"]: m["value"] for m in _front_matter(card)["model-index"][0]["results"][0]["metrics"]}
    assert quoted == {"eval_loss": metrics["eval_loss"], "perplexity": metrics["perplexity"]}


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    "overrides",
    [
        {"num_fragments": 1, "sync_delay": 0},  # streaming with tau = 0: every exchange blocks
        {},  # P = 2, tau = 1: streaming
        {"num_fragments": 1, "sync_delay": 0, "overlap": "eager", "eager_estimate": "fitted"},
    ],
)
def test_card_and_start_up_line_name_the_same_overlap(tmp_path, caplog, overrides):
    trainer = _trainer(tmp_path, eval_strategy="no", **overrides)
    with caplog.at_level("WARNING"):
        trainer.train()
    [line] = [record.getMessage() for record in caplog.records if record.getMessage().startswith("DiLoCo run:")]
    said = re.search(r"overlap=(.*?), compression=", line).group(1)
    trainer.save_model()
    assert _table_value((tmp_path / "out" / "README.md").read_text(), "Overlap mode") == said


@pytest.mark.timeout(120)
def test_trainer_create_model_card_honours_every_argument(tmp_path):
    trainer = _trainer(tmp_path, eval_strategy="no", hub_model_id="someone/named-by-hub-id")
    trainer.train()
    trainer.create_model_card(
        language="en",
        license="mit",
        tags=["extra"],
        finetuned_from="org/base",
        tasks="text-generation",
        dataset_tags="org/data",
        dataset="Org data",
        dataset_args="v1",
    )
    card = (tmp_path / "out" / "README.md").read_text()
    meta = _front_matter(card)
    assert (meta["language"], meta["license"], meta["base_model"], meta["datasets"]) == (
        ["en"], "mit", "org/base", ["org/data"]
    )  # fmt: skip
    assert "extra" in meta["tags"] and "# named-by-hub-id" in card
    assert 'from_pretrained("someone/named-by-hub-id")' in card
    trainer.evaluate()
    trainer.save_model()  # a later card keeps what create_model_card was given
    card = (tmp_path / "out" / "README.md").read_text()
    meta = _front_matter(card)
    assert meta["license"] == "mit" and meta["model-index"][0]["results"][0]["dataset"]["name"] == "Org data (v1)"
    trainer.create_model_card(model_name="Chosen title")
    assert "# Chosen title" in (tmp_path / "out" / "README.md").read_text()


@pytest.mark.timeout(120)
def test_trainer_card_title_from_run_name(tmp_path):
    trainer = _trainer(tmp_path, eval_strategy="no", run_name="my-run")
    trainer.train()
    trainer.save_model()
    assert "# my-run" in (tmp_path / "out" / "README.md").read_text()


def test_a_model_that_never_improved_on_its_first_evaluation_is_flagged():
    log = [{"Step": 0, "Validation Loss": 4.8}, {"Step": 4, "Validation Loss": 5.1}]
    flagged = render_model_card(_settings(), COMMUNICATION, "d", None, {"eval_loss": 4.9}, training_log=log)
    assert "**Warning:** This model never improved on its first evaluation (validation loss 4.8 at step 0" in flagged
    assert "the final one 4.9" in flagged and "Check the learning rates" in flagged
    improved = render_model_card(_settings(), COMMUNICATION, "d", None, {"eval_loss": 4.7}, training_log=log)
    assert "never improved" not in improved
    assert "never improved" not in render_model_card(_settings(), COMMUNICATION, "d", None, {"eval_loss": 9.0})
    assert never_improved([(0, 4.8)], float("nan")) is not None  # a final NaN loss is no improvement
    assert never_improved([(0, 4.8), (2, float("nan"))], 4.0) is None
