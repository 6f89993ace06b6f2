"""The configuration owned by the core: strict YAML and environment loading, help that renders, one codec registry."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from hf_diloco.core.compression import adaptive, codecs
from hf_diloco.core.exchange import exchange
from hf_diloco.core.settings.config import DiLoCoConfig, check_known_keys

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize(
    "text, key, closest, where",
    [
        ("inner_stepz: 10\n", "inner_stepz", "inner_steps", ""),
        ("diloco:\n  inner_steps: 10\n  outer_lrr: 0.5\n", "outer_lrr", "outer_lr", " (section diloco:)"),
        ("training:\n  max_steps: 10\n", "training", None, ""),  # no diloco: section, so the mapping is flat
    ],
)
def test_unknown_yaml_key_names_the_key_the_file_and_the_closest_field(tmp_path, text, key, closest, where):
    from hf_diloco import DiLoCoPlugin

    path = tmp_path / "run.yaml"
    path.write_text(text)
    for load in (DiLoCoConfig.from_yaml, lambda p: DiLoCoPlugin(yaml_file=p, environ={})):
        with pytest.raises(ValueError) as error:
            load(path)
        message = str(error.value)
        assert f"{path}{where}" in message and repr(key) in message, message
        if closest:
            assert f"{key!r} (did you mean {closest!r}?)" in message, message


def test_yaml_that_is_not_a_mapping_or_not_yaml_names_the_file(tmp_path):
    path = tmp_path / "broken.yaml"
    path.write_text("diloco: [inner_steps\n")
    with pytest.raises(ValueError, match=f"{re.escape(str(path))} is not valid YAML"):
        DiLoCoConfig.from_yaml(path)
    path.write_text("diloco: 3\n")
    with pytest.raises(ValueError, match="section must be a mapping"):
        DiLoCoConfig.from_yaml(path)


def test_a_key_written_twice_in_a_plugin_or_engine_yaml_is_refused_with_its_lines(tmp_path):
    from hf_diloco import DiLoCoPlugin

    path = tmp_path / "run.yaml"
    path.write_text("diloco:\n  inner_steps: 4\n  compression: fp4\n  inner_steps: 8\n")
    expected = rf"{re.escape(str(path))} is not valid YAML at line 4, column 3: the key 'inner_steps' is written twice"
    with pytest.raises(ValueError, match=expected + r" \(first at line 2\)"):
        DiLoCoConfig.from_yaml(path)
    with pytest.raises(ValueError, match=expected):
        DiLoCoPlugin(yaml_file=path, environ={})


def test_unknown_environment_variable_names_the_closest_variable():
    from hf_diloco import DiLoCoPlugin

    with pytest.raises(ValueError) as error:
        DiLoCoPlugin(environ={"DILOCO_OUTER_MOMENTUN": "0.5"})
    assert "'DILOCO_OUTER_MOMENTUN' (did you mean 'DILOCO_OUTER_MOMENTUM'?)" in str(error.value)


def test_layering_records_where_each_value_came_from(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("inner_steps: 20\ncompression: fp4\n")
    values, sources = DiLoCoConfig.layered_fields({"compression": "int8"}, {"DILOCO_INNER_STEPS": "40"}, path)
    assert (values["inner_steps"], values["compression"], values["outer_lr"]) == (40, "int8", 0.7)
    assert (sources["inner_steps"], sources["compression"], sources["outer_lr"]) == (
        "DILOCO_INNER_STEPS",
        "argument",
        "default",
    )
    with pytest.raises(TypeError, match="'inner_step' \\(did you mean 'inner_steps'\\?\\)"):
        DiLoCoConfig.layered_fields({"inner_step": 1}, {})


def test_check_known_keys_is_a_reusable_helper():
    check_known_keys(["model_type"], ["model_type", "hidden_size"], "run.yaml (section model.config:)")
    with pytest.raises(ValueError, match=r"run.yaml \(section model.config:\): 'hiden_size' \(did you mean"):
        check_known_keys(["hiden_size"], ["model_type", "hidden_size"], "run.yaml (section model.config:)")


def test_every_shipped_diloco_config_passes_the_strict_loader():
    shipped = [*(ROOT / "configs").glob("*.yaml"), *(ROOT / "hf_diloco" / "configs").glob("*.yaml")]
    with_section = [path for path in shipped if "\ndiloco:" in path.read_text()]
    assert len(with_section) >= 3, shipped
    for path in with_section:
        DiLoCoConfig.from_yaml(path)


def test_help_renders_and_no_help_text_has_an_unescaped_percent():
    from transformers import HfArgumentParser

    text = HfArgumentParser(DiLoCoConfig).format_help()
    assert "--entropy_coding" in text and "by about 15 percent" in text
    for f in dataclasses.fields(DiLoCoConfig):
        help_text = f.metadata.get("help", "")
        assert "%" not in re.sub(r"%%|%\(\w+\)s", "", help_text), f.name


def test_every_list_of_codecs_derives_from_the_registry():
    names = tuple(codecs.CODECS)
    assert codecs.COMPRESSIONS == names == exchange.COMPRESSIONS
    compression = next(f for f in dataclasses.fields(DiLoCoConfig) if f.name == "compression")
    assert tuple(compression.metadata["choices"]) == names
    for name in names:
        codec = codecs.make_codec(name, block_size=64)
        numel = max(64, codec.align)
        assert codec.name == name and codecs.CODEC_BITS[name] == codec.bits == codecs.CODECS[name].bits
        assert codec.encoded_nbytes(numel) >= numel * codec.bits // 8  # the bits it declares are what it sends
        assert adaptive.CODEC_BITS[name] == codec.bits and name in adaptive.CODEC_ERROR
    assert adaptive.policy_compressions("sign") == ["sign", "fp4", "fp8", "bf16", "none"]
    assert adaptive.policy_compressions("int8") == ["int8", "bf16", "none"]


@pytest.mark.parametrize(
    "values, field_name",
    [({"divergence_factor": 0.5}, "divergence_factor"), ({"max_skipped_rounds": -1}, "max_skipped_rounds")],
)
def test_guard_settings_are_validated(values, field_name):
    with pytest.raises(ValueError, match=field_name):
        DiLoCoConfig(**values)
    assert DiLoCoConfig(divergence_factor=0.0, max_skipped_rounds=0).fingerprint() != DiLoCoConfig().fingerprint()
