"""How close one blocking outer exchange gets to a tbf-shaped link's rate, next to a plain TCP stream on that link.

Two network namespaces joined by a veth pair (`benchmarks.netns`), each end shaped with `tc ... tbf rate R`: each
direction has its own token bucket, so a 2-worker exchange that sends S bytes each way takes S x 8 / R seconds at
best, the same as one TCP stream of S bytes. For every rate this measures, each `--repeats` times:

- `tcp`: one TCP connection, S bytes from end 0 to end 1 (python sockets), until end 1 confirmed the last byte;
- `tcp_both`: one TCP connection, S bytes each way at once (what gloo's single connection per pair carries);
- `tcp_pair`: S bytes each way at once, each direction on its own connection;
- `all_to_all`: gloo's `all_to_all_single` of S bytes each way between two processes;
- `point_to_point`: the same S bytes each way by `exchange_point_to_point` (receives posted before sends);
- `exchange_<codec>`: one blocking `OuterExchange.launch` (reduce_scatter, M = 2, schedule tag included) of a
  vector whose encoded payload makes the rank send about S bytes (the exact count is the package's `bytes_sent`).

Seconds are the slower end's, from a barrier to the end of the transfer; `of the rate` = the nominal time at R
(bytes each way x 8 / R) / the measured time; `of TCP` = the achieved rate / the median `tcp` rate at that R. For
the exchanges, `s in transfers` is the time inside their payload transfers (the rank that reached them last; coding
and copies excluded), and its share of the rate is what `hf_diloco.core.settings.projection` calls the link efficiency (the
projection counts the coding as host CPU). Run it with `--modes tcp,all_to_all,exchange` from a checkout without
`exchange_point_to_point` to measure that package. Needs root and iproute2.

```
python -m benchmarks.link_rate --rates 10,100,1000 --out benchmarks/results/link_rate.json
```
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from benchmarks.netns import SlowLink, cleanup_stale

REPO_ROOT = Path(__file__).resolve().parent.parent
TCP_PORT = 29400
GLOO_PORT = 29500
STEP_TIMEOUT = 120.0  # seconds any one process may take for all of its measurements at one rate
CHUNK = 1 << 16


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rates", default="10,100,1000", help="Mbit/s, comma separated")
    parser.add_argument(
        "--megabytes",
        default="auto",
        help="S per rate, comma separated, or auto: 2 MB to 10 Mbit/s, 8 MB to 100, 32 MB",
    )
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--codecs", default="none,fp4")
    parser.add_argument("--modes", default="tcp,tcp_both,tcp_pair,all_to_all,point_to_point,exchange")
    parser.add_argument("--out", default=None, help="JSON results file")
    parser.add_argument("--role", default=None, help=argparse.SUPPRESS)  # tcp-server / tcp-client / gloo
    parser.add_argument("--spec", default=None, help=argparse.SUPPRESS)
    return parser.parse_args(argv)


def _sizes(args: argparse.Namespace, rates: list[float]) -> list[int]:
    if args.megabytes == "auto":
        return [int((2 if rate <= 10 else 8 if rate <= 100 else 32) * 1e6) for rate in rates]
    megabytes = [float(m) for m in args.megabytes.split(",")]
    if len(megabytes) != len(rates):
        raise SystemExit(f"--megabytes names {len(megabytes)} sizes for {len(rates)} rates; give one per rate.")
    return [int(m * 1e6) for m in megabytes]


# ------------------------------------------------------------------------------------------- TCP, inside a namespace


def _receive_exactly(sock: socket.socket, nbytes: int, deadline: float) -> None:
    buffer = bytearray(CHUNK)
    view = memoryview(buffer)
    left = nbytes
    while left > 0:
        if time.monotonic() > deadline:
            raise TimeoutError(f"{left} of {nbytes} bytes still missing at the deadline")
        got = sock.recv_into(view[: min(CHUNK, left)])
        if got == 0:
            raise ConnectionError(f"peer closed with {left} of {nbytes} bytes missing")
        left -= got


def _transfer(out_sock: socket.socket, out_bytes: int, in_sock: socket.socket, in_bytes: int, deadline: float) -> None:
    """Send `out_bytes` on `out_sock` (a thread) while receiving `in_bytes` from `in_sock`."""
    sender = threading.Thread(target=out_sock.sendall, args=(bytes(out_bytes),), daemon=True)
    sender.start()
    _receive_exactly(in_sock, in_bytes, deadline)
    sender.join(max(0.0, deadline - time.monotonic()))
    if sender.is_alive():
        raise TimeoutError("sending did not finish by the deadline")


def tcp_role(spec: dict, server: bool) -> None:
    """One end of the TCP measurements: the client times each transfer, the server mirrors it."""
    deadline = time.monotonic() + STEP_TIMEOUT
    address = (spec["server_address"], TCP_PORT)
    # `tcp_pair`: a second connection carries the other direction (end 1 sends on it, end 0 receives).
    count = 2 if spec["mode"] == "tcp_pair" else 1
    if server:
        listener = socket.create_server(address)
        listener.settimeout(STEP_TIMEOUT)
        socks = [listener.accept()[0] for _ in range(count)]
    else:
        socks = [_connect(address, deadline) for _ in range(count)]
    for sock in socks:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    forward, backward = socks[0], socks[-1]  # end 0 sends on `forward`, end 1 on `backward`
    nbytes = spec["bytes"]
    back = 0 if spec["mode"] == "tcp" else nbytes
    times = []
    for _ in range(spec["repeats"]):
        started = time.perf_counter()
        if server:
            _transfer(backward, back, forward, nbytes, deadline)
            forward.sendall(b"k")  # everything arrived
        else:
            _transfer(forward, nbytes, backward, back, deadline)
            _receive_exactly(forward, 1, deadline)
            times.append(time.perf_counter() - started)
    if not server:
        Path(spec["out"]).write_text(json.dumps(times))
    for sock in socks:
        sock.close()


def _connect(address: tuple[str, int], deadline: float) -> socket.socket:
    for _ in range(400):
        try:
            return socket.create_connection(address, timeout=STEP_TIMEOUT)
        except OSError:
            if time.monotonic() > deadline:
                break
            time.sleep(0.05)
    raise TimeoutError(f"could not connect to {address}")


# ------------------------------------------------------------------------------------------ gloo, inside a namespace


def gloo_role(spec: dict) -> None:
    """One rank: join a 2-rank gloo group over the veth, time the raw all_to_all and the package's exchange."""
    import datetime

    import torch
    import torch.distributed as dist

    from hf_diloco.core.compression.codecs import make_codec
    from hf_diloco.core.exchange.exchange import OuterExchange
    from hf_diloco.core.exchange.transport import ScheduleTag

    try:
        from hf_diloco.core.exchange.transport import exchange_point_to_point
    except ImportError:  # a package without it (measuring an older checkout): its own exchanges only
        exchange_point_to_point = None
    from hf_diloco.core.layout.topology import Topology

    torch.set_num_threads(1)
    rank = spec["rank"]
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=STEP_TIMEOUT))
    topology = Topology.from_default_group()
    results: dict[str, list] = {}
    nbytes = spec["bytes"]
    for mode in spec["gloo_modes"]:
        runs = []
        if mode in ("all_to_all", "point_to_point"):
            send = torch.zeros(2 * nbytes, dtype=torch.uint8)
            receive = torch.empty(2 * nbytes, dtype=torch.uint8)
            for repeat in range(spec["repeats"] + 1):  # the first one connects the pair
                size = nbytes if repeat else 1
                dist.barrier()
                started = time.perf_counter()
                if mode == "all_to_all":
                    dist.all_to_all_single(receive[: 2 * size], send[: 2 * size])
                else:
                    exchange_point_to_point(receive[: 2 * size].chunk(2), send[: 2 * size].chunk(2), None, rank)
                if repeat:
                    runs.append({"seconds": time.perf_counter() - started, "bytes_sent": nbytes})
        else:
            transfer = _time_transfers()
            codec = make_codec(mode.removeprefix("exchange_"))
            exchange = OuterExchange(topology, codec)
            numel = _numel_for(exchange, nbytes)
            vector = torch.randn(numel, generator=torch.Generator().manual_seed(rank))
            for repeat in range(spec["repeats"] + 1):  # the first one warms buffers and coding threads
                dist.barrier()
                started, transfer[0] = time.perf_counter(), 0.0
                tag = ScheduleTag("launch", 0, repeat)
                result = exchange.launch(vector, "link_rate", blocking=True, schedule=tag).wait()
                if repeat:
                    seconds = time.perf_counter() - started
                    runs.append({"seconds": seconds, "bytes_sent": result.bytes_sent, "transfer_seconds": transfer[0]})
            exchange.close()
        results[mode] = runs
    dist.barrier()
    Path(spec["out"]).write_text(json.dumps(results))
    dist.destroy_process_group()


