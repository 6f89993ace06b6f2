"""One rank's reads and writes of a store job: the job record, contributions, manifests, snapshots and heartbeats.

Every object is sealed (`sealing.py`) and named (`names.py`). What one site writes others only read, and what must be
decided once is written create-if-absent: the job record (the first site's settings), a round's manifest (the first
site to close it decides, every other reads that decision) and a snapshot's shares. An object that does not verify is
ignored with a warning naming it (once), never applied; a manifest's contribution whose bytes no longer match the
hash the manifest pinned stops the run (`TamperedStoreError`): applying anything else would give this site another
θg than the sites that read it before it changed.
"""

from __future__ import annotations

import json
import logging
import time

from .manifest import Contribution, Manifest
from .names import StoreNames
from .objects import BoundedStore
from .sealing import JobKeys, UntrustedObject, seal, sha256, unseal

logger = logging.getLogger(__name__)


class TamperedStoreError(RuntimeError):
    """A store object a manifest pinned changed after the round was decided."""


class SettingsMismatchError(ValueError):
    """This site's settings differ from the job's (the job record's), named field by field."""


class RoundBoard:
    """One rank's view of the store job.

    Args:
        store: the store, every call bounded (`objects.BoundedStore`).
        keys: the job's keys.
        site: this site's name; `incarnation`: this process's (random, the same on every rank of the site).
        shard: this rank's index in its site; `shards`: the site's ranks (S x D).
    """

    def __init__(self, store: BoundedStore, keys: JobKeys, site: str, incarnation: str, shard: int, shards: int):
        self.store = store
        self.keys = keys
        self.names = StoreNames(keys)
        self.site, self.incarnation, self.shard, self.shards = site, incarnation, shard, shards
        self.job_id = ""
        self._warned: set[str] = set()
        self._shares: dict[str, tuple[Contribution, list[dict]]] = {}  # by record name

    # ----------------------------------------------------------------------------------------------- the job

    def read_job(self) -> dict | None:
        data = self.store.get(self.names.job())
        return None if data is None else self._header(data, {"kind": "job"}, self.names.job())

    def create_job(self, record: dict) -> dict:
        """Write the job record unless a site already did; the job's record either way."""
        self.store.put(self.names.job(), seal(self.keys, {"kind": "job", **record}), create_only=True)
        job = self.read_job()
        if job is None:
            raise RuntimeError(f"the store {self.store.url} lost the job record it just accepted")
        return job

    # ----------------------------------------------------------------------------------------------- contributions

    def put_share(self, fragment: int, base: int, payload: bytes | memoryview, segments: list, codec: str) -> str:
        """Write this rank's encoded share of a contribution (`segments`: the values it holds, `segments.py`); the
        SHA-256 of the object written."""
        key = self.names.shard(fragment, base, self.site, self.incarnation, self.shard)
        header = {
            **self._of(fragment, base),
            "kind": "shard",
            "shard": self.shard,
            "segments": segments,
            "codec": codec,
        }
        sealed = seal(self.keys, header, payload, encrypt_as=key)
        if not self.store.put(key, sealed, create_only=True):
            raise RuntimeError(f"{key} exists already: another process of site {self.site!r} (incarnation "
                               f"{self.incarnation}) wrote it; every site needs a name of its own")  # fmt: skip
        return sha256(sealed)

    def put_record(
        self, fragment: int, base: int, tokens: float, shares: list[dict], final: bool, norm: float
    ) -> None:
        """The site's record of a contribution: its tokens and norm, and every share's hash and segments."""
        contribution = Contribution(self.site, self.incarnation, base, tokens, "", final, norm)
        header = {**self._of(fragment, base), "kind": "record", "contribution": contribution.as_dict()}
        payload = json.dumps({"shares": shares}, separators=(",", ":")).encode()
        key = self.names.record(fragment, base, self.site, self.incarnation)
        self.store.put(key, seal(self.keys, header, payload), create_only=True)

    def contributions(self, fragment: int, bases: range, final: bool) -> list[Contribution]:
        """The verified records of contributions to `fragment` trained from `bases` (`final`: tails, else regular
        ones); any other object there is ignored, and named once."""
        found = []
        for base in bases:
            if base < 0:
                continue
            for key in self.store.list(self.names.contributions(fragment, base)):
                if not key.endswith("/record"):
                    continue
                parsed = self.names.parse_record(key)
                if parsed is None:
                    self._ignore(key, "its name is not one this job's secret gives (a stranger's object)")
                    continue
                contribution = self._record(key, fragment, base, *parsed[2:])
                if contribution is not None and contribution.final == final:
                    found.append(contribution)
        return found

    def _record(self, key: str, fragment: int, base: int, site: str, incarnation: str) -> Contribution | None:
        if key in self._shares:  # records are written once: read each once
            return self._shares[key][0]
        data = self.store.get(key)
        if data is None:
            return None
        expect = {"kind": "record", "job": self.job_id, "fragment": fragment, "base": base, "site": site,
                  "incarnation": incarnation}  # fmt: skip
        opened = self._open(data, expect, key)
        if opened is None:
            return None
        header, payload = opened
        shares = json.loads(bytes(payload))["shares"]
        contribution = Contribution.from_dict({**header["contribution"], "record": sha256(data)})
        self._shares[key] = (contribution, shares)
        return contribution

    def shares_of(self, fragment: int, contribution: Contribution) -> list[dict]:
        """Every share (`sha256`, `segments`) of a contribution a round applies, from the record it pinned."""
        c = contribution
        key = self.names.record(fragment, c.base, c.site, c.incarnation)
        known = self._shares.get(key)
        if known is None or known[0].record != c.record:
            self._shares.pop(key, None)
            if (
                self._record(key, fragment, c.base, c.site, c.incarnation) is None
                or self._shares[key][0].record != c.record
            ):
                raise TamperedStoreError(self._tampered(key, fragment))
        return self._shares[key][1]

    def fetch_share(
        self, fragment: int, contribution: Contribution, shard: int, share: dict, payload_bytes: int
    ) -> memoryview:
        """Share `shard` of a contribution a round applies: verified, and exactly the bytes its record pinned."""
        c = contribution
        key = self.names.shard(fragment, c.base, c.site, c.incarnation, shard)
        data = self.store.get(key)
        if data is None or sha256(data) != share["sha256"]:
            raise TamperedStoreError(self._tampered(key, fragment))
        expect = {**self._of(fragment, c.base), "kind": "shard", "site": c.site, "incarnation": c.incarnation,
                  "shard": shard}  # fmt: skip
        return unseal(self.keys, data, expect, payload_bytes, key)[1]

    def _tampered(self, key: str, fragment: int) -> str:
        return (
            f"{key} is missing or no longer holds the bytes a decided round of fragment {fragment} pinned. Another "
            "site may have applied it already, so this site stops rather than apply anything else. Restore the "
            "store's objects, or start this site again (it then joins from the latest snapshot)."
        )

    # ----------------------------------------------------------------------------------------------- manifests

    def manifest(self, fragment: int, round_: int) -> Manifest | None:
        """Round `round_`'s decision (a regular round, or the job's final round of the fragment), or None."""
        key = self.names.manifest(fragment, round_)
        return self._manifest(key, {"fragment": fragment, "round": round_})

    def decide(self, manifest: Manifest) -> Manifest:
        """Write `manifest` unless another site decided the round first; the round's decision either way (a regular
        round and the final round of a fragment compete for the same name, so exactly one of them is the round)."""
        key = self.names.manifest(manifest.fragment, manifest.round)
        header = {**manifest.header(), "job": self.job_id}
        if self.store.put(key, seal(self.keys, header), create_only=True):
            return manifest
        decided = self.manifest(manifest.fragment, manifest.round)
        if decided is None:
            raise TamperedStoreError(
                f"{key} exists but does not verify: the round's decision cannot be read. Check who else writes to "
                f"{self.store.url}."
            )
        return decided

    def _manifest(self, key: str, expect: dict) -> Manifest | None:
        data = self.store.get(key)
        if data is None:
            return None
        header = self._header(data, {**expect, "job": self.job_id}, key)
        if header is not None and header.get("kind") not in ("manifest", "final"):
            self._ignore(key, f"it is a {header.get('kind')!r}, not a round's manifest")
            return None
        return None if header is None else Manifest.from_header(header)

    # ----------------------------------------------------------------------------------------------- snapshots

    def put_snapshot(self, fragment: int, round_: int, payload: bytes, segments: list) -> dict:
        """Write this rank's share of a snapshot; its description for the snapshot's marker."""
        header = {"kind": "snapshot", "job": self.job_id, "fragment": fragment, "round": round_, "shard": self.shard,
                  "segments": segments}  # fmt: skip
        key = self.names.snapshot(fragment, round_, self.site, self.incarnation, self.shard)
        sealed = seal(self.keys, header, payload, encrypt_as=key)
        self.store.put(key, sealed, True)
        return {"sha256": sha256(sealed), "segments": segments}

    def mark_snapshot(self, fragment: int, round_: int, shares: list[dict]) -> None:
        """The snapshot of `round_` is this site's, every share written (listed with their hashes and segments):
        the first site to mark a round's snapshot is the one every joiner reads."""
        header = {"kind": "snapshot_done", "job": self.job_id, "fragment": fragment, "round": round_}
        payload = json.dumps({"site": self.site, "incarnation": self.incarnation, "shares": shares}).encode()
        self.store.put(self.names.snapshot_done(fragment, round_), seal(self.keys, header, payload), create_only=True)

    def snapshot_rounds(self, fragment: int) -> list[int]:
        """The rounds of `fragment` with a complete snapshot, oldest first."""
        rounds = []
        for key in self.store.list(self.names.snapshots(fragment)):
            parsed = self.names.parse_snapshot_done(key)
            if parsed is not None and parsed[0] == fragment:
                rounds.append(parsed[1])
        return sorted(rounds)

    def snapshot_shares(self, fragment: int, round_: int) -> dict:
        """The marker of round `round_`'s snapshot: its writer (`site`, `incarnation`) and `shares`."""
        key = self.names.snapshot_done(fragment, round_)
        data = self.store.get(key)
        expect = {"kind": "snapshot_done", "job": self.job_id, "fragment": fragment, "round": round_}
        opened = None if data is None else self._open(data, expect, key)
        if opened is None:
            raise TamperedStoreError(self._tampered(key, fragment))
        return json.loads(bytes(opened[1]))

    def read_snapshot(self, fragment: int, round_: int, writer: dict, shard: int) -> memoryview:
        key = self.names.snapshot(fragment, round_, writer["site"], writer["incarnation"], shard)
        data = self.store.get(key)
        if data is None or sha256(data) != writer["shares"][shard]["sha256"]:
            raise TamperedStoreError(self._tampered(key, fragment))
        expect = {"kind": "snapshot", "job": self.job_id, "fragment": fragment, "round": round_, "shard": shard}
        return unseal(self.keys, data, expect, None, key)[1]

    # ----------------------------------------------------------------------------------------------- liveness

    def beat(self, applied: dict[int, int]) -> None:
        """This site's heartbeat: the rounds it applied per fragment, and when."""
        header = {"kind": "heartbeat", "job": self.job_id, "site": self.site, "incarnation": self.incarnation,
                  "applied": {str(k): v for k, v in applied.items()}, "time": time.time()}  # fmt: skip
        self.store.put(self.names.heartbeat(self.site), seal(self.keys, header))

    def live_sites(self, within_seconds: float) -> dict[str, dict[int, int]]:
        """Sites whose heartbeat is at most `within_seconds` old: the rounds each applied per fragment."""
        live = {}
        for key in self.store.list(self.names.heartbeats()):
            site = key[len(self.names.heartbeats()) :].rsplit("-", 1)[0]
            if key != self.names.heartbeat(site):
                continue
            data = self.store.get(key)
            header = None if data is None else self._header(data, {"kind": "heartbeat", "job": self.job_id}, key)
            if header is not None and time.time() - float(header["time"]) <= within_seconds:
                live[site] = {int(k): int(v) for k, v in header["applied"].items()}
        return live

    def delete_before(self, fragment: int, round_: int, keep_snapshot: int) -> int:
        """Remove contributions trained from rounds before `round_`, manifests before it and snapshots older than
        `keep_snapshot`; the number of objects removed."""
        doomed = []
        for key in self.store.list(f"f{fragment}/c/"):
            base = _number_after(key, f"f{fragment}/c/")
            if base is not None and base < round_:
                doomed.append(key)
        for key in self.store.list(f"f{fragment}/m/"):
            number = _number_after(key, f"f{fragment}/m/")
            if number is not None and number < round_:
                doomed.append(key)
        for key in self.store.list(self.names.snapshots(fragment)):
            number = _number_after(key, self.names.snapshots(fragment))
            if number is not None and number < keep_snapshot:
                doomed.append(key)
        self.store.delete(doomed)
        return len(doomed)

    # ----------------------------------------------------------------------------------------------- internals

    def _of(self, fragment: int, base: int) -> dict:
        return {"job": self.job_id, "fragment": fragment, "base": base, "site": self.site,
                "incarnation": self.incarnation}  # fmt: skip

    def _header(self, data: bytes, expect: dict, key: str) -> dict | None:
        opened = self._open(data, expect, key)
        return None if opened is None else opened[0]

    def _open(self, data: bytes, expect: dict, key: str) -> tuple[dict, memoryview] | None:
        try:
            return unseal(self.keys, data, expect, None, key)
        except (UntrustedObject, ValueError, KeyError) as error:
            self._ignore(key, str(error))
            return None

    def _ignore(self, key: str, why: str) -> None:
        if key not in self._warned:
            self._warned.add(key)
            logger.warning("ignored the store object %s: %s. Nothing of it is applied.", key, why)

    @property
    def ignored(self) -> list[str]:
        """Every store object this rank refused, by name."""
        return sorted(self._warned)


def _number_after(key: str, prefix: str) -> int | None:
    digits = key[len(prefix) : len(prefix) + 8]
    return int(digits) if key.startswith(prefix) and digits.isdigit() else None
