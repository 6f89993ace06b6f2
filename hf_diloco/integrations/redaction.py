"""No token, secret or password reaches a file the job writes or a message it prints.

A value is secret when one of these says so:

- the flag that carries it on a command line: `--hub_token`, and any flag whose last word is token, secret, password,
  passwd, credential(s) or key (`--hub-token`, `--auth_token=...`);
- the environment variable that holds it, by the same last words: `HF_TOKEN`, `AWS_SECRET_ACCESS_KEY`,
  `AWS_SESSION_TOKEN`, `HF_DILOCO_JOB_SECRET`, ...; and the contents of the job's secret file
  (`HF_DILOCO_JOB_SECRET_FILE`);
- its form: a Hugging Face token (`hf_` and 30 or more letters and digits), the password of a URL
  (`https://user:PASSWORD@host`).

Wherever a command line, an environment or an arguments object is recorded or quoted in a message, `redact_argv`
and `redact` replace the value of a secret-named flag, and every occurrence of a secret value known from the
environment or the command line (by value, so a token pasted into another flag or a URL goes too), by `***`.
Values shorter than `MIN_SECRET_LENGTH` characters are hidden behind a secret-named flag only: replacing every "1" of
a message would hide the message, not a secret.
"""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Iterable, Mapping, Sequence

REDACTED = "***"
MIN_SECRET_LENGTH = 6
# The file that holds the job's secret (`hf_diloco.core.torchft_membership`): its contents are a secret.
SECRET_FILE_VARIABLE = "HF_DILOCO_JOB_SECRET_FILE"

_SECRET_WORDS = r"(?:token|secret|password|passwd|credentials?|key)"
_SECRET_NAME = re.compile(rf"(?:^|[_.\-]){_SECRET_WORDS}$", re.IGNORECASE)
# `--NAME VALUE` or `--NAME=VALUE` in a text, NAME secret by its last word; the value is one word or a quoted string.
_SECRET_FLAG_IN_TEXT = re.compile(
    rf"(--?(?:[\w.\-]*[_.\-])?{_SECRET_WORDS})(=|\s+)(?!\*\*\*)(\"[^\"]*\"|'[^']*'|[^\s\"']+)", re.IGNORECASE
)
_URL_PASSWORD = re.compile(r"(\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^/\s:@]+):([^@\s/]+)@")
_HF_TOKEN = re.compile(r"\bhf_[A-Za-z0-9]{30,}")


def is_secret_name(name: str) -> bool:
    """Whether a flag (`--hub_token`) or an environment variable (`AWS_SECRET_ACCESS_KEY`) names a secret."""
    return bool(_SECRET_NAME.search(name.lstrip("-")))


def known_secrets(environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> set[str]:
    """The secret values this process knows: of secret-named variables of `environ` (default `os.environ`), of the
    job's secret file, and of secret-named flags of `argv` (default `sys.argv`); each at least `MIN_SECRET_LENGTH`
    characters long."""
    environ = os.environ if environ is None else environ
    argv = sys.argv if argv is None else argv
    values = {value for name, value in environ.items() if is_secret_name(name)}
    values.add(_secret_file_contents(environ.get(SECRET_FILE_VARIABLE, "")))
    values.update(_secret_flag_values(argv))
    return {value for value in values if len(value) >= MIN_SECRET_LENGTH}


def redact_argv(argv: Sequence[str], environ: Mapping[str, str] | None = None) -> list[str]:
    """`argv` with the value of every secret-named flag, and every known secret value, replaced by `***`."""
    secrets = known_secrets(environ, argv)
    redacted, hide_next = [], False
    for token in argv:
        name, has_value, _ = token.partition("=")
        if hide_next:
            token = REDACTED
        elif token.startswith("-") and is_secret_name(name):
            token = f"{name}={REDACTED}" if has_value else token
        else:
            token = _redact_text(token, secrets)
        hide_next = token.startswith("-") and not has_value and is_secret_name(name)
        redacted.append(token)
    return redacted


def redact(text: str, environ: Mapping[str, str] | None = None, argv: Sequence[str] | None = None) -> str:
    """`text` (a message, a recorded command line) with every secret this process knows, the value of every
    secret-named flag, URL passwords and Hugging Face tokens replaced by `***`."""
    text = _redact_text(text, known_secrets(environ, argv))
    return _SECRET_FLAG_IN_TEXT.sub(lambda match: f"{match.group(1)}{match.group(2)}{REDACTED}", text)


def _redact_text(text: str, secrets: Iterable[str]) -> str:
    for value in sorted(secrets, key=len, reverse=True):  # a secret that contains another goes whole
        text = text.replace(value, REDACTED)
    text = _URL_PASSWORD.sub(rf"\1:{REDACTED}@", text)
    return _HF_TOKEN.sub(REDACTED, text)


def _secret_flag_values(argv: Sequence[str]) -> list[str]:
    values = []
    for index, token in enumerate(argv):
        name, has_value, value = token.partition("=")
        if not token.startswith("-") or not is_secret_name(name):
            continue
        if has_value:
            values.append(value)
        elif index + 1 < len(argv):
            values.append(argv[index + 1])
    return values


def _secret_file_contents(path: str) -> str:
    if not path:
        return ""
    try:
        with open(path, "rb") as handle:
            return handle.read(1 << 16).strip().decode(errors="replace")
    except OSError:
        return ""
