"""The `hf-diloco` command: every help text formats, every YAML key is a flag, unknown keys are errors that name the
key, the section, the file and the closest valid key, and shipped configs are found by name."""

from __future__ import annotations

import dataclasses
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from transformers import HfArgumentParser, TrainingArguments

from hf_diloco import cli
from hf_diloco.cli import configs, plot, push
from hf_diloco.cli.pretrain_arguments import SECTION_FLAGS, build_parser, parse_command_line
from hf_diloco.core.settings.config import diloco_field_names
from hf_diloco.integrations.trainer import DiLoCoTrainingArguments
from hf_diloco.job import config_file

pytestmark = pytest.mark.timeout(300)

COMMAND = Path(sys.executable).parent / "hf-diloco"


def _write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "run.yaml"
    path.write_text(text)
    return path


# ------------------------------------------------------------------------------------------------ help


def test_training_arguments_help_formats():
    text = HfArgumentParser(DiLoCoTrainingArguments).format_help()
    assert "--inner_steps" in text and "--entropy_coding" in text and "shrink by about 15 percent" in text


def test_every_command_help_formats():
    assert all(name in cli.build_parser().format_help() for name in cli.COMMANDS)
    pretrain = build_parser(config_file.read_config("tiny_diloco"), "diloco").format_help()
    for flag in ("--config", "--trainer", "--auto_resume [{true,false}]", "--data.block_size", "--model.config.FIELD"):
        assert flag in pretrain, flag
    assert "(config: 256)" in pretrain  # the config's value of data.block_size
    # What a user looks for comes first: the config, its sections, the DiLoCo keys, then the Trainer's many keys.
    assert len(pretrain.split("\n\n")[0].splitlines()) == 1, "a one-line usage, not every flag"
    order = ["--config CONFIG", "--data.block_size", "The diloco: section", "--inner_steps", "The training: section"]
    assert [pretrain.index(text) for text in order] == sorted(pretrain.index(text) for text in order)
    assert pretrain.index("--inner_steps") < pretrain.index("--learning_rate")
    for module in (push, plot, configs):
        assert module.build_parser().format_help().startswith(f"usage: hf-diloco {module.__name__.split('.')[-1]}")


def test_pretrain_accepts_every_key_of_the_config_as_a_flag():
    options = set(build_parser(config_file.read_config("tiny_diloco"), "diloco")._option_string_actions)
    keys = config_file.section_keys()
    expected = {f"--{key}" for key in keys["training"] | keys["diloco"]}
    expected |= {f"--{section}.{key}" for section in ("model", "tokenizer", "data") for key in keys[section]}
    expected |= {"--config", "--trainer", "--auto_resume"}
    assert expected <= options, sorted(expected - options)
    assert {section: set(flags) for section, flags in SECTION_FLAGS.items()} == {
        section: set(keys[section]) for section in SECTION_FLAGS
    }


def test_pretrain_help_is_quick_and_help_all_lists_every_trainer_flag(capsys):
    """`--help` reads the config without transformers (seconds of imports); `--help_all` is the full parser's."""
    probe = (
        "import sys\nfrom hf_diloco.cli import main\ntry:\n    main(['pretrain', '--help'])\nexcept SystemExit as e:\n"
        "    assert e.code == 0\nprint(sorted(m for m in ('transformers', 'hf_diloco.core.diloco') if m in sys.modules))"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120, env=env)
    assert result.returncode == 0, result.stderr[-3000:]
    short, imported = result.stdout.rsplit("\n", 2)[0], result.stdout.splitlines()[-1]
    assert imported == "[]", imported
    order = ["--config CONFIG", "--data.block_size", "The diloco: section", "--inner_steps", "The training: section"]
    assert [short.index(text) for text in order] == sorted(short.index(text) for text in order)
    assert "--learning_rate VALUE" in short and "(config: 0.001)" in short  # the config's training: keys
    assert "--adam_beta1" not in short and "--help_all lists them all" in short
    with pytest.raises(SystemExit):
        parse_command_line(["--config", "tiny_diloco", "--help_all"])
    full = capsys.readouterr().out
    assert "--adam_beta1" in full and "--inner_steps" in full and "--help_all" not in full.split("\n\n")[0]


