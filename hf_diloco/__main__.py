"""`python -m hf_diloco COMMAND ...` (and `torchrun ... -m hf_diloco pretrain ...`): the `hf-diloco` command."""

import sys

from hf_diloco.cli import main

if __name__ == "__main__":
    sys.exit(main())
