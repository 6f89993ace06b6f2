"""What the store tests share: a real S3 server (moto's server mode: an S3-compatible HTTP endpoint on loopback) or a
folder as the store, the sites as processes (tests/scripts/store_site.py, one process or a torchrun of ranks), and an
independent replay of a job from the store's bytes alone.

The replay reads every object itself (magic, header length, JSON header, HMAC-SHA256 under the key derived from the
job's secret, payload, decrypted where its header says so), checks each MAC, rebuilds round 0's θ from the first snapshot (safetensors, read by the
safetensors library), and applies each round's contributions (codec `none`: fp32 bytes) with weights it computes
from the tokens and staleness (tokens / (1 + staleness), normalised), summed in the manifest's order, then one step
of `torch.optim.SGD` with the run's outer settings (the final round: θ -= the plain average)."""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import re
import socket
import struct
import subprocess
import sys
import time
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
SITE = Path(__file__).parent / "scripts" / "store_site.py"
SECRET = "the store tests' job secret"
BIN = Path(sys.executable).parent


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


@contextlib.contextmanager
def s3_server(bucket: str = "job-bucket") -> Iterator[dict]:
    """moto's S3 server on a free loopback port with `bucket` created; yields the environment a site needs."""
    port = free_port()
    process = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                               stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)  # fmt: skip
    endpoint = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 30
        while True:
            try:
                urllib.request.urlopen(urllib.request.Request(f"{endpoint}/{bucket}", method="PUT"), timeout=2)
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise AssertionError("moto's S3 server did not answer within 30 s") from None
                time.sleep(0.2)
        yield {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing-secret", "AWS_REGION": "us-east-1",
               "AWS_ENDPOINT_URL": endpoint}  # fmt: skip
    finally:
        process.terminate()
        process.wait(10)


def site_env(extra: dict | None = None) -> dict:
    env = {**os.environ, "HF_DILOCO_JOB_SECRET": SECRET, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}
    return {**env, **(extra or {})}


def start_site(
    site: str, store_url: str, out: Path, ranks: int = 1, env: dict | None = None, **options
) -> subprocess.Popen:
    """A site as its own process (a torchrun of `ranks` ranks when more than one), its output in `out/site.log`."""
    config = options.pop("config", {})
    argv = [
        str(SITE),
        "--site",
        site,
        "--store_url",
        store_url,
        "--out",
        str(out / site),
        "--config",
        json.dumps(config),
    ]
    argv += [f"--{key}={value}" for key, value in options.items()]
    if ranks > 1:
        launcher = [str(BIN / "torchrun"), "--nproc_per_node", str(ranks), "--master_port", str(free_port())]
    else:
        launcher = [sys.executable]
    (out / site).mkdir(parents=True, exist_ok=True)
    log = (out / f"{site}.log").open("ab")
    return subprocess.Popen(launcher + argv, stdout=log, stderr=subprocess.STDOUT, env=site_env(env), cwd=ROOT)