def _time_transfers() -> list[float]:
    """Make the exchange add the seconds its payload transfers take to the returned list's only entry (coding and
    copies excluded). Wraps `exchange_point_to_point`, or in a package without it the `all_to_all_single` it used."""
    import torch.distributed as dist

    try:  # where this package sends payloads point-to-point; a revision of before sent them from `core/exchange.py`
        from hf_diloco.core.exchange import transport as payload_module
    except ImportError:
        import hf_diloco.core.exchange as payload_module

    total = [0.0]
    owner, name = (payload_module, "exchange_point_to_point")
    if not hasattr(payload_module, name):
        owner, name = (dist, "all_to_all_single")
    function = getattr(owner, name)
    if getattr(function, "timed", False):
        return function.timed

    def timed(*args, **kwargs):
        started = time.perf_counter()
        try:
            return function(*args, **kwargs)
        finally:
            total[0] += time.perf_counter() - started

    timed.timed = total
    setattr(owner, name, timed)
    return total


def _numel_for(exchange, nbytes: int) -> int:
    """A vector length whose exchange sends about `nbytes` (a whole number of the codec's padding granularity)."""
    granularity = exchange.granularity()
    per_value = exchange.wire_bytes(granularity) / granularity
    return max(1, round(nbytes / per_value / granularity)) * granularity


