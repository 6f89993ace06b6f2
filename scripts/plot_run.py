"""`hf-diloco plot` as a script: `python scripts/plot_run.py RUN [RUN ...]` (writes RUN/plots/; `--out` elsewhere)."""

import sys

from hf_diloco.cli.plot import main

if __name__ == "__main__":
    sys.exit(main())
