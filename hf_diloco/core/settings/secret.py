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


def elastic_secret(secret: str | bytes | None = None, insecure: bool = False) -> bytes | None:
    """The job's secret for elastic membership (`job_secret`), required unless `insecure` (`insecure_no_secret`).

    Without it any process that reaches the Lighthouse and a site's ports could join the job, read θg through a heal
    and put its numbers into the exchanges; with it a site serves its state and exchanges only with members that
    prove they hold it (docs/design.md, "Who is inside a job")."""
    found = job_secret(secret)
    if found is None and not insecure:
        raise ValueError(
            "elastic membership (lighthouse) needs the job's secret, so that no process outside the job can join "
            "it, read the global model through a heal or put anything into it: write it to a file only the job's "
            f"user can read and set {SECRET_FILE_VARIABLE} to that file (or set {SECRET_VARIABLE}) on every site, "
            "the same on all of them. On a network nobody else can reach, insecure_no_secret: true runs without one."
        )
    return found
