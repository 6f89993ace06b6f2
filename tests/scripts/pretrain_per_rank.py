"""`hf-diloco pretrain` as one rank of a test launch, with what a real cluster can make differ between ranks.

    torchrun --nproc_per_node 2 tests/scripts/pretrain_per_rank.py [--stall_rank_1_after STEP] PRETRAIN_ARGS

`{rank}` in PRETRAIN_ARGS becomes the process's rank, e.g. `--output_dir base/rank{rank}`: a folder per rank, as on
machines without a shared disk. With `--stall_rank_1_after STEP` (`load_text_dataset`: the corpus is loaded, before
the tokenizer; `train_and_evaluate`: training, evaluation and saving are done, before the end of the job), rank 1
stops answering once that step returns, as a stalled peer would: it sleeps until the launcher ends it.
"""

from __future__ import annotations

import functools
import os
import sys
import time
from collections.abc import Callable
from typing import Any

import hf_diloco.cli.pretrain
import hf_diloco.job.data
from hf_diloco.cli import main

STEPS = {"load_text_dataset": hf_diloco.job.data, "train_and_evaluate": hf_diloco.cli.pretrain}


def stalls_on_rank_1(function: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(function)
    def stalled(*args: Any, **kwargs: Any) -> Any:
        result = function(*args, **kwargs)
        if os.environ["RANK"] == "1":
            print(f"rank 1 stalls after {function.__name__}", file=sys.stderr, flush=True)
            time.sleep(3600)
        return result

    return stalled


if __name__ == "__main__":
    arguments = sys.argv[1:]
    if arguments[:1] == ["--stall_rank_1_after"]:
        step, arguments = arguments[1], arguments[2:]
        setattr(STEPS[step], step, stalls_on_rank_1(getattr(STEPS[step], step)))
    sys.exit(main(["pretrain", *(argument.replace("{rank}", os.environ["RANK"]) for argument in arguments)]))