# ------------------------------------------------------------------------------------------------- benchmark side

_PROCS: list[subprocess.Popen] = []


def _spawn(link: SlowLink, end: int, role: str, spec: dict, work: Path, env: dict | None = None) -> subprocess.Popen:
    path = work / f"{role}{end}.json"
    path.write_text(json.dumps(spec))
    command = [*link.exec_prefix(end), sys.executable, "-m", "benchmarks.link_rate", "--role", role]
    log = open(work / f"{role}{end}.log", "w")  # noqa: SIM115 - lives as long as the process
    proc = subprocess.Popen(
        [*command, "--spec", str(path)],
        cwd=REPO_ROOT,
        env=dict(os.environ, OMP_NUM_THREADS="1", **(env or {})),
        stdout=log,
        stderr=subprocess.STDOUT,
        start_new_session=True,
    )
    _PROCS.append(proc)
    return proc


def _finish(procs: list[subprocess.Popen], work: Path, what: str) -> None:
    deadline = time.monotonic() + STEP_TIMEOUT + 30
    for proc in procs:
        try:
            proc.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            _stop_all()
            raise RuntimeError(f"{what} did not finish in time; logs in {work}") from None
        if proc.returncode != 0:
            logs = "\n".join(p.read_text()[-2000:] for p in work.glob("*.log"))
            raise RuntimeError(f"{what} failed ({proc.returncode}):\n{logs}")
    _PROCS.clear()


def _stop_all() -> None:
    for proc in _PROCS:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    _PROCS.clear()


def measure_tcp(link: SlowLink, nbytes: int, repeats: int, mode: str, work: Path) -> list[float]:
    spec = {"server_address": link.addresses[1], "bytes": nbytes, "repeats": repeats, "mode": mode}
    spec["out"] = str(work / "tcp.out")
    server = _spawn(link, 1, "tcp-server", spec, work)
    time.sleep(0.3)
    client = _spawn(link, 0, "tcp-client", spec, work)
    _finish([client, server], work, "the TCP measurement")
    return json.loads((work / "tcp.out").read_text())


def measure_gloo(link: SlowLink, nbytes: int, repeats: int, modes: list[str], work: Path) -> dict[str, list]:
    procs = []
    for rank in range(2):
        spec = {"rank": rank, "bytes": nbytes, "repeats": repeats, "gloo_modes": modes, "out": str(work / f"g{rank}")}
        env = {
            "MASTER_ADDR": link.addresses[0],
            "MASTER_PORT": str(GLOO_PORT),
            "GLOO_SOCKET_IFNAME": link.devices[rank],
        }
        procs.append(_spawn(link, rank, "gloo", spec, work, env))
    _finish(procs, work, "the gloo measurement")
    ranks = [json.loads((work / f"g{rank}").read_text()) for rank in range(2)]
    return {
        mode: [
            {
                "seconds": max(a["seconds"], b["seconds"]),
                "bytes_sent": a["bytes_sent"],
                # The rank that reached a transfer last waited least for its peer's coding.
                "transfer_seconds": min(a.get("transfer_seconds", 0.0), b.get("transfer_seconds", 0.0)),
            }
            for a, b in zip(ranks[0][mode], ranks[1][mode])
        ]
        for mode in modes
    }


