"""Model card rendering: settings, data, measured communication vs DDP, front matter."""

import re

import pytest
import yaml
from huggingface_hub import ModelCard

from hf_diloco.config import DiLoCoConfig
from hf_diloco.model_card import (
    communication_summary,
    ddp_allreduce_bytes,
    has_diloco_tag,
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
