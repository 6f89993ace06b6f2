"""Run the elastic block of docs/how-to/elastic.md (the python fence after the `elastic-snippet` marker) exactly as it is written, as
one site of a job, with a tiny random Llama and SGD, random token batches per site; then save θg and the membership
summary for tests/test_readme_elastic.py.

    python tests/scripts/readme_elastic_snippet.py LIGHTHOUSE SITE SLOT OUT [DIE_AT]

With DIE_AT the process dies (exit code 9, nothing cleaned up) when the snippet asks for the batch of that step.
"""

import os
import sys
from pathlib import Path

import torch

from tests.engine_common import batch_for, tiny_model

README = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "elastic.md"
MARKER = "<!-- elastic-snippet -->"


def readme_snippet() -> str:
    after_marker = README.read_text().split(MARKER, 1)[1]
    return after_marker.split("```python\n", 1)[1].split("\n```", 1)[0]


def main() -> None:
    lighthouse, site, slot, out = sys.argv[1], sys.argv[2], int(sys.argv[3]), Path(sys.argv[4])
    die_at = int(sys.argv[5]) if len(sys.argv) > 5 else None
    model = tiny_model(seed=slot)

    def batch_at(step: int) -> dict:
        if step == die_at:
            os._exit(9)
        return batch_for(slot, step)

    names = {
        "lighthouse": lighthouse,
        "site": site,
        "model": model,
        "optimizer": torch.optim.SGD(model.parameters(), lr=0.05),
        "total_steps": 300,
        "batch_at": batch_at,
        "data_description": "Random token ids, one shard per site.",
    }
    exec(compile(readme_snippet(), str(README), "exec"), names)
    engine = names["engine"]
    torch.save({"global": engine.global_parameters(), "summary": engine.elastic.log.summary()}, out / f"{site}.pt")


if __name__ == "__main__":
    main()