@pytest.mark.timeout(400)
def test_installed_command_help_runs_as_a_subprocess(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    top = subprocess.run([str(COMMAND), "--help"], capture_output=True, text=True, timeout=120, cwd=tmp_path, env=env)
    assert top.returncode == 0 and all(name in top.stdout for name in cli.COMMANDS), top.stderr
    pretrain = subprocess.run(
        [str(COMMAND), "pretrain", "--help"], capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env
    )
    assert pretrain.returncode == 0, pretrain.stderr[-3000:]
    for flag in ("--inner_steps", "--learning_rate", "--config", "--auto_resume", "--data.block_size"):
        assert flag in pretrain.stdout, flag


# ------------------------------------------------------------------------------------------------ parsing


def test_command_line_overrides_every_section(tmp_path):
    parsed = parse_command_line(
        [
            "--config", "tiny_diloco", "--use_cpu", "--output_dir", str(tmp_path / "out"), "--auto_resume", "false",
            "--inner_steps", "10", "--learning_rate", "3e-4", "--data.block_size", "32", "--data.data_files",
            "{train: a.txt}", "--tokenizer.vocab_size", "300", "--model.config.hidden_size=16",
            "--model.config.num_hidden_layers", "1",
        ]
    )  # fmt: skip
    assert parsed.auto_resume is False
    assert (parsed.args.inner_steps, parsed.args.learning_rate) == (10, 3e-4)
    config = parsed.config.values
    assert config["data"]["block_size"] == 32 and config["data"]["data_files"] == {"train": "a.txt"}
    assert config["tokenizer"]["vocab_size"] == 300
    assert config["model"]["config"]["hidden_size"] == 16 and config["model"]["config"]["num_hidden_layers"] == 1
    assert config["model"]["config"]["model_type"] == "llama"  # the rest of the config's model stays
    assert parse_command_line(["--use_cpu", "--auto_resume"]).auto_resume is True


def test_auto_resume_is_one_checked_boolean_in_the_file_and_on_the_command_line(tmp_path, capsys):
    path = _write(tmp_path, config_file.shipped_config_text("tiny_diloco") + "auto_resume: 'false'\n")
    assert parse_command_line(["--config", str(path), "--use_cpu"]).auto_resume is False  # a string "false" is false
    assert parse_command_line(["--config", str(path), "--use_cpu", "--auto_resume", "yes"]).auto_resume is True
    with pytest.raises(ValueError, match="auto_resume in --auto_resume must be true or false, got 'flase'"):
        parse_command_line(["--use_cpu", "--auto_resume", "flase"])


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("diloko:\n  inner_steps: 4\n", ["'diloko'", "top level", "did you mean 'diloco'"]),
        ("diloco:\n  inner_stepz: 4\n", ["'inner_stepz'", "section diloco:", "did you mean 'inner_steps'"]),
        ("data:\n  block_sise: 64\n", ["'block_sise'", "section data:", "did you mean 'block_size'"]),
        ("tokenizer:\n  vocab_sise: 64\n", ["'vocab_sise'", "section tokenizer:", "did you mean 'vocab_size'"]),
        ("model:\n  config_nam: x\n", ["'config_nam'", "section model:", "did you mean 'config_name'"]),
        ("training:\n  learning_rat: 0.1\n", ["'learning_rat'", "section training:", "did you mean 'learning_rate'"]),
        ("training:\n  inner_steps: 4\n", ["'inner_steps'", "training: section", "belongs in the diloco: section"]),
        ("auto_resume: flase\n", ["auto_resume in", "must be true or false, got 'flase'"]),
        ("", ["is empty: it would run the whole default job"]),
        ("trainer: dilocox\n", ["trainer must be one of", "'dilocox'"]),
        ("data: 5\n", ["data: section must be a mapping"]),
        ("trainer: ddp\ndiloco:\n  inner_steps: 4\n", ["a diloco: section needs trainer: diloco"]),
    ],
)
def test_unknown_or_misplaced_keys_name_key_section_file_and_closest(tmp_path, text, expected):
    path = _write(tmp_path, text)
    with pytest.raises(ValueError) as error:
        config_file.read_config(str(path))
    message = str(error.value)
    assert str(path) in message
    for part in expected:
        assert part in message, message


def test_misspelt_flag_of_a_section_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"unrecognized arguments: --data\.blocksize 3\. `hf-diloco pretrain --help`"):
        parse_command_line(["--use_cpu", "--data.blocksize", "3"])


def test_invalid_yaml_names_the_file_line_and_column(tmp_path):
    path = _write(tmp_path, "trainer: diloco\ndiloco: [unclosed\n")
    with pytest.raises(ValueError, match=f"{path} is not valid YAML at line 3, column 1"):
        config_file.read_config(str(path))


def test_config_by_name_or_path(tmp_path):
    by_name = config_file.read_config("tiny_diloco")
    by_file_name = config_file.read_config("tiny_diloco.yaml")
    path = _write(tmp_path, config_file.shipped_config_text("tiny_diloco"))
    assert by_name.values == by_file_name.values == config_file.read_config(str(path)).values
    with pytest.raises(ValueError, match="did you mean 'tiny_diloco'|Did you mean 'tiny_diloco'"):
        config_file.read_config("tiny_diloko")


def test_configs_command_lists_and_prints(capsys):
    assert configs.main([]) == 0
    listing = capsys.readouterr().out
    assert all(
        name in listing
        for name in ("tiny_diloco", "tiny_ddp", "streaming_diloco", "diloco_x", "slow_link", "sign_link")
    )
    # Each description is a whole sentence, wrapped, never cut: the streaming one spans three comment lines.
    assert "deflated (lossless) where that is shorter." in " ".join(listing.split())
    assert all(len(line) <= 119 for line in listing.splitlines())
    assert configs.main(["streaming_diloco"]) == 0
    assert yaml.safe_load(capsys.readouterr().out)["diloco"]["num_fragments"] == 4


