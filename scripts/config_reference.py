"""Print the markdown table of DiLoCoConfig fields (name, default, help) that README.md's reference section holds.

python scripts/config_reference.py
"""

from __future__ import annotations

import dataclasses
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def config_table() -> str:
    from hf_diloco.config import DiLoCoConfig

    rows = ["| field | default | meaning |", "|---|---|---|"]
    for f in dataclasses.fields(DiLoCoConfig):
        choices = f.metadata.get("choices")
        meaning = f.metadata.get("help", "") + (f" One of: {', '.join(choices)}." if choices else "")
        rows.append(f"| `{f.name}` | `{f.default}` | {meaning} |")
    return "\n".join(rows)


def main() -> None:
    print(config_table())


if __name__ == "__main__":
    main()