def _row(mode: str, rate: float, runs: list[dict], tcp_rate: float | None) -> dict:
    seconds = statistics.median(run["seconds"] for run in runs)
    nbytes = runs[0]["bytes_sent"]
    achieved = nbytes * 8 / seconds / 1e6
    nominal = nbytes * 8 / (rate * 1e6)
    row = {
        "rate_mbit": rate,
        "mode": mode,
        "bytes_each_way": nbytes,
        "seconds": [run["seconds"] for run in runs],
        "median_seconds": seconds,
        "nominal_seconds": nominal,
        "achieved_mbit": achieved,
        "efficiency": achieved / rate,
        "vs_tcp": achieved / tcp_rate if tcp_rate else None,
        "transfer_seconds": None,
        "link_efficiency": None,
    }
    transfer = statistics.median(run.get("transfer_seconds", 0.0) for run in runs)
    if mode.startswith("exchange") and transfer > 0:
        # The exchange's payload transfers alone (its coding and copies excluded): what the projection calls transfer.
        # None for an exchange in pipelined pieces: its coding runs while its pieces travel, nothing to take apart.
        row["transfer_seconds"] = transfer
        row["link_efficiency"] = nominal / transfer
    return row


def measure_rate(link: SlowLink, rate: float, nbytes: int, args: argparse.Namespace, work: Path) -> list[dict]:
    modes = args.modes.split(",")
    exchanges = [f"exchange_{codec}" for codec in args.codecs.split(",")] if "exchange" in modes else []
    gloo_modes = [mode for mode in ("all_to_all", "point_to_point") if mode in modes] + exchanges
    link.set_rate(rate)
    measured: dict[str, list[dict]] = {}
    for mode in ("tcp", "tcp_both", "tcp_pair"):
        if mode in modes:
            times = measure_tcp(link, nbytes, args.repeats, mode, work)
            measured[mode] = [{"seconds": t, "bytes_sent": nbytes} for t in times]
    if gloo_modes:
        measured.update(measure_gloo(link, nbytes, args.repeats, gloo_modes, work))
    tcp = _row("tcp", rate, measured["tcp"], None)["achieved_mbit"] if "tcp" in measured else None
    return [_row(mode, rate, runs, tcp) for mode, runs in measured.items()]


def markdown(rows: list[dict]) -> str:
    lines = [
        "| rate (Mbit/s) | measurement | bytes each way | seconds (median) | nominal s | achieved Mbit/s | "
        "of the rate | of TCP | s in transfers | transfers: share of the rate |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        vs_tcp = f"{row['vs_tcp']:.2f}" if row["vs_tcp"] else "-"
        transfer = f"{row['transfer_seconds']:.3f}" if row["transfer_seconds"] is not None else "-"
        link = f"{row['link_efficiency']:.2f}" if row["link_efficiency"] is not None else "-"
        lines.append(
            f"| {row['rate_mbit']:g} | {row['mode']} | {row['bytes_each_way']:,} | {row['median_seconds']:.3f} | "
            f"{row['nominal_seconds']:.3f} | {row['achieved_mbit']:.1f} | {row['efficiency']:.2f} | {vs_tcp} | "
            f"{transfer} | {link} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.role:
        spec = json.loads(Path(args.spec).read_text())
        if args.role == "gloo":
            gloo_role(spec)
        else:
            tcp_role(spec, server=args.role == "tcp-server")
        return 0
    rates = [float(r) for r in args.rates.split(",")]
    cleanup_stale()
    link = SlowLink.create()
    rows: list[dict] = []
    try:
        with tempfile.TemporaryDirectory(prefix="link_rate") as tmp:
            for rate, nbytes in zip(rates, _sizes(args, rates)):
                rows += measure_rate(link, rate, nbytes, args, Path(tmp))
                print(markdown([r for r in rows if r["rate_mbit"] == rate]).split("\n", 2)[2], flush=True)
    finally:
        _stop_all()
        link.destroy()
    print(markdown(rows))
    if args.out:
        report = {"command": "python -m benchmarks.link_rate " + " ".join(argv or sys.argv[1:]), "rows": rows}
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
