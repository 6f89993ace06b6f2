"""`hf-diloco pretrain` as a script, so a checkout runs the main job with any launcher:

    accelerate launch --cpu scripts/pretrain.py --config tiny_diloco
    torchrun --nproc_per_node 2 scripts/pretrain.py --config tiny_diloco --use_cpu

`python scripts/pretrain.py --help` lists every flag (see `hf_diloco/cli/pretrain.py`).
"""

import sys

from hf_diloco.cli.pretrain import main
from hf_diloco.cli.refusals import exit_status_of

if __name__ == "__main__":
    sys.exit(exit_status_of(main))
