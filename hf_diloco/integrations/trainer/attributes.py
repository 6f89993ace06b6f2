"""Setting an attribute for the length of a block, and putting it back."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any


@contextlib.contextmanager
def temporarily_set(obj: Any, name: str, value: Any) -> Iterator[None]:
    """Inside the block `obj.name` is `value`; afterwards it is what it was, whatever the block raised."""
    previous = getattr(obj, name)
    setattr(obj, name, value)
    try:
        yield
    finally:
        setattr(obj, name, previous)
