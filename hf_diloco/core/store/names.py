"""Where each object of a store job lives, under the job's prefix:

    job-TAG                                   the job record: settings, model, shards per site (`board.py`)
    f{F}/c/{BASE}/{SITE}/{INC}-TAG/s{SHARD}   one rank's encoded share of a site's contribution to fragment F,
                                              trained from round BASE of F (INC: the site process's incarnation)
    f{F}/c/{BASE}/{SITE}/{INC}-TAG/record     the site's record of that contribution: its tokens, every share's hash
    f{F}/m/{ROUND}-TAG                        round ROUND's manifest: the contributions it applies, with weights;
                                              or the job's final round of F (the sites' tails, a plain average)
    f{F}/s/{ROUND}/{SITE}/{INC}/s{SHARD}-TAG  a snapshot of θg and the outer state after ROUND, one rank's share
    f{F}/s/{ROUND}/done-TAG                   the snapshot of ROUND: whose shares, every one written
    sites/{SITE}-TAG                          a site's heartbeat: the rounds it applied, when

TAG is `JobKeys.tag` of the name before it: the job's sites compute it, a stranger cannot (`sealing.py`).
"""

from __future__ import annotations

import re

from .sealing import JobKeys

SITE_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,63}$")


def check_site_name(site: str) -> None:
    if not SITE_NAME.match(site):
        raise ValueError(
            f"site {site!r} cannot name a site in a store: use 1-64 letters, digits, '.', '_' or '-' (e.g. the host "
            "name), unique in the job."
        )


class StoreNames:
    def __init__(self, keys: JobKeys):
        self.keys = keys

    def _tagged(self, name: str) -> str:
        return f"{name}-{self.keys.tag(name)}"

    def job(self) -> str:
        return self._tagged("job")

    def contributions(self, fragment: int, base: int) -> str:
        return f"f{fragment}/c/{base:08d}/"

    def contribution(self, fragment: int, base: int, site: str, incarnation: str) -> str:
        return self._tagged(f"{self.contributions(fragment, base)}{site}/{incarnation}") + "/"

    def shard(self, fragment: int, base: int, site: str, incarnation: str, shard: int) -> str:
        return f"{self.contribution(fragment, base, site, incarnation)}s{shard:04d}"

    def record(self, fragment: int, base: int, site: str, incarnation: str) -> str:
        return f"{self.contribution(fragment, base, site, incarnation)}record"

    def parse_record(self, key: str) -> tuple[int, int, str, str] | None:
        """(fragment, base, site, incarnation) of a record's key whose tag verifies; None for any other key."""
        match = re.match(r"^f(\d+)/c/(\d{8})/([^/]+)/([0-9a-f]+)-([0-9a-f]{16})/record$", key)
        if match is None:
            return None
        fragment, base, site, incarnation, _ = match.groups()
        if key != self.record(int(fragment), int(base), site, incarnation):
            return None
        return int(fragment), int(base), site, incarnation

    def manifest(self, fragment: int, round_: int) -> str:
        return self._tagged(f"f{fragment}/m/{round_:08d}")

    def snapshots(self, fragment: int) -> str:
        return f"f{fragment}/s/"

    def snapshot(self, fragment: int, round_: int, site: str, incarnation: str, shard: int) -> str:
        return self._tagged(f"f{fragment}/s/{round_:08d}/{site}/{incarnation}/s{shard:04d}")

    def snapshot_done(self, fragment: int, round_: int) -> str:
        return self._tagged(f"f{fragment}/s/{round_:08d}/done")

    def parse_snapshot_done(self, key: str) -> tuple[int, int] | None:
        match = re.match(r"^f(\d+)/s/(\d{8})/done-[0-9a-f]{16}$", key)
        if match is None or key != self.snapshot_done(int(match.group(1)), int(match.group(2))):
            return None
        return int(match.group(1)), int(match.group(2))

    def heartbeats(self) -> str:
        return "sites/"

    def heartbeat(self, site: str) -> str:
        return self._tagged(f"sites/{site}")
