"""One elastic site of the main job for tests/test_elastic_pretrain.py: `hf-diloco pretrain` run as written, each rank
paced, and told by the environment where to die or wait (what a test cannot make a real job do on cue).

    torchrun --standalone --nproc_per_node D tests/scripts/elastic_pretrain_site.py PRETRAIN_FLAGS...

Every inner step takes at least SITE_PACE seconds (default 0.15), so that the job outlasts a restart. SITE_DIE_AT=N:
every rank leaves (`os._exit`, no clean-up, as a lost machine) as it enters the first exchange at or past inner step
N, with the quorum formed (writing died.PID in its working folder first): the other sites' exchange is then in
flight without it. SITE_WAIT_AT=N and
SITE_WAIT_FOR=PATH: after step N each rank writes PATH.waiting.PID and waits (at most 180 s) for PATH, which the test
writes once a restarted site heartbeats to the Lighthouse.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from hf_diloco import DiLoCoTrainer
from hf_diloco.cli.pretrain import main
from hf_diloco.cli.refusals import exit_status_of
from hf_diloco.core.membership.elastic import ElasticRounds

PACE = float(os.environ.get("SITE_PACE", "0.15"))
DIE_AT = int(os.environ.get("SITE_DIE_AT", "0"))
WAIT_AT = int(os.environ.get("SITE_WAIT_AT", "0"))


def paced_training_step(step):
    def training_step(self, *args, **kwargs):
        if WAIT_AT and self.state.global_step == WAIT_AT:
            flag, deadline = Path(os.environ["SITE_WAIT_FOR"]), time.monotonic() + 180
            flag.with_name(f"{flag.name}.waiting.{os.getpid()}").touch()
            while not flag.exists() and time.monotonic() < deadline:
                time.sleep(0.1)
        started = time.monotonic()
        loss = step(self, *args, **kwargs)
        time.sleep(max(0.0, PACE - (time.monotonic() - started)))
        return loss

    return training_step


def dying_attempt(attempt):
    def dying(self, *args, **kwargs):
        if self.engine.inner_step >= DIE_AT:
            Path(f"died.{os.getpid()}").touch()  # in the working folder: the test counts the ranks that got here
            os._exit(3)
        return attempt(self, *args, **kwargs)

    return dying


if __name__ == "__main__":
    DiLoCoTrainer.training_step = paced_training_step(DiLoCoTrainer.training_step)
    if DIE_AT:
        ElasticRounds.attempt = dying_attempt(ElasticRounds.attempt)
    sys.exit(exit_status_of(main))
