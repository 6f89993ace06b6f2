"""The main job's YAML file and yes/no options: errors name the file, the line, the key and the fix."""

from __future__ import annotations

import pytest

from hf_diloco.job.config_file import parse_bool_option, read_config_file


def test_a_valid_file_is_read(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("trainer: diloco\ndiloco:\n  inner_steps: 4\n")
    assert read_config_file(path) == {"trainer": "diloco", "diloco": {"inner_steps": 4}}


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("trainer: diloco\ndiloco:\n  inner_steps: [4\n", r"job\.yaml is not valid YAML at line 4, column 1"),
        ("trainer: diloco\n\tbad: tab\n", r"job\.yaml is not valid YAML at line 2"),
        ("trainer: !!python/object:os.system {}\n", r"job\.yaml is not valid YAML at line 1.*constructor"),
        ("", r"job\.yaml is empty: it would run the whole default job.*trainer: diloco"),
        ("# only a comment\n", r"job\.yaml is empty"),
        ("- a\n- b\n", r"job\.yaml must be a mapping of sections"),
        (
            "trainer: diloco\ndiloco:\n  inner_steps: 4\n  outer_lr: 0.5\n  inner_steps: 8\n",
            r"job\.yaml is not valid YAML at line 5, column 3: the key 'inner_steps' is written twice \(first at line "
            r"3\); the second would silently replace the first",
        ),
        (
            "training:\n  max_steps: 3\ndiloco:\n  inner_steps: 4\ntraining:\n  seed: 1\n",
            r"job\.yaml is not valid YAML at line 5, column 1: the key 'training' is written twice \(first at line 1\)",
        ),
    ],
)
def test_a_broken_file_is_an_error_naming_it(tmp_path, text, expected):
    path = tmp_path / "job.yaml"
    path.write_text(text)
    with pytest.raises(ValueError, match=expected):
        read_config_file(path)


def test_a_merge_may_override_the_keys_it_brings(tmp_path):
    path = tmp_path / "job.yaml"
    path.write_text("base: &base\n  inner_steps: 4\n  outer_lr: 0.5\ndiloco:\n  <<: *base\n  inner_steps: 8\n")
    assert read_config_file(path)["diloco"] == {"inner_steps": 8, "outer_lr": 0.5}


def test_a_missing_file_is_named(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope.yaml does not exist"):
        read_config_file(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("value", "expected"),
    [(True, True), (False, False), ("false", False), ("False", False), ("no", False), ("0", False), (0, False),
     ("true", True), ("YES", True), ("on", True), (1, True)],
)  # fmt: skip
def test_bool_options_read_the_words_a_user_writes(value, expected):
    assert parse_bool_option("auto_resume", value) is expected


@pytest.mark.parametrize("value", ["flase", "", None, 2, "resume"])
def test_other_values_are_refused_naming_the_option_and_source(value):
    with pytest.raises(ValueError, match=rf"auto_resume in job\.yaml must be true or false, got {value!r}"):
        parse_bool_option("auto_resume", value, source="job.yaml")
