"""Run the Accelerate block of docs/how-to/accelerate.md (the python fence after the `accelerate-snippet` marker) exactly as it is written,
with a tiny random Llama as `model` and random token rows as the datasets, in the current folder; then save what
tests/test_readme_snippet.py checks for this rank to OUT/rank{r}.pt.

    python tests/scripts/readme_snippet.py OUT NUM_TRAIN_ROWS
"""

import sys
from pathlib import Path

import torch
from torch.utils.data import Dataset

from tests.engine_common import tiny_llama

README = Path(__file__).resolve().parents[2] / "docs" / "how-to" / "accelerate.md"
MARKER = "<!-- accelerate-snippet -->"
VOCAB, SEQ = 64, 16


def readme_snippet() -> str:
    after_marker = README.read_text().split(MARKER, 1)[1]
    return after_marker.split("```python\n", 1)[1].split("\n```", 1)[0]


class TokenRows(Dataset):
    """Random token rows that remember which indices this process read."""

    def __init__(self, num_rows: int, seed: int):
        self.ids = torch.randint(0, VOCAB, (num_rows, SEQ), generator=torch.Generator().manual_seed(seed))
        self.read: list[int] = []

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.read.append(int(index))
        return {"input_ids": self.ids[index], "labels": self.ids[index]}


def main() -> None:
    out, num_rows = Path(sys.argv[1]), int(sys.argv[2])
    train_dataset = TokenRows(num_rows, seed=1)
    namespace = {
        "model": tiny_llama(VOCAB, layers=2, max_positions=SEQ),
        "train_dataset": train_dataset,
        "eval_dataset": TokenRows(32, seed=2),
    }
    exec(compile(readme_snippet(), f"{README}:accelerate-snippet", "exec"), namespace)
    plugin, accelerator = namespace["plugin"], namespace["accelerator"]
    result = {
        "read": train_dataset.read,
        "global": {name: value.clone() for name, value in plugin.global_parameters().items()},
        "stats": dict(plugin.engine.stats),
        "steps": namespace["step"],
    }
    torch.save(result, out / f"rank{accelerator.process_index}.pt")


if __name__ == "__main__":
    main()
