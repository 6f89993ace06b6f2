"""A slow link on one machine: two network namespaces joined by a veth pair, rate-limited with `tc ... tbf`.

Needs root and the `ip` and `tc` commands (Debian/Ubuntu: `apt-get install iproute2`). Traffic can only flow
between the two namespace addresses: the namespaces have no other interface than the veth ends and their own
loopback, and no routes, so nothing can leave them.

```python
link = SlowLink.create()                    # namespaces hfdwan<pid>-0 / -1, veth hfw<pid>a / hfw<pid>b
try:
    link.set_rate(10)                       # 10 Mbit/s each way (a token bucket on both veth ends)
    subprocess.run([*link.exec_prefix(0), "python", "server.py"])
    link.set_rate(None)                     # unlimited again
finally:
    link.destroy()
```

`cleanup_stale()` removes what a killed run (one whose process is gone) left behind.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from dataclasses import dataclass

NAMESPACE_PREFIX = "hfdwan"
VETH_PREFIX = "hfw"
DEFAULT_ADDRESSES = ("10.201.0.1", "10.201.0.2")
PREFIX_LENGTH = 24

_NAMESPACE_RE = re.compile(rf"^{NAMESPACE_PREFIX}(\d+)-[01]$")
_VETH_RE = re.compile(rf"^{VETH_PREFIX}(\d+)[ab]$")


class NetnsError(RuntimeError):
    """The namespaces or the link could not be set up (not root, missing tools, a failing command)."""


def require_tools() -> None:
    """Raise `NetnsError` unless we are root and `ip`/`tc` exist and network namespaces work."""
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    if missing:
        raise NetnsError(
            f"{', '.join(missing)} not found: install iproute2 (e.g. `apt-get install iproute2`) to run the "
            "slow-link benchmark."
        )
    if os.geteuid() != 0:
        raise NetnsError("the slow-link benchmark creates network namespaces and needs root (run it as root).")
    probe = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True)
    if probe.returncode != 0:
        raise NetnsError(f"`ip netns list` failed, network namespaces are unavailable: {probe.stderr.strip()}")


def run_command(*command: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(list(command), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise NetnsError(f"`{' '.join(command)}` failed ({result.returncode}): {result.stderr.strip()}")
    return result


def list_namespaces() -> list[str]:
    """Names of the network namespaces that exist now (`ip netns list`)."""
    out = run_command("ip", "netns", "list").stdout
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def tbf_arguments(rate_mbit: float) -> list[str]:
    """`tc` arguments of a token bucket at `rate_mbit` Mbit/s.

    The bucket must hold at least one timer tick of traffic (rate / HZ, HZ can be as low as 100) or the link never
    reaches its rate, hence a burst of 10 ms of traffic (at least 32 KiB). The queue may hold 200 ms of traffic, so
    TCP loses few packets at low rates (a drop-tail queue much shorter than a window costs throughput).
    """
    if not rate_mbit > 0:
        raise ValueError(f"rate must be positive, got {rate_mbit} Mbit/s.")
    burst_bytes = max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.010))
    return ["tbf", "rate", f"{rate_mbit:g}mbit", "burst", str(burst_bytes), "latency", "200ms"]


@dataclass
class SlowLink:
    """Two namespaces, one veth pair between them; end `i` lives in `namespaces[i]` with `addresses[i]`."""

    namespaces: tuple[str, str]
    devices: tuple[str, str]
    addresses: tuple[str, str]
    rate_mbit: float | None = None
    destroyed: bool = False

    @classmethod
    def create(cls, addresses: tuple[str, str] = DEFAULT_ADDRESSES) -> SlowLink:
        """Create the namespaces and the veth pair (unlimited until `set_rate`). Cleans up after itself on failure."""
        require_tools()
        pid = os.getpid()
        link = cls(
            namespaces=(f"{NAMESPACE_PREFIX}{pid}-0", f"{NAMESPACE_PREFIX}{pid}-1"),
            devices=(f"{VETH_PREFIX}{pid}a", f"{VETH_PREFIX}{pid}b"),
            addresses=addresses,
        )
        try:
            link._build()
        except BaseException:
            link.destroy()
            raise
        return link

    def _build(self) -> None:
        for namespace in self.namespaces:
            run_command("ip", "netns", "add", namespace)
        run_command("ip", "link", "add", self.devices[0], "type", "veth", "peer", "name", self.devices[1])
        for namespace, device, address in zip(self.namespaces, self.devices, self.addresses):
            run_command("ip", "link", "set", device, "netns", namespace)
            run_command("ip", "-n", namespace, "addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", device)
            run_command("ip", "-n", namespace, "link", "set", device, "up")
            run_command("ip", "-n", namespace, "link", "set", "lo", "up")

    def set_rate(self, rate_mbit: float | None) -> None:
        """Limit both directions to `rate_mbit` Mbit/s (each end shapes what it sends); None removes the limit."""
        for namespace, device in zip(self.namespaces, self.devices):
            if rate_mbit is None:
                run_command("tc", "-n", namespace, "qdisc", "del", "dev", device, "root", check=False)
            else:
                run_command(
                    "tc", "-n", namespace, "qdisc", "replace", "dev", device, "root", *tbf_arguments(rate_mbit)
                )
        self.rate_mbit = rate_mbit

    def exec_prefix(self, end: int) -> list[str]:
        """Command prefix that runs a program inside namespace `end` (0 or 1)."""
        return ["ip", "netns", "exec", self.namespaces[end]]

    def device_bytes(self, end: int) -> tuple[int, int]:
        """(received, transmitted) bytes counted by the veth end `end`, read from `/proc/net/dev` in its namespace."""
        out = run_command(*self.exec_prefix(end), "cat", "/proc/net/dev").stdout
        return parse_proc_net_dev(out, self.devices[end])

    def destroy(self) -> None:
        """Remove both namespaces (which removes the veth pair); safe to call twice and after a partial create."""
        for namespace in self.namespaces:
            run_command("ip", "netns", "del", namespace, check=False)
        # A veth created but not yet moved into a namespace is still in the root namespace.
        run_command("ip", "link", "del", self.devices[0], check=False)
        self.destroyed = True


def parse_proc_net_dev(text: str, device: str) -> tuple[int, int]:
    """(rx_bytes, tx_bytes) of `device` from the text of `/proc/net/dev`."""
    for line in text.splitlines():
        name, sep, counters = line.partition(":")
        if sep and name.strip() == device:
            fields = counters.split()
            return int(fields[0]), int(fields[8])
    raise NetnsError(f"device {device} not found in /proc/net/dev")


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def cleanup_stale(include_live: bool = False) -> list[str]:
    """Remove namespaces and veths left by runs whose process is gone (all of ours with `include_live`).

    Returns:
        `list[str]`: what was removed.
    """
    removed = []
    for namespace in list_namespaces():
        match = _NAMESPACE_RE.match(namespace)
        if match and (include_live or not pid_alive(int(match.group(1)))):
            run_command("ip", "netns", "del", namespace, check=False)
            removed.append(namespace)
    links = run_command("ip", "-o", "link", "show").stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        match = _VETH_RE.match(name)
        if match and (include_live or not pid_alive(int(match.group(1)))):
            run_command("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed
