"""What the store benchmarks share: an `ObjectStore` that passes every call to the site's real store and counts it.

`CountingStore` wraps the store a site opens (`hf_diloco.open_store`) and counts each request by operation (put,
get, list, delete) and by the kind of object its key names (`kind_of`: share, record, manifest, snapshot, heartbeat,
job, probe), with the bytes each moved. It also keeps the header of every round's manifest the site reads, verified
with the job's key (`hf_diloco.core.store.sealing.open_header`): who contributed to the round, with how many tokens
and how stale, as the store recorded the decision.
"""

from __future__ import annotations

import re
import threading
from collections import Counter

from hf_diloco.core.store.sealing import JobKeys, UntrustedObject, open_header

OPERATIONS = ("put", "get", "list", "delete")
KINDS = ("share", "record", "manifest", "snapshot", "heartbeat", "job", "probe", "other")
_MANIFEST = re.compile(r"^f(\d+)/m/(\d{8})-[0-9a-f]{16}$")


def kind_of(key: str) -> str:
    """The kind of store object a key (or a listed prefix) names, from the layout of `hf_diloco.core.store.names`."""
    if re.match(r"^f\d+/c/", key):
        if key.endswith("/record"):
            return "record"
        return "share" if re.search(r"/s\d{4}$", key) else "record"  # a listing of contributions looks for records
    if re.match(r"^f\d+/m/", key):
        return "manifest"
    if re.match(r"^f\d+/s/", key):
        return "snapshot"
    if key.startswith("sites/"):
        return "heartbeat"
    if key.startswith("job-"):
        return "job"
    if key.startswith("probes/"):
        return "probe"
    return "other"


class CountingStore:
    """`ObjectStore` on `store`, counting every request (`requests[(operation, kind)]`) and its bytes
    (`bytes[(operation, kind)]`); `manifests[(fragment, round)]` holds the verified header of each manifest read.

    Args:
        store: the site's store (`hf_diloco.open_store(url)`).
        secret: the job's secret, to verify the manifests kept (None: the `insecure_no_secret` key).
    """

    def __init__(self, store: object, secret: bytes | None):
        self.store = store
        self.url = store.url
        self.keys = JobKeys(secret, insecure=secret is None)
        self.requests: Counter = Counter()
        self.bytes: Counter = Counter()
        self.manifests: dict[tuple[int, int], dict] = {}
        self._lock = threading.Lock()  # the store thread and the snapshot writes count from other threads

    def _count(self, operation: str, key: str, size: int = 0) -> None:
        with self._lock:
            self.requests[operation, kind_of(key)] += 1
            self.bytes[operation, kind_of(key)] += size

    def put(self, key: str, data: bytes | memoryview, create_only: bool = False) -> bool:
        written = self.store.put(key, data, create_only)
        self._count("put", key, len(data) if written else 0)
        return written

    def get(self, key: str) -> bytes | None:
        data = self.store.get(key)
        self._count("get", key, 0 if data is None else len(data))
        if data is not None and (match := _MANIFEST.match(key)):
            self._keep_manifest(key, data, int(match.group(1)), int(match.group(2)))
        return data

    def get_range(self, key: str, start: int, end: int) -> bytes | None:
        data = self.store.get_range(key, start, end)
        self._count("get", key, 0 if data is None else len(data))
        return data

    def list(self, prefix: str) -> list[str]:
        keys = self.store.list(prefix)
        self._count("list", prefix)
        return keys

    def delete(self, keys: list[str]) -> None:
        self.store.delete(keys)
        for key in keys[:1]:
            self._count("delete", key)

    def _keep_manifest(self, key: str, data: bytes, fragment: int, round_: int) -> None:
        if (fragment, round_) in self.manifests:
            return
        try:
            header = open_header(self.keys, data, {"fragment": fragment, "round": round_}, key)
        except (UntrustedObject, ValueError):
            return  # the engine ignores it too, and names it
        self.manifests[fragment, round_] = header

    def snapshot(self) -> dict:
        """The counts so far: `{"requests": {"put/share": n, ...}, "bytes": {...}}`."""
        with self._lock:
            return {
                "requests": {f"{op}/{kind}": n for (op, kind), n in sorted(self.requests.items())},
                "bytes": {f"{op}/{kind}": n for (op, kind), n in sorted(self.bytes.items())},
            }


def manifest_tokens(header: dict) -> float:
    """The tokens a manifest's contributions trained (every entry, whatever its staleness weight)."""
    return float(sum(entry["tokens"] for entry in header["entries"]))


def difference(after: dict, before: dict) -> dict:
    """`CountingStore.snapshot()` counts between two snapshots."""
    return {
        part: {key: after[part].get(key, 0) - before[part].get(key, 0) for key in after[part]
               if after[part].get(key, 0) != before[part].get(key, 0)}
        for part in ("requests", "bytes")
    }  # fmt: skip
