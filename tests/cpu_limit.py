"""A real slow site for the tests: a process capped to a share of one CPU by the kernel (a cgroup's CPU quota), as a
site on slower or shared hardware is, rather than a sleep the test inserts into its steps.

Needs root and a writable cgroup CPU controller (v1 `cpu.cfs_quota_us` or v2 `cpu.max`); `cpu_limit_available()`
says whether this machine has them, so that a test can skip with that reason.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path

CGROUP_ROOT = Path("/sys/fs/cgroup")
PERIOD_US = 10_000  # a short period, so that a capped process is throttled in slices far shorter than one step


def _v1_root() -> Path | None:
    root = CGROUP_ROOT / "cpu"
    return root if (root / "cgroup.procs").exists() and os.access(root, os.W_OK) else None


def _v2_root() -> Path | None:
    controllers = CGROUP_ROOT / "cgroup.controllers"
    if controllers.exists() and "cpu" in controllers.read_text().split() and os.access(CGROUP_ROOT, os.W_OK):
        return CGROUP_ROOT
    return None


def cpu_limit_available() -> bool:
    return os.geteuid() == 0 and (_v1_root() is not None or _v2_root() is not None)


class CpuLimit:
    """A cgroup whose processes together get `share` of one CPU; `add(pid)` moves a process (all its threads, and
    what it starts later) into it; `close()` removes it (once its processes have ended)."""

    def __init__(self, share: float):
        v1 = _v1_root()
        root = v1 or _v2_root()
        if root is None or os.geteuid() != 0:
            raise RuntimeError("capping a process's CPU needs root and a writable cgroup cpu controller")
        self.path = root / f"hf_diloco_test_{uuid.uuid4().hex[:8]}"
        self.path.mkdir()
        quota = max(1000, int(share * PERIOD_US))
        if v1 is not None:
            (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
            (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        else:
            (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")

    def add(self, pid: int) -> None:
        (self.path / "cgroup.procs").write_text(str(pid))

    def close(self) -> None:
        if self.path.exists():
            self.path.rmdir()


def children_with_environment(parent: int, name: str, value: str) -> list[int]:
    """The processes below `parent` whose environment has `name=value` (torchrun's ranks: RANK=1)."""
    wanted = f"{name}={value}".encode()
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            status = (entry / "status").read_text()
            environ = (entry / "environ").read_bytes().split(b"\0")
        except OSError:
            continue
        ppid = int(next(line.split()[1] for line in status.splitlines() if line.startswith("PPid:")))
        if ppid == parent and wanted in environ:
            found.append(int(entry.name))
    return found
