"""A refused input ends a command with its message on one line from the main process and exit status 2.

The package's own errors (and `ValueError`, which every check of an input raises) say what was wrong and what to
do; a traceback per rank around that line hides it. Any other exception keeps its traceback: it is a bug to report.
`HF_DILOCO_TRACEBACK=1` shows the traceback of a refusal too. A message never shows a secret (`redact`).
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable

from ..integrations.redaction import redact
from .launch import record_refusal

REFUSED_STATUS = 2


def exit_status_of(command: Callable[[], int]) -> int:
    """Run `command`; a refusal prints `hf-diloco: error: MESSAGE` on the main process and returns 2."""
    try:
        return command()
    except Exception as error:
        if not is_refusal(error) or os.environ.get("HF_DILOCO_TRACEBACK", "") not in ("", "0"):
            raise
        line = f"hf-diloco: error: {redact(str(error))}"
        # Every rank leaves it for torchrun's report; `hf-diloco launch` prints it once for all of them.
        if not record_refusal(line) and _process_rank() == 0:
            print(line, file=sys.stderr, flush=True)
        return REFUSED_STATUS


def is_refusal(error: BaseException) -> bool:
    """A check of the user's input or of the run's peers refused (as opposed to a failure inside a library)."""
    return isinstance(error, (ValueError, FileNotFoundError)) or type(error).__module__.startswith("hf_diloco.")


def _process_rank() -> int:
    """The launcher's rank of this process (torchrun and accelerate set RANK); 0 when launched alone."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0
