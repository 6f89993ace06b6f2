"""A site lost and restarted mid-run: elastic membership against a whole-job restart from the last checkpoint.

    python -m benchmarks.elastic_outage --rate_mbit 20 [--ranks_per_site 2 --sync_delay 2]

Three sites train the default Llama of `scripts/pretrain.py` with `--layers` blocks, with DiLoCo (`--inner_steps` H
per round, fp4 with error feedback, the exchange behind `--sync_delay` τ inner steps), each site `--ranks_per_site`
DDP ranks (gloo, one process each, every rank on its own batch) in a network namespace of its own, joined to the
others by a bridge, each namespace's upload limited to `--rate_mbit` with `tc ... tbf` (`--network loopback`: one
host, no limit). Every rank of site 2 sleeps before the exchange of inner step `--kill_at` and is SIGKILLed while
the two other sites are inside it. Two runs, one after the other:

1. **elastic**: `TorchftMembership` against a Lighthouse in this process (one member per site). The survivors retry
   the exchange among themselves and keep training; after `--restart_after` more rounds site 2 is started again,
   heals every rank from the matching rank of a live site and takes part from its first exchange on.
2. **restart**: the fixed-group engine over gloo (`init_process_group` on a TCPStore, every rank of every site),
   every rank writing `engine.state_dict()` with its model and optimizer every `--checkpoint_every` rounds to local
   files. When a site dies, this process (as `torchrun --max-restarts` does) stops every rank, starts all of them
   again and they resume from the newest checkpoint all of them completed.

Every rank logs each inner step's compute interval (forward, backward, optimizer step) and each committed exchange
in JSON lines. From them: the survivors' compute utilization (inner-step compute seconds / wall seconds) in the
outage window (from the kill until the restarted worker's first committed exchange) and in a healthy window (the
first committed exchange until the kill); the seconds the survivors lost at the kill (until their retried exchange
committed); the joiner's heal (bytes and seconds of the transfer, seconds from its process start to its first
exchange); for the restart run the seconds from the kill until every worker trains again, the inner steps redone and
the utilization over a window as long as the elastic outage window. Writes OUT.json (`--out`).

Needs root, `ip`, `tc` and `unshare` for the namespaces. torchft takes the address its peers use from the host name,
so every worker runs in its own UTS namespace (`unshare --uts`) with a host name of its own, which the namespaces'
`/etc/netns/<ns>/hosts` files map to the worker's address.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import torch

from benchmarks import netns
from benchmarks.common import RESULTS_DIR, EventLog, command_line, ran_as_worker

ROOT = Path(__file__).resolve().parent.parent
WORKERS = 3
VICTIM = 2
NAMESPACE_PREFIX = "hfdout"
SUBNET = "10.204.0"
LIGHTHOUSE_HOST = "hfo-lighthouse"
PROCESS_BOUND_SECONDS = 600.0  # no worker and no wait of this benchmark runs longer


# ----------------------------------------------------------------------------------------------- the network


@dataclass
class Star:
    """`size` network namespaces on one bridge in the root namespace (which holds the Lighthouse); each worker runs
    in its namespace under its own host name. `rate_mbit` limits what each namespace sends (a token bucket on its
    veth end); None: unlimited."""

    size: int
    rate_mbit: float | None
    pid: int = field(default_factory=os.getpid)

    @property
    def namespaces(self) -> list[str]:
        return [f"{NAMESPACE_PREFIX}{self.pid}-{i}" for i in range(self.size)]

    @property
    def bridge(self) -> str:
        return f"hfo{self.pid}br"

    def host(self, index: int) -> str:
        return f"hfo-worker{index}"

    @property
    def lighthouse_host(self) -> str:
        return LIGHTHOUSE_HOST

    def create(self) -> Star:
        netns.require_tools()
        if shutil.which("unshare") is None:
            raise netns.NetnsError("`unshare` not found: install util-linux to run the benchmark in namespaces.")
        try:
            self._build()
        except BaseException:
            self.destroy()
            raise
        return self

    def _build(self) -> None:
        run = netns.run_command
        run("ip", "link", "add", self.bridge, "type", "bridge")
        run("ip", "addr", "add", f"{SUBNET}.254/24", "dev", self.bridge)
        run("ip", "link", "set", self.bridge, "up")
        hosts = "127.0.0.1 localhost\n" + "".join(f"{SUBNET}.{i + 1} {self.host(i)}\n" for i in range(self.size))
        hosts += f"{SUBNET}.254 {LIGHTHOUSE_HOST}\n"
        for index, namespace in enumerate(self.namespaces):
            outside, inside = f"hfo{self.pid}h{index}", f"hfo{self.pid}w{index}"
            run("ip", "netns", "add", namespace)
            run("ip", "link", "add", outside, "type", "veth", "peer", "name", inside)
            run("ip", "link", "set", inside, "netns", namespace)
            run("ip", "link", "set", outside, "master", self.bridge, "up")
            run("ip", "-n", namespace, "addr", "add", f"{SUBNET}.{index + 1}/24", "dev", inside)
            run("ip", "-n", namespace, "link", "set", inside, "up")
            run("ip", "-n", namespace, "link", "set", "lo", "up")
            if self.rate_mbit is not None:
                tbf = netns.tbf_arguments(self.rate_mbit)
                run("tc", "-n", namespace, "qdisc", "replace", "dev", inside, "root", *tbf)
            folder = Path("/etc/netns") / namespace
            folder.mkdir(parents=True, exist_ok=True)
            (folder / "hosts").write_text(hosts)

    def exec_prefix(self, index: int) -> list[str]:
        """Runs a command in namespace `index` under the host name `host(index)`."""
        rename_host = 'hostname "$0" && exec "$@"'
        return [
            "ip",
            "netns",
            "exec",
            self.namespaces[index],
            "unshare",
            "--uts",
            "sh",
            "-c",
            rename_host,
            self.host(index),
        ]

    def destroy(self) -> None:
        destroy_star(self.pid)


def destroy_star(pid: int) -> list[str]:
    """Remove the namespaces, hosts files, veths and bridge of the star built by process `pid`."""
    removed = []
    for namespace in netns.list_namespaces():
        if namespace.startswith(f"{NAMESPACE_PREFIX}{pid}-"):
            netns.run_command("ip", "netns", "del", namespace, check=False)
            removed.append(namespace)
    for folder in Path("/etc/netns").glob(f"{NAMESPACE_PREFIX}{pid}-*"):
        shutil.rmtree(folder, ignore_errors=True)
    links = netns.run_command("ip", "-o", "link", "show").stdout
    for line in links.splitlines():
        name = line.split(":")[1].strip().split("@")[0] if ":" in line else ""
        if name.startswith(f"hfo{pid}"):
            netns.run_command("ip", "link", "del", name, check=False)
            removed.append(name)
    return removed


def cleanup_stale_stars() -> list[str]:
    """What runs of this benchmark that are gone left behind, and that of `benchmarks.netns` runs."""
    removed = netns.cleanup_stale()
    names = [name for name in netns.list_namespaces() if name.startswith(NAMESPACE_PREFIX)]
    names += [path.name for path in Path("/etc/netns").glob(f"{NAMESPACE_PREFIX}*")]
    owners = {name[len(NAMESPACE_PREFIX) :].split("-")[0] for name in names}
    for owner in owners:
        if owner.isdigit() and not netns.pid_alive(int(owner)):
            removed += destroy_star(int(owner))
    return removed


class Loopback:
    """Every worker on this host's loopback, no rate limit."""

    rate_mbit = None
    lighthouse_host = "localhost"

    def host(self, index: int) -> str:
        return "localhost"

    def exec_prefix(self, index: int) -> list[str]:
        return []

    def destroy(self) -> None:
        pass