def wait_all(processes: dict[str, subprocess.Popen], out: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    for site, process in processes.items():
        try:
            process.wait(max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            for other in processes.values():
                other.kill()
            raise AssertionError(
                f"site {site} did not finish within {timeout} s:\n{log_of(out, site)[-3000:]}"
            ) from None
        assert process.returncode == 0, f"site {site} exited {process.returncode}:\n{log_of(out, site)[-3000:]}"


def log_of(out: Path, site: str) -> str:
    return (out / f"{site}.log").read_text(errors="replace")


def results(out: Path, site: str) -> list[dict]:
    """Every rank's result of a site, in rank order."""
    return [json.loads(path.read_text()) for path in sorted((out / site).glob("result-*.json"))]


def events(out: Path, site: str, rank: int = 0) -> list[dict]:
    return [json.loads(line) for line in (out / site / f"events-{rank}.jsonl").read_text().splitlines() if line]


def whole(shares: list[dict], key: str = "theta") -> torch.Tensor:
    """A site's ranks' shares (each with its `segments`, in rank order) as the whole flat vector, by segments."""
    return torch.cat([torch.tensor(share[key], dtype=torch.float32) for share in shares])


def per_round(shares: list[dict]) -> dict[tuple[int, bool], torch.Tensor]:
    """(round, final) -> the site's whole θ after it, from every rank's record of the rounds it applied."""
    rounds: dict[tuple[int, bool], list] = {}
    for share in shares:
        for entry in share["rounds"]:
            rounds.setdefault((entry["round"], entry["final"]), []).append(torch.tensor(entry["theta"]))
    return {key: torch.cat(parts) for key, parts in rounds.items() if len(parts) == len(shares)}


# ----------------------------------------------------------------------------------------------- the replay


class StoreBytes:
    """Every object of a store, by name: a folder's files, or an S3 bucket's objects through plain HTTP reads."""

    def __init__(self, url: str, env: dict | None = None):
        if url.startswith("file://"):
            base = Path(url[len("file://") :])
            self.objects = {str(p.relative_to(base)): p.read_bytes() for p in base.rglob("*") if p.is_file()}
        else:
            import boto3

            bucket, _, prefix = url.split("://", 1)[1].partition("/")
            client = boto3.client("s3", endpoint_url=env["AWS_ENDPOINT_URL"], region_name="us-east-1",
                                  aws_access_key_id="testing", aws_secret_access_key="testing-secret")  # fmt: skip
            self.objects = {}
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                for item in page.get("Contents", []):
                    name = item["Key"][len(prefix) :].lstrip("/")
                    self.objects[name] = client.get_object(Bucket=bucket, Key=item["Key"])["Body"].read()
        self.key = hmac.new(SECRET.encode(), b"hf_diloco store v1", hashlib.sha256).digest()
        self.cipher = hmac.new(SECRET.encode(), b"hf_diloco store encryption v1", hashlib.sha256).digest()

    def opened(self, name: str) -> tuple[dict, bytes]:
        data = self.objects[name]
        magic = b"HFDLSEAL1"
        assert data.startswith(magic), name
        (length,) = struct.unpack_from("<I", data, len(magic))
        end = len(magic) + 4 + length
        assert hmac.compare_digest(hmac.new(self.key, data[:end], hashlib.sha256).digest(), data[end : end + 32])
        header, payload = json.loads(data[len(magic) + 4 : end]), data[end + 32 :]
        assert hashlib.sha256(payload).hexdigest() == header["payload_sha256"]
        if header.get("encrypted"):  # XOR the SHAKE-256 keystream of the object's name under the job's key
            stream = hashlib.shake_256(self.cipher + b"\0" + name.encode()).digest(len(payload))
            payload = bytes(a ^ b for a, b in zip(payload, stream))
        return header, payload

    def named(self, pattern: str) -> list[str]:
        return sorted(name for name in self.objects if re.fullmatch(pattern, name))


def replay(store: StoreBytes, outer_lr: float = 0.7, momentum: float = 0.9, max_staleness: int = 2) -> dict:
    """(round, final) -> θ after that round of fragment 0, and round 0's θ, from the store's bytes alone."""
    from safetensors.torch import load

    (done,) = store.named(r"f0/s/00000000/done-[0-9a-f]{16}")
    writer = json.loads(store.opened(done)[1])
    order = [tuple(segment) for share in writer["shares"] for segment in share["segments"]]
    shares = []
    for shard, share in enumerate(writer["shares"]):
        (name,) = store.named(rf"f0/s/00000000/{writer['site']}/{writer['incarnation']}/s{shard:04d}-[0-9a-f]{{16}}")
        shares.append((share["segments"], load(store.opened(name)[1])["theta_g"]))
    theta = in_order(shares, order)
    optimizer = torch.optim.SGD([theta], lr=outer_lr, momentum=momentum, nesterov=momentum > 0)
    thetas = {(0, False): theta.clone()}
    for name in store.named(r"f0/m/\d{8}-[0-9a-f]{16}"):
        manifest = store.opened(name)[0]
        number, final = manifest["round"], manifest["kind"] == "final"
        raw = [e["tokens"] / (1 + (number - 1 - e["base"])) for e in manifest["entries"]]
        weights = [value / sum(raw) for value in raw]
        assert weights == [entry["weight"] for entry in manifest["entries"]], name
        for entry in manifest["entries"]:
            assert final or number - 1 - entry["base"] <= max_staleness
        average = torch.zeros_like(theta)
        for entry, weight in zip(manifest["entries"], weights):
            average.add_(contribution(store, entry, order).mul_(weight))
        if final:
            theta.sub_(average)
        else:
            theta.grad = average
            optimizer.step()
        thetas[(number, final)] = theta.detach().clone()
    return thetas


def contribution(store: StoreBytes, entry: dict, order: list[tuple]) -> torch.Tensor:
    """One contribution's pseudo-gradient (codec none: its shares' fp32 bytes), in the fragment's order."""
    prefix = rf"f0/c/{entry['base']:08d}/{entry['site']}/{entry['incarnation']}-[0-9a-f]{{16}}"
    (record,) = store.named(prefix + "/record")
    assert hashlib.sha256(store.objects[record]).hexdigest() == entry["record"]
    shares = []
    for shard, share in enumerate(json.loads(store.opened(record)[1])["shares"]):
        (name,) = store.named(prefix + f"/s{shard:04d}")
        payload = store.opened(name)[1]
        assert hashlib.sha256(store.objects[name]).hexdigest() == share["sha256"]
        shares.append((share["segments"], torch.frombuffer(bytearray(payload), dtype=torch.float32)))
    return in_order(shares, order)


def in_order(shares: list[tuple[list, torch.Tensor]], order: list[tuple]) -> torch.Tensor:
    """The values of shares (each its segments and values, padding after them) as one vector in `order`'s segments:
    each parameter's elements placed by name and range, whatever shape of site cut them."""
    sizes: dict[str, int] = {}
    for name, start, length in order:
        sizes[name] = max(sizes.get(name, 0), start + length)
    params = {name: torch.full((size,), float("nan")) for name, size in sizes.items()}
    for segments, values in shares:
        position = 0
        for name, start, length in segments:
            params[name][start : start + length] = values[position : position + length]
            position += length
    vector = torch.cat([params[name][start : start + length] for name, start, length in order])
    assert not vector.isnan().any(), "the shares do not cover the fragment"
    return vector


class Blackout:
    """A TCP relay on loopback between the sites and the store's server, whose link the test cuts and restores:
    while `down`, open connections are closed and new ones refused at once (the store does not answer)."""

    def __init__(self, target_port: int):
        import threading

        self.target_port, self.down = target_port, False
        self.listener = socket.socket()
        self.listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.listener.bind(("127.0.0.1", 0))
        self.listener.listen(64)
        self.port = self.listener.getsockname()[1]
        self.open: list[socket.socket] = []
        self._lock = threading.Lock()
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        with self._lock:
            self.down = True
            for connection in self.open:
                with contextlib.suppress(OSError):
                    connection.close()
            self.open.clear()

    def restore(self) -> None:
        self.down = False

    def _accept(self) -> None:
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            if self.down:
                client.close()
                continue
            try:
                server = socket.create_connection(("127.0.0.1", self.target_port), timeout=5)
            except OSError:
                client.close()
                continue
            with self._lock:
                self.open += [client, server]
            for source, sink in ((client, server), (server, client)):
                threading.Thread(target=self._pump, args=(source, sink), daemon=True).start()

    def _pump(self, source: socket.socket, sink: socket.socket) -> None:
        try:
            while data := source.recv(65536):
                sink.sendall(data)
        except OSError:
            pass
        finally:
            for end in (source, sink):
                with contextlib.suppress(OSError):
                    end.close()
