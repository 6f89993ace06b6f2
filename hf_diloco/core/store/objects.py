"""What the store exchange needs of an object store, and every call bounded in time.

A backend (`hf_diloco.backends.object_store`, on obstore) implements `ObjectStore`. `BoundedStore` wraps one: a call
that fails (a network error, a 5xx) is retried with backoff for up to `timeout_seconds` in all, after which it raises
`StoreUnreachableError` naming the store and the operation; a missing object and a refused create are answers, not
failures.
"""

from __future__ import annotations

import logging
import random
import time
from collections.abc import Callable
from typing import Protocol, TypeVar

logger = logging.getLogger(__name__)

T = TypeVar("T")


class StoreUnreachableError(RuntimeError):
    """The store did not answer within the bound the user set (`store_timeout_seconds`)."""


class ObjectStore(Protocol):
    """Keys are `/`-separated paths under the job's prefix.

    Attributes:
        url: where the store is, for messages (never with credentials).
    """

    url: str

    def put(self, key: str, data: bytes | memoryview, create_only: bool = False) -> bool:
        """Write `data` at `key`; with `create_only`, atomically and only if `key` does not exist (S3
        `If-None-Match: *`, `O_EXCL` on a filesystem): returns False when it exists (nothing written)."""

    def get(self, key: str) -> bytes | None:
        """The object's bytes, or None when there is none."""

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        """Bytes `[start, end)` of the object (fewer at its end), or None when there is none."""

    def list(self, prefix: str) -> list[str]:
        """Every key that starts with `prefix`."""

    def delete(self, keys: list[str]) -> None:
        """Remove these keys (missing ones are no error)."""


class BoundedStore:
    """`ObjectStore` calls retried with backoff for at most `timeout_seconds` each, then `StoreUnreachableError`.

    Args:
        store: the backend.
        timeout_seconds: how long one operation may keep failing before the run stops (`store_timeout_seconds`).
        sleep: waits between tries (tests pass a faster clock's).
    """

    def __init__(self, store: ObjectStore, timeout_seconds: float, sleep: Callable[[float], None] = time.sleep):
        self.store = store
        self.url = store.url
        self.timeout_seconds = timeout_seconds
        self._sleep = sleep
        self.bytes_up = 0
        self.bytes_down = 0
        self.requests = 0

    def put(self, key: str, data: bytes | memoryview, create_only: bool = False) -> bool:
        written = self._call("write", key, lambda: self.store.put(key, data, create_only))
        if written:
            self.bytes_up += len(data)
        return written

    def get(self, key: str) -> bytes | None:
        data = self._call("read", key, lambda: self.store.get(key))
        self.bytes_down += len(data) if data is not None else 0
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        data = self._call("read", key, lambda: self.store.get_range(key, start, end))
        self.bytes_down += len(data) if data is not None else 0
        return data

    def list(self, prefix: str) -> list[str]:
        return self._call("list", prefix, lambda: self.store.list(prefix))

    def delete(self, keys: list[str]) -> None:
        if keys:
            self._call("delete", keys[0], lambda: self.store.delete(keys))

    def _call(self, what: str, key: str, call: Callable[[], T]) -> T:
        started, delay, tries = time.monotonic(), 0.2, 0
        while True:
            tries += 1
            self.requests += 1
            try:
                return call()
            except Exception as error:  # the backend's own errors: network, throttling, server faults
                waited = time.monotonic() - started
                cause = (str(error).strip().splitlines() or [type(error).__name__])[0]  # one line, not a debug dump
                if waited >= self.timeout_seconds:
                    raise StoreUnreachableError(
                        f"The store {self.url} did not answer for {waited:.0f} s ({tries} tries to {what} {key!r}; "
                        f"store_timeout_seconds={self.timeout_seconds:g}): {cause}. Check the store's address, "
                        "credentials and network; this site's checkpoint is saved and it resumes with the same "
                        "command once the store answers."
                    ) from error
                if tries == 1:
                    logger.warning("the store %s failed to %s %r (%s); retrying for up to %g s", self.url, what, key,
                                   cause, self.timeout_seconds)  # fmt: skip
                self._sleep(min(delay, max(0.0, self.timeout_seconds - waited)))
                delay = min(delay * 2, 10.0) * (0.8 + 0.4 * random.random())


def check_create_if_absent(store: ObjectStore, probe: str) -> None:
    """Refuse a store that accepts a second create-if-absent write of one name (`probe`, removed afterwards): on
    it two sites could decide one round differently."""
    try:
        first = store.put(probe, b"1", create_only=True)
        second = store.put(probe, b"2", create_only=True)
    finally:
        store.delete([probe])
    if not first or second:
        raise ValueError(
            f"The store {store.url} does not refuse a second write of one name (If-None-Match: *): two sites could "
            "decide one round differently. Use a store with conditional writes: S3, R2, GCS, Azure, a Hugging Face "
            "bucket, MinIO, or a folder."
        )
