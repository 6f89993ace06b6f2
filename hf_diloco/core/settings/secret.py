"""The job's secret: what every site of one job shares and a stranger does not, from the environment only (a file
named by `HF_DILOCO_JOB_SECRET_FILE`, else `HF_DILOCO_JOB_SECRET`), never a flag that could end up in a command line,
a lock file or a log."""

from __future__ import annotations

import os

SECRET_VARIABLE = "HF_DILOCO_JOB_SECRET"
SECRET_FILE_VARIABLE = "HF_DILOCO_JOB_SECRET_FILE"


def job_secret(secret: str | bytes | None = None) -> bytes | None:
    """The job's secret: `secret` (code that holds it already), else the file `$HF_DILOCO_JOB_SECRET_FILE`, else
    `$HF_DILOCO_JOB_SECRET`; None when none is given (an empty one is none)."""
    if secret is None and os.environ.get(SECRET_FILE_VARIABLE):
        path = os.environ[SECRET_FILE_VARIABLE]
        try:
            with open(path, "rb") as file:
                secret = file.read().strip()
        except OSError as error:
            raise ValueError(f"{SECRET_FILE_VARIABLE} names {path}, which cannot be read: {error.strerror}.") from None
        if not secret:
            raise ValueError(f"{SECRET_FILE_VARIABLE} names {path}, which is empty: write the job's secret there.")
    if secret is None:
        secret = os.environ.get(SECRET_VARIABLE) or None
    if isinstance(secret, str):
        secret = secret.encode()
    return secret or None