# ----------------------------------------------------------------------------------------------- the worker


def build_model(seed: int, layers: int, vocab: int, sequence: int) -> torch.nn.Module:
    """The default model of `scripts/pretrain.py` with `layers` blocks, randomly initialised from `seed`."""
    from hf_diloco.job.modeling import DEFAULT_MODEL_CONFIG
    from hf_diloco.job.modeling import build_model as build_from_spec

    config = dict(DEFAULT_MODEL_CONFIG, num_hidden_layers=layers)
    config["max_position_embeddings"] = max(sequence, config["max_position_embeddings"])
    return build_from_spec({"config": config}, vocab, seed=seed)


def batch_for(slot: int, step: int, batch: int, sequence: int, vocab: int) -> dict[str, torch.Tensor]:
    """The data of worker `slot` at global inner step `step`: a restarted or joining worker continues where the job
    is, so no sample is trained twice by live workers."""
    generator = torch.Generator().manual_seed(1_000_003 * slot + step)
    ids = torch.randint(0, vocab, (batch, sequence), generator=generator)
    return {"input_ids": ids, "labels": ids}


def worker_main(cli: argparse.Namespace) -> None:
    """One rank of a site of either run: trains `--steps` inner steps, logging each step's compute and each
    exchange. A site of several ranks trains them as DDP ranks (gloo), each on its own batch."""
    from torch.nn.parallel import DistributedDataParallel

    from hf_diloco import DiLoCo, DiLoCoConfig

    signal.alarm(int(PROCESS_BOUND_SECONDS))  # a worker left behind ends on its own
    torch.set_num_threads(1)
    out = Path(cli.out)
    event = EventLog(out / f"events_{cli.run}_{cli.attempt}_{cli.slot}_r{cli.rank}.jsonl")
    model = build_model(cli.slot, cli.layers, cli.vocab, cli.sequence)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    config = DiLoCoConfig(
        inner_steps=cli.inner_steps,
        compression=cli.compression,
        error_feedback=cli.compression != "none",
        sync_timeout_seconds=cli.sync_timeout,
        sync_delay=cli.sync_delay,
        data_parallel_per_worker=cli.ranks,
    )
    event("starting")
    topology = join_groups(cli)
    if cli.run == "elastic":
        engine = DiLoCo(model, optimizer, config, topology=topology, membership=elastic_membership(cli, topology))
    else:
        engine = fixed_group_engine(cli, model, optimizer, config, topology)
    trained = model if cli.ranks == 1 else DistributedDataParallel(model, process_group=topology.data_parallel_group)
    event("training", step=engine.inner_step, stats=stats_of(engine))
    engine.exchange.delay_seconds = stall_once(cli.stall_at, engine, event)
    committed = 0 if engine.elastic is None else log_exchanges(engine, event, 0)  # a joiner's first, while joining
    data_slot = cli.slot * cli.ranks + cli.rank
    while engine.inner_step < cli.steps:
        started = time.time()
        batch = batch_for(data_slot, engine.inner_step, cli.batch, cli.sequence, cli.vocab)
        trained(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        event("step", step=engine.inner_step + 1, start=started, end=time.time())
        engine.step()
        committed = log_exchanges(engine, event, committed)
        if cli.run == "restart" and engine.inner_step % (cli.checkpoint_every * cli.inner_steps) == 0:
            save_checkpoint(out, cli.slot, cli.rank, engine, model, optimizer)
            event("checkpoint", step=engine.inner_step)
    engine.close()
    event("closed", step=engine.inner_step, stats=stats_of(engine))


def join_groups(cli: argparse.Namespace) -> object:
    """The process groups of a rank: the restart run's fixed group of every rank of every site; an elastic site's own
    group of its ranks (its membership finds the other sites). The topology of the rank's site (None: one process
    per site, elastic)."""
    from datetime import timedelta

    import torch.distributed as dist

    from hf_diloco.core.layout.topology import Topology

    timeout = timedelta(seconds=cli.sync_timeout)
    if cli.run == "restart":
        rank, world = cli.slot * cli.ranks + cli.rank, WORKERS * cli.ranks
        dist.init_process_group("gloo", init_method=f"tcp://{cli.store}", rank=rank, world_size=world, timeout=timeout)
    elif cli.ranks > 1:
        address = f"tcp://127.0.0.1:{cli.site_port}"
        dist.init_process_group("gloo", init_method=address, rank=cli.rank, world_size=cli.ranks, timeout=timeout)
    else:
        return None
    return Topology.from_default_group(1, cli.ranks, cli.sync_timeout)


def elastic_membership(cli: argparse.Namespace, topology: object) -> object:
    from hf_diloco.backends.torchft_membership import TorchftMembership

    return TorchftMembership(
        cli.lighthouse,
        f"worker{cli.slot}",
        site_rank=cli.rank,
        site_size=cli.ranks,
        site_group=None if topology is None else topology.control_group,
        min_workers=cli.min_workers,
        start_workers=cli.start_workers,
        min_workers_timeout=120.0,
        sync_timeout=cli.sync_timeout,
        quorum_timeout=120.0,
        connect_timeout=30.0,
        poll_seconds=0.5,
    )


def fixed_group_engine(
    cli: argparse.Namespace, model: torch.nn.Module, optimizer: object, config: object, topology: object
) -> object:
    """The engine over a fixed gloo group of the three sites' ranks, resumed from the newest complete checkpoint."""
    from hf_diloco import DiLoCo

    engine = DiLoCo(model, optimizer, config, topology=topology)
    step = newest_complete_checkpoint(Path(cli.out), cli.ranks)
    if step is not None:
        state = torch.load(checkpoint_path(Path(cli.out), step, cli.slot, cli.rank), weights_only=False)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        engine.load_state_dict(state["engine"])
    return engine


def checkpoint_path(out: Path, step: int, slot: int, rank: int) -> Path:
    return out / "checkpoints" / f"step{step:06d}_worker{slot}_r{rank}.pt"


def save_checkpoint(
    out: Path, slot: int, rank: int, engine: object, model: torch.nn.Module, optimizer: object
) -> None:
    path = checkpoint_path(out, engine.inner_step, slot, rank)
    path.parent.mkdir(exist_ok=True)
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(), "engine": engine.state_dict()}
    torch.save(state, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").rename(path)  # a worker killed while writing leaves no file that looks complete


def newest_complete_checkpoint(out: Path, ranks: int) -> int | None:
    """The newest inner step at which every rank's checkpoint is on disk."""
    steps = [int(path.name[4:10]) for path in (out / "checkpoints").glob("step*_worker0_r0.pt")]
    every = [(slot, rank) for slot in range(WORKERS) for rank in range(ranks)]
    complete = [s for s in steps if all(checkpoint_path(out, s, *where).exists() for where in every)]
    return max(complete, default=None)


def stall_once(stall_at: int, engine: object, event: EventLog) -> Callable[[], float]:
    """The exchange of inner step `stall_at` first sleeps (for longer than any wait here), so that the driver kills
    this worker while the others are inside that exchange."""
    stalled = []

    def stall() -> float:
        if stall_at and engine.inner_step == stall_at and not stalled:
            stalled.append(True)
            event("stalling", step=engine.inner_step)
            return PROCESS_BOUND_SECONDS
        return 0.0

    return stall


def stats_of(engine: object) -> dict:
    return {
        key: engine.stats[key] for key in ("bytes_sent", "heals", "heal_bytes", "heal_seconds") if key in engine.stats
    }


def log_exchanges(engine: object, event: EventLog, committed: int) -> int:
    """Log the exchanges committed since the last call; returns how many are logged in all."""
    if engine.elastic is None:
        if engine.inner_step % engine.config.inner_steps == 0:
            event("exchange", step=engine.inner_step, workers=WORKERS, contributors=WORKERS, stats=stats_of(engine))
        return committed
    rounds = engine.elastic.log.rounds
    for entry in rounds[committed:]:
        event("exchange", stats=stats_of(engine), **entry)
    return len(rounds)


# ----------------------------------------------------------------------------------------------- the driver


class Job:
    """Sites of one run, each of `ranks` processes started in its namespace, with their events and output in `out`."""

    def __init__(self, network: Star | Loopback, out: Path, common: list[str], ranks: int):
        self.network, self.out, self.common, self.ranks = network, out, common, ranks
        out.mkdir(parents=True, exist_ok=True)
        self.processes: dict[tuple[int, int], list[subprocess.Popen]] = {}
        self.started: dict[tuple[int, int], float] = {}

    def start(self, run: str, attempt: int, slot: int, *args: str) -> None:
        """Start every rank of site `slot` (a site of several ranks meets on a port of its own namespace)."""
        site = ["--site_port", str(free_port())] if self.ranks > 1 else []
        self.started[attempt, slot] = time.time()
        self.processes[attempt, slot] = []
        for rank in range(self.ranks):
            argv = [sys.executable, "-m", "benchmarks.elastic_outage", "worker", "--run", run]
            argv += ["--attempt", str(attempt), "--slot", str(slot), "--rank", str(rank), "--out", str(self.out)]
            log = (self.out / f"{run}_{attempt}_{slot}_r{rank}.log").open("ab")
            env = dict(os.environ, RUST_LOG="warn", OMP_NUM_THREADS="1")
            env.setdefault("HF_DILOCO_JOB_SECRET", "elastic-outage-benchmark")  # the job's secret, as a job has one
            process = subprocess.Popen(
                [*self.network.exec_prefix(slot), *argv, *self.common, *site, *args],
                env=env,
                stdout=log,
                stderr=subprocess.STDOUT,
                cwd=ROOT,
                start_new_session=True,  # its own process group: `ip netns exec`, `unshare` and python die together
            )
            self.processes[attempt, slot].append(process)

    def events(self, run: str, attempt: int, slot: int, rank: int = 0) -> list[dict]:
        path = self.out / f"events_{run}_{attempt}_{slot}_r{rank}.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.endswith("}")]

    def site_events(self, run: str, attempt: int, slot: int) -> list[list[dict]]:
        """Each rank's events of a site."""
        return [self.events(run, attempt, slot, rank) for rank in range(self.ranks)]

    def wait_for(self, run: str, attempt: int, slot: int, predicate: Callable[[dict], bool], what: str) -> dict:
        """The first event of the site's rank 0 that `predicate` accepts."""
        deadline = time.monotonic() + PROCESS_BOUND_SECONDS
        while time.monotonic() < deadline:
            for event in self.events(run, attempt, slot):
                if predicate(event):
                    return event
            exited = [p.returncode for p in self.processes[attempt, slot] if p.poll() is not None]
            if exited:
                raise RuntimeError(f"site {slot} of the {run} run exited ({exited}) before {what}; see "
                                   f"{self.out / f'{run}_{attempt}_{slot}_r*.log'}")  # fmt: skip
            time.sleep(0.05)
        raise TimeoutError(f"site {slot} of the {run} run did not reach {what} within {PROCESS_BOUND_SECONDS:g}s")

    def kill(self, attempt: int, slot: int) -> float:
        """SIGKILL every rank of the site (each its process group) at once; returns when."""
        processes = self.processes[attempt, slot]
        for process in processes:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, signal.SIGKILL)
        killed = time.time()
        for process in processes:
            process.wait()
        return killed

    def finish(self, attempt: int) -> dict[int, int]:
        """Each site's exit code (the first nonzero of its ranks)."""
        deadline = time.monotonic() + PROCESS_BOUND_SECONDS
        codes = {}
        for (run_attempt, slot), processes in self.processes.items():
            if run_attempt != attempt:
                continue
            for process in processes:
                try:
                    code = process.wait(timeout=max(1.0, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    code = -signal.SIGKILL
                    self.kill(run_attempt, slot)
                codes[slot] = codes.get(slot) or code
        return codes

    def close(self) -> None:
        for (attempt, slot), processes in self.processes.items():
            if any(process.poll() is None for process in processes):
                self.kill(attempt, slot)


def check_exit_codes(run: str, attempt: int, codes: dict[int, int], out: Path) -> None:
    failed = {slot: code for slot, code in codes.items() if code != 0}
    if failed:
        raise RuntimeError(f"workers of the {run} run failed (slot: exit code) {failed}; logs in {out}")


def run_elastic(network: Star | Loopback, args: argparse.Namespace, out: Path, common: list[str]) -> dict:
    os.environ["RUST_LOG"] = "warn"  # the Lighthouse in this process logs every quorum otherwise
    from torchft._torchft import LighthouseServer

    lighthouse = LighthouseServer(
        bind="[::]:0",
        min_replicas=1,
        join_timeout_ms=int(args.join_timeout * 1000),
        heartbeat_timeout_ms=int(args.heartbeat_timeout * 1000),
    )
    address = f"http://{network.lighthouse_host}:{lighthouse_port(lighthouse)}"
    job = Job(network, out, [*common, "--lighthouse", address], args.ranks_per_site)
    try:
        for slot in range(WORKERS):
            stall = ["--stall_at", str(args.kill_at)] if slot == VICTIM else []
            job.start("elastic", 0, slot, "--start_workers", str(WORKERS), *stall)
        job.wait_for("elastic", 0, VICTIM, lambda e: e["kind"] == "stalling", "the stalled exchange")
        time.sleep(0.5)  # the survivors are inside that exchange now, waiting for the victim
        killed = job.kill(0, VICTIM)
        rejoin_after = args.kill_at + args.restart_after * args.inner_steps
        job.wait_for("elastic", 0, 0, lambda e: e["kind"] == "exchange" and e["step"] == rejoin_after, "its exchange")
        job.start("elastic", 1, VICTIM, "--min_workers", "2")
        codes = job.finish(0)
        if not any(e["kind"] == "training" for e in job.events("elastic", 1, VICTIM)):
            job.kill(1, VICTIM)
            raise RuntimeError(
                f"the survivors finished all {args.steps} inner steps before the restarted worker {VICTIM} joined: "
                f"raise --steps (or lower --restart_after); logs in {out}"
            )
        codes[VICTIM] = job.finish(1)[VICTIM]
        check_exit_codes("elastic", 0, codes, out)
        survivors = [
            events for slot in range(WORKERS) if slot != VICTIM for events in job.site_events("elastic", 0, slot)
        ]
        joiner = job.site_events("elastic", 1, VICTIM)
        return elastic_figures(survivors, joiner, killed, job.started[1, VICTIM], args)
    finally:
        job.close()
        lighthouse.shutdown()


def lighthouse_port(lighthouse: object) -> int:
    return int(lighthouse.address().rsplit(":", 1)[1].strip("/"))


def run_restart(
    network: Star | Loopback, args: argparse.Namespace, out: Path, common: list[str], window: float
) -> dict:
    job = Job(network, out, [*common, "--checkpoint_every", str(args.checkpoint_every)], args.ranks_per_site)
    try:
        store = ["--store", f"{network.host(0)}:{free_port()}"]
        for slot in range(WORKERS):
            stall = ["--stall_at", str(args.kill_at)] if slot == VICTIM else []
            job.start("restart", 0, slot, *store, *stall)
        job.wait_for("restart", 0, VICTIM, lambda e: e["kind"] == "stalling", "the stalled exchange")
        time.sleep(0.5)
        killed = job.kill(0, VICTIM)
        # As torchrun's agent: it sees a worker exit, stops the others and starts every worker again.
        for slot in range(WORKERS):
            if slot != VICTIM:
                job.kill(0, slot)
        restarted = time.time()
        store = ["--store", f"{network.host(0)}:{free_port()}"]
        for slot in range(WORKERS):
            job.start("restart", 1, slot, *store)
        check_exit_codes("restart", 1, job.finish(1), out)
        before = [job.site_events("restart", 0, slot) for slot in range(WORKERS)]
        after = [job.site_events("restart", 1, slot) for slot in range(WORKERS)]
        return restart_figures(before, after, killed, restarted, window, args)
    finally:
        job.close()


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("", 0))
        return probe.getsockname()[1]


# ----------------------------------------------------------------------------------------------- the figures


def utilization(
    events: list[dict], start: float, end: float, steps: Callable[[int], bool] = lambda step: True
) -> float:
    """Inner-step compute seconds inside [start, end] (of the steps `steps` selects) over the window's seconds."""
    busy = sum(
        max(0.0, min(e["end"], end) - max(e["start"], start))
        for e in events
        if e["kind"] == "step" and steps(e["step"])
    )
    return busy / (end - start)


def committed_at(events: list[dict], step: int) -> float:
    """When this worker's exchange of inner step `step` committed (the first, not `close()`'s tail sync)."""
    return next(e["time"] for e in events if e["kind"] == "exchange" and e["step"] == step and not e.get("final"))


def healthy_utilization(events: list[dict], args: argparse.Namespace) -> float:
    """From the first committed exchange to the last one a round before the stalled exchange: whole rounds."""
    return utilization(
        events, committed_at(events, args.inner_steps), committed_at(events, args.kill_at - args.inner_steps)
    )


def first(events: list[dict], kind: str) -> dict:
    return next(e for e in events if e["kind"] == kind)


def mean(values: list[float]) -> float:
    return sum(values) / len(values)


def step_seconds(events: list[dict]) -> float:
    durations = sorted(e["end"] - e["start"] for e in events if e["kind"] == "step")
    return durations[len(durations) // 2]


def elastic_figures(
    survivors: list[list[dict]], joiner: list[list[dict]], killed: float, joiner_started: float,
    args: argparse.Namespace,
) -> dict:  # fmt: skip
    """`survivors`: the events of each rank of the surviving sites; `joiner`: of each rank of the restarted site."""
    joined = first(joiner[0], "training")
    join_step = joined["step"]
    rejoined = max([joined["time"], *(committed_at(events, join_step) for events in survivors)])
    recovered = max(committed_at(events, args.kill_at) for events in survivors)
    finished = max(first(events, "closed")["time"] for events in survivors + joiner)
    exchanges = [e for e in survivors[0] if e["kind"] == "exchange" and not e.get("final")]
    healed = [first(events, "training")["stats"] for events in joiner]
    return {
        "step_seconds": mean([step_seconds(events) for events in survivors]),
        "healthy_utilization": mean([healthy_utilization(events, args) for events in survivors]),
        "outage_seconds": rejoined - killed,
        "outage_utilization": mean([utilization(events, killed, rejoined) for events in survivors]),
        "after_retry_utilization": mean([utilization(events, recovered, rejoined) for events in survivors]),
        "lost_seconds_at_kill": recovered - killed,
        "retries_at_kill": next(e["retries"] for e in exchanges if e["step"] == args.kill_at),
        "rounds_with_two": sum(1 for e in exchanges if e["contributors"] == 2),
        "exchanges_in_background": sum(1 for e in exchanges if e.get("background")),
        "exchanges": len(exchanges),
        "joiner_restarted_after_seconds": joiner_started - killed,
        "joiner_join_step": join_step,
        "joiner_heal_bytes": sum(stats["heal_bytes"] for stats in healed),  # every rank of the site
        "joiner_heal_seconds": max(stats["heal_seconds"] for stats in healed),
        "joiner_start_to_python_ready_seconds": first(joiner[0], "starting")["time"] - joiner_started,
        "joiner_start_to_first_exchange_seconds": joined["time"] - joiner_started,
        "steps_redone": 0,
        "kill_to_finish_seconds": finished - killed,
    }


def restart_figures(
    before: list[list[list[dict]]], after: list[list[list[dict]]], killed: float, restarted: float, window: float,
    args: argparse.Namespace,
) -> dict:  # fmt: skip
    """`before` and `after`: per site, the events of each of its ranks in the run killed and in the restarted one."""
    done_before = [max((e["step"] for e in site[0] if e["kind"] == "step"), default=0) for site in before]
    resumed_at = [first(site[0], "training")["step"] for site in after]
    every_after = [events for site in after for events in site]
    trains_again = max(first(events, "step")["end"] for events in every_after)
    finished = max(first(events, "closed")["time"] for events in every_after)
    survivors = [slot for slot in range(WORKERS) if slot != VICTIM]

    def fresh(slot: int) -> Callable[[int], bool]:
        return lambda step: step > done_before[slot]

    def over_survivors(figure: Callable[[int, list[dict]], float], runs: list[list[list[dict]]]) -> float:
        return mean([figure(slot, events) for slot in survivors for events in runs[slot]])

    return {
        "step_seconds": over_survivors(lambda slot, events: step_seconds(events), before),
        "healthy_utilization": over_survivors(lambda slot, events: healthy_utilization(events, args), before),
        "resumed_at_step": resumed_at[0],
        "steps_redone": sum(max(0, done - resumed) for done, resumed in zip(done_before, resumed_at))
        * args.ranks_per_site,
        "kill_to_training_seconds": trains_again - killed,
        "restart_to_training_seconds": trains_again - restarted,
        "restart_to_python_ready_seconds": max(first(events, "starting")["time"] for events in every_after)
        - restarted,
        "window_seconds": window,
        "window_utilization": over_survivors(lambda slot, events: utilization(events, killed, killed + window), after),
        "window_useful_utilization": over_survivors(
            lambda slot, events: utilization(events, killed, killed + window, fresh(slot)), after
        ),
        "kill_to_finish_seconds": finished - killed,
    }


# ----------------------------------------------------------------------------------------------- the report


def table(elastic: dict, restart: dict, caption: str, ranks: int = 1, sync_delay: int = 0) -> str:
    """The outage table in markdown: one column per way of surviving the lost site."""
    restarted = "one" if ranks == 1 else f"{ranks} at once"
    rows = [
        ("inner step (median), s", f"{elastic['step_seconds']:.3f}", f"{restart['step_seconds']:.3f}"),
        ("survivors' utilization, healthy rounds", pct(elastic["healthy_utilization"]), pct(restart["healthy_utilization"])),
        ("kill -> survivors train again, s",
         f"{elastic['lost_seconds_at_kill']:.1f} (their exchange retried among two)",
         f"{restart['kill_to_training_seconds']:.1f} (every worker restarted)"),
        ("inner steps redone (all ranks)", "0", f"{restart['steps_redone']} (resumed at step {restart['resumed_at_step']})"),
        ("outage window: kill -> site 2's first exchange, s", f"{elastic['outage_seconds']:.1f}", "same length"),
        ("survivors' utilization in that window",
         f"{pct(elastic['outage_utilization'])} ({pct(elastic['after_retry_utilization'])} after the retried exchange)",
         f"{pct(restart['window_utilization'])} ({pct(restart['window_useful_utilization'])} on steps not redone)"),
        ("restarted processes: start -> imports done, model built, s",
         f"{elastic['joiner_start_to_python_ready_seconds']:.1f} ({restarted})",
         f"{restart['restart_to_python_ready_seconds']:.1f} ({WORKERS * ranks} at once)"),
        ("restarted processes: start -> training, s",
         f"{elastic['joiner_start_to_first_exchange_seconds']:.1f} (to its first exchange)",
         f"{restart['restart_to_training_seconds']:.1f} (to the last one's first step)"),
        ("site 2's state: bytes / transfer s",
         f"{elastic['joiner_heal_bytes'] / 1e6:.2f} MB / {elastic['joiner_heal_seconds']:.2f} (from a live peer)",
         "its checkpoint, local disk"),
        ("kill -> job finished, s", f"{elastic['kill_to_finish_seconds']:.1f}", f"{restart['kill_to_finish_seconds']:.1f}"),
        ("a survivor's exchanges run behind the inner steps",
         f"{elastic.get('exchanges_in_background', 0)} of {elastic.get('exchanges', 0)}",
         "every one" if sync_delay else "none (τ = 0)"),
    ]  # fmt: skip
    lines = ["| | elastic (torchft) | whole-job restart |", "|---|---|---|"]
    lines += [f"| {name} | {left} | {right} |" for name, left, right in rows]
    return "\n".join(lines) + f"\n\n{caption}\n"


def pct(value: float) -> str:
    return f"{100 * value:.0f} %"


def caption_for(args: argparse.Namespace, parameters: int) -> str:
    link = (
        f"three network namespaces on a bridge, each sending at most {args.rate_mbit:g} Mbit/s (`tc tbf`)"
        if args.network == "netns"
        else "loopback, no rate limit"
    )
    ranks = args.ranks_per_site
    sites = "one process each" if ranks == 1 else f"{ranks} DDP ranks each (gloo)"
    overlap = f"the exchange behind τ = {args.sync_delay} inner steps (streaming)" if args.sync_delay else "τ = 0"
    return (
        f"3 sites, {sites} ({parameters / 1e6:.2f} M-parameter Llama: the pretrain default with "
        f"{args.layers} blocks; {args.batch}x{args.sequence} tokens "
        f"per rank and inner step, H = {args.inner_steps}, {overlap}, codec {args.compression}, {args.steps} inner "
        f"steps), {link}, sharing one machine's CPU cores. Every rank of site 2 is SIGKILLed with the exchange of inner "
        f"step {args.kill_at} in flight; elastic: restarted after {args.restart_after} more rounds; restart: every site restarted at once "
        f"from the newest checkpoint (every {args.checkpoint_every} rounds, local files) as soon as site 2 is "
        f"dead. Survivors blocked in an exchange with a dead peer wait out its bound, sync_timeout = "
        f"{args.sync_timeout:g} s, before they retry; Lighthouse join timeout {args.join_timeout:g} s, heartbeat "
        f"timeout {args.heartbeat_timeout:g} s."
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--network", choices=("netns", "loopback"), default="netns")
    parser.add_argument("--rate_mbit", type=float, default=20.0, help="Upload limit of each namespace (netns).")
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--inner_steps", type=int, default=10)
    parser.add_argument("--kill_at", type=int, default=60, help="Inner step whose exchange is in flight at the kill.")
    parser.add_argument("--restart_after", type=int, default=2, help="Elastic: rounds before the worker restarts.")
    parser.add_argument("--checkpoint_every", type=int, default=4, help="Restart run: rounds between checkpoints.")
    parser.add_argument("--compression", default="fp4")
    parser.add_argument(
        "--sync_timeout",
        type=float,
        default=10.0,
        help="The bound of a collective: how long survivors wait for a dead peer.",
    )
    parser.add_argument(
        "--join_timeout", type=float, default=60.0, help="Lighthouse: how long a quorum waits for a live worker."
    )
    parser.add_argument(
        "--heartbeat_timeout", type=float, default=5.0, help="Lighthouse: silence after which a worker is dead."
    )
    parser.add_argument("--ranks_per_site", type=int, default=1, help="DDP ranks per site (one process each).")
    parser.add_argument("--sync_delay", type=int, default=0, help="τ: steps the exchange runs behind (streaming).")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--vocab", type=int, default=2048)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--out", default=str(Path(RESULTS_DIR) / "elastic_outage" / "outage.json"))
    parser.add_argument("--work", default=None, help="Folder for logs, events and checkpoints (default: a temp dir).")
    return parser


def check_arguments(parser: argparse.ArgumentParser, args: argparse.Namespace) -> None:
    h = args.inner_steps
    if args.kill_at % h or args.kill_at < 2 * h:
        parser.error(
            f"--kill_at must be a multiple of --inner_steps ({h}) and at least two rounds; got {args.kill_at}"
        )
    if args.kill_at + (args.restart_after + 3) * h > args.steps:
        parser.error(
            f"--steps {args.steps} leaves too few rounds after --kill_at {args.kill_at} and --restart_after "
            f"{args.restart_after} for the restarted worker to join: raise --steps"
        )
    if not 0 <= args.sync_delay < h or args.ranks_per_site < 1:
        parser.error("--sync_delay must be in [0, --inner_steps) and --ranks_per_site at least 1")
    if args.checkpoint_every * h > args.kill_at:
        parser.error(
            f"--checkpoint_every {args.checkpoint_every} rounds: no checkpoint before --kill_at {args.kill_at}"
        )


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.elastic_outage worker")
    parser.add_argument("--run", choices=("elastic", "restart"), required=True)
    parser.add_argument("--attempt", type=int, required=True)
    parser.add_argument("--slot", type=int, required=True)
    parser.add_argument("--rank", type=int, default=0, help="This process's rank in its site.")
    parser.add_argument("--site_port", type=int, default=0, help="Elastic, several ranks: the site group's port.")
    parser.add_argument("--out", required=True)
    parser.add_argument("--lighthouse", default=None)
    parser.add_argument("--store", default=None)
    parser.add_argument("--start_workers", type=int, default=1)
    parser.add_argument("--min_workers", type=int, default=1)
    parser.add_argument("--stall_at", type=int, default=0)
    parser.add_argument("--checkpoint_every", type=int, default=0)
    for name in ("steps", "inner_steps", "layers", "vocab", "sequence", "batch", "ranks", "sync_delay"):
        parser.add_argument(f"--{name}", type=int, required=True)
    parser.add_argument("--compression", required=True)
    parser.add_argument("--sync_timeout", type=float, required=True)
    return parser


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if ran_as_worker(argv, worker_main, worker_parser):
        return {}
    parser = build_parser()
    args = parser.parse_args(argv)
    check_arguments(parser, args)
    common = [f"--{name}={getattr(args, name)}" for name in
              ("steps", "inner_steps", "layers", "vocab", "sequence", "batch", "compression", "sync_timeout",
               "sync_delay")] + [f"--ranks={args.ranks_per_site}"]  # fmt: skip
    parameters = sum(p.numel() for p in build_model(0, args.layers, args.vocab, args.sequence).parameters())
    if args.network == "netns":
        cleanup_stale_stars()
        network = Star(WORKERS, args.rate_mbit).create()
    else:
        network = Loopback()
    work = Path(args.work or tempfile.mkdtemp(prefix="elastic_outage_"))
    work.mkdir(parents=True, exist_ok=True)
    try:
        print("elastic run ...", flush=True)
        elastic = run_elastic(network, args, work / "elastic", common)
        print("whole-job restart run ...", flush=True)
        restart = run_restart(network, args, work / "restart", common, elastic["outage_seconds"])
    finally:
        network.destroy()
    caption = caption_for(args, parameters)
    report = {
        "command": command_line("elastic_outage", argv),
        "settings": vars(args),
        "parameters": parameters,
        "elastic": elastic,
        "restart": restart,
        "caption": caption,
        "table": table(elastic, restart, caption, args.ranks_per_site, args.sync_delay),
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(report, indent=2) + "\n")
    print(report["table"])
    print(f"wrote {out}; logs in {work}")
    return report


if __name__ == "__main__":
    main()
