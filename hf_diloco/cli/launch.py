"""`hf-diloco launch [TORCHRUN FLAGS] pretrain [ARGS]`: torchrun for the main job, where a refused input ends with its
one message and exit status 2.

    hf-diloco launch --nproc_per_node 2 pretrain --config tiny_diloco --use_cpu

How torchrun reports a rank that exits non-zero (torch.distributed.elastic): its agent logs the failure and the
SIGTERM it sends to the other ranks, and raises `ChildFailedError`, whose traceback and report (per failed rank: exit
code, signal, error file, traceback) are torchrun's last ~30 lines; torchrun itself exits 1, whatever the ranks' exit
status. The report's traceback is a rank's own only when the rank wrote its torchelastic error file (the
`TORCHELASTIC_ERROR_FILE` the agent gives each rank, which `torch.distributed.elastic.multiprocessing.errors.record`
writes). That report is what a crash needs; a refused input (a bad flag value, a bad config: every rank refuses
alike, exit 2) needs its one message. A rank's exit status cannot change torchrun's, so this command runs torchrun's
own agent in its process (`torch.distributed.run.run` with torchrun's flags, as `accelerate launch` does) and tells
the two apart from what the ranks left:

- every failed rank refused (exit 2, the message in its error file, written by `record_refusal`) or was stopped by
  the agent's SIGTERM / SIGKILL after that: the launch prints the lowest rank's message once, as the ranks do alone,
  and exits 2; the agent's log lines about stopping the ranks are dropped;
- anything else (an exception, a signal, an exit status without a refusal behind it): the agent's log lines, the
  ranks' tracebacks and torchrun's `ChildFailedError` report exactly as torchrun gives them, exit 1.

Under plain `torchrun` a refusal still writes the error file, so torchrun's report names the message as the failed
rank's traceback (torchrun's exit status stays 1, and its report follows the message).
"""

from __future__ import annotations

import json
import logging
import os
import signal
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

# Set in the ranks' environment by this command: the launch prints a refusal once, the ranks leave it in their error
# file only.
LAUNCHER_VARIABLE = "HF_DILOCO_LAUNCHER"
REFUSAL_PREFIX = "hf-diloco: error: "
LAUNCHED_COMMANDS = ("pretrain",)
# The torch.distributed.elastic logger that reports a failed rank and the SIGTERM / SIGKILL sent to the others.
_AGENT_PROCESSES_LOGGER = "torch.distributed.elastic.multiprocessing.api"


def record_refusal(line: str) -> bool:
    """
    Leave a rank's refusal (`hf-diloco: error: MESSAGE`) in its torchelastic error file, in the format of
    `ErrorHandler.record_exception`, so torchrun's report shows it as the rank's traceback. Returns whether
    `hf-diloco launch` prints it (this rank was started by it and the file is written): the rank then prints nothing.
    """
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path:
        return False
    data = {"message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}}
    try:
        with open(path, "w") as handle:
            json.dump(data, handle)
    except OSError:
        return False
    return os.environ.get(LAUNCHER_VARIABLE) == "1"


def main(argv: Sequence[str] | None = None) -> int:
    """Run `hf-diloco launch TORCHRUN_FLAGS pretrain ARGS`; returns the exit status (2: refused)."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser, run

    args = _torchrun_arguments(get_args_parser(), list(sys.argv[1:] if argv is None else argv))
    os.environ[LAUNCHER_VARIABLE] = "1"
    with _held_agent_records() as held:
        try:
            run(args)
        except ChildFailedError as error:
            line = refusal_of(error.failures)
            if line is None:
                raise  # a crash: the agent's lines (released on the way out), then torchrun's report
            held.drop()
            print(line, file=sys.stderr, flush=True)
            return 2
    return 0


def refusal_of(failures: dict[int, Any]) -> str | None:
    """The message of the lowest failed rank that refused when every failure is a refusal or a rank the agent
    stopped after one (killed by SIGTERM or SIGKILL, or exiting 128 + the signal's number from a handler of its own);
    None otherwise (a crash: torchrun's report stands)."""
    stopped = (-signal.SIGTERM, -signal.SIGKILL, 128 + signal.SIGTERM, 128 + signal.SIGKILL)
    refusals = {rank: _refusal_line(failure) for rank, failure in failures.items()}
    refused = sorted(rank for rank, line in refusals.items() if line is not None)
    others = [failure.exitcode for rank, failure in failures.items() if rank not in refused]
    if not refused or any(code not in stopped for code in others):
        return None
    return refusals[refused[0]]


def _refusal_line(failure: Any) -> str | None:
    message = failure.message.get("message") if isinstance(failure.message, dict) else None
    if failure.exitcode == 2 and isinstance(message, str) and message.startswith(REFUSAL_PREFIX):
        return message
    return None


def _torchrun_arguments(parser: Any, argv: list[str]) -> Any:
    """torchrun's flags parsed by torchrun's own parser; the script is `python -m hf_diloco COMMAND ARGS`."""
    parser.prog = "hf-diloco launch"
    parser.usage = "hf-diloco launch [TORCHRUN FLAGS] pretrain [ARGS] (torchrun's flags; `torchrun --help` lists them)"
    args = parser.parse_args(["--module", *argv])
    command = args.training_script
    if command not in LAUNCHED_COMMANDS:
        raise ValueError(
            f"hf-diloco launch runs `hf-diloco pretrain` on several processes, e.g. hf-diloco launch --nproc_per_node "
            f"2 pretrain --config tiny_diloco --use_cpu; got {command!r} after the torchrun flags."
        )
    args.training_script, args.training_script_args = "hf_diloco", [command, *args.training_script_args]
    return args


class _HeldRecords(logging.Filter):
    """Holds the records of one logger (returns False for each) until they are released to its handlers or dropped."""

    def __init__(self, logger: logging.Logger):
        super().__init__()
        self.logger, self.records, self.dropped = logger, [], False

    def filter(self, record: logging.LogRecord) -> bool:
        self.records.append(record)
        return False

    def drop(self) -> None:
        self.records, self.dropped = [], True


@contextmanager
def _held_agent_records() -> Iterator[_HeldRecords]:
    """The agent's reports of failed and stopped ranks, held until the launch knows whether a refusal ended it:
    dropped then, released to the logger's handlers otherwise (a crash, a signal to this launch, a clean end)."""
    logger = logging.getLogger(_AGENT_PROCESSES_LOGGER)
    held = _HeldRecords(logger)
    logger.addFilter(held)
    try:
        yield held
    finally:
        logger.removeFilter(held)
        for record in [] if held.dropped else held.records:
            logger.handle(record)