def test_every_config_field_has_one_definition():
    """The DiLoCo flags come from DiLoCoConfig's fields, the training flags from TrainingArguments' and the front-ends'
    choice of inner optimizer."""
    from hf_diloco.integrations.inner_optimizer import InnerOptimizerSettings

    keys = config_file.section_keys()
    assert keys["diloco"] == set(diloco_field_names())
    training = {f.name for f in dataclasses.fields(TrainingArguments) if f.init}
    assert keys["training"] == training | {"inner_optimizer"}
    assert {f.name for f in dataclasses.fields(InnerOptimizerSettings)} == {"inner_optimizer"}


# ------------------------------------------------------------------------------------------------ DiLoCo values


def test_diloco_values_come_from_the_flag_then_the_environment_then_the_file_then_the_default(tmp_path):
    path = _write(tmp_path, config_file.shipped_config_text("tiny_diloco"))  # diloco: inner_steps 50, outer_lr 0.5
    environ = {"DILOCO_INNER_STEPS": "20", "DILOCO_OUTER_LR": "0.25", "DILOCO_OUTER_NESTEROV": "false"}
    args = parse_command_line(["--config", str(path), "--use_cpu", "--inner_steps", "10"], environ).args
    assert args.inner_steps == 10  # the command line over DILOCO_INNER_STEPS over the file
    assert args.outer_lr == 0.25 and args.outer_nesterov is False  # DILOCO_* over the file and the default
    assert args.outer_momentum == 0.5  # the file over the default (0.9)
    assert args.merge_alpha == 0.5 and args.sync_timeout_seconds == 1800.0  # defaults
    assert parse_command_line(["--config", str(path), "--use_cpu"], {}).args.inner_steps == 50


def test_a_nan_from_the_file_is_reported_as_set_by_the_file(tmp_path):
    text = config_file.shipped_config_text("tiny_diloco").replace("outer_lr: 0.5", "outer_lr: .nan")
    assert ".nan" in text
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=rf"outer_lr.*\(set: outer_lr by {re.escape(str(path))}\)") as error:
        parse_command_line(["--config", str(path), "--use_cpu"], {})
    assert "the command line" not in str(error.value)


def test_a_key_written_twice_in_the_jobs_file_is_refused_naming_both_lines(tmp_path):
    text = config_file.shipped_config_text("tiny_diloco") + "training:\n  seed: 3\n"
    path = _write(tmp_path, text)
    with pytest.raises(ValueError, match=r"the key 'training' is written twice \(first at line \d+\)"):
        parse_command_line(["--config", str(path), "--use_cpu"], {})


@pytest.mark.parametrize(
    ("environ", "flags", "expected"),
    [
        ({"DILOCO_INNER_STPES": "4"}, [], r"'DILOCO_INNER_STPES' \(did you mean 'DILOCO_INNER_STEPS'\?\)"),
        ({"DILOCO_INNER_STEPS": "abc"}, [], r"DILOCO_INNER_STEPS='abc': field inner_steps must be an integer"),
        ({"DILOCO_INNER_STEPS": "0"}, [], r"inner_steps must be >= 1, got 0\. .*inner_steps by DILOCO_INNER_STEPS"),
        ({}, ["--num_fragments", "3"], r"divisible by num_fragments \(3\).*num_fragments by the command line"),
        ({"DILOCO_INNER_STEPS": "4"}, ["--trainer", "ddp", "--config", "tiny_ddp"], r"DILOCO_INNER_STEPS set in the "
         r"environment, but this run has trainer: ddp, which has no DiLoCo settings: unset the DILOCO_\* variables"),
        ({}, ["--global_copy_device", "gpu"], r"global_copy_device 'gpu' is not a device: .*Set global_copy_device "
         r"to cpu"),
        ({}, ["--global_copy_device", "cuda:99"], r"global_copy_device 'cuda:99' names a device this machine does "
         r"not have \(\d+ cuda device\(s\) here\)"),
        ({}, ["--global_copy_device", "meta"], r"global_copy_device 'meta' names a device this machine does not have"),
    ],
)  # fmt: skip
def test_bad_diloco_values_are_refused_before_anything_is_built_naming_where_they_were_set(environ, flags, expected):
    with pytest.raises(ValueError, match=expected):
        parse_command_line(["--use_cpu", *flags], environ)


def test_the_ddp_baselines_arguments_pickle_no_token():
    import copy
    import pickle

    from hf_diloco.cli.pretrain_arguments import BaselineTrainingArguments

    args = parse_command_line(["--config", "tiny_ddp", "--use_cpu", "--hub_token", "hf_secret_token"], {}).args
    assert isinstance(args, BaselineTrainingArguments) and args.hub_token == "hf_secret_token"
    assert b"hf_secret_token" not in pickle.dumps(args)
    assert copy.deepcopy(args).hub_token == copy.copy(args).hub_token == "hf_secret_token"
