"""Rounds through an S3 server behind a slow link: bytes, seconds and overlap, against the gloo path on that link.

    python -m benchmarks.store_link --rate_mbit 20      # root; about 6 minutes; benchmarks/results/store_link.*
    python -m benchmarks.store_link --quick --out /tmp/store_link

Two network namespaces joined by a veth pair whose both ends are limited with `tc ... tbf rate R`
(`benchmarks.netns`): the S3 server (moto's server mode, a real HTTP endpoint) listens in namespace 0, and the
`--sites` sites (one process each) run in namespace 1, so everything a site writes to or reads from the store crosses
the link. The link's own rate is measured first: one TCP stream of `--tcp_megabytes` from namespace 0 to namespace
1, as `benchmarks.link_rate` does. Every site trains the pretrain default Llama (`--layers` blocks, random tokens)
with DiLoCo, H = `--inner_steps`, `--compression` with error feedback, for `--rounds` rounds. Runs:

1. **store, blocking** (τ = 0, quorum = every site, no grace): each round's exchange is inside the launching step,
   so its seconds are that step's engine time; they are set against what the round's bytes take at the measured
   rate: the sites' uploads (`store_bytes_up`, summed) and then their downloads (`store_bytes_down`), one after the
   other (a site reads the others' shares once the round is decided), each direction at the TCP rate.
2. **store, overlapped** (streaming, τ = `--sync_delay`): the compute utilization of the loop.
3. **gloo, blocking** and 4. **gloo, overlapped**: two workers on a fixed gloo group, one in each namespace, so
   their all_gather crosses the same link (each payload once each way); the same settings.

Per run: bytes up and down per site per round (the engine's `store_bytes_up` / `store_bytes_down`, every object a
site wrote or read; gloo: `bytes_sent`), the store's requests per round by kind (puts, gets, lists, counted by
`benchmarks.store_counts.CountingStore` around the site's store), seconds per round, and the compute utilization
(seconds in forward, backward and the optimizer step / the loop's wall seconds, averaged over the sites). Target: the
store's overlapped utilization within 5% of the gloo path's. Needs root and iproute2.
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from benchmarks import netns
from benchmarks.common import RESULTS_DIR, command_line, ran_as_worker, write_results

ROOT = Path(__file__).resolve().parent.parent
S3_PORT = 29600
GLOO_PORT = 29610
BUCKET = "store-link"
BOUND_SECONDS = 900.0  # no process of this benchmark runs longer
RUNS = ("store_blocking", "store_overlap", "gloo_blocking", "gloo_overlap")
QUICK = {
    "--rate_mbit": "50",
    "--rounds": "2",
    "--inner_steps": "6",
    "--sync_delay": "3",
    "--layers": "1",
    "--vocab": "512",
    "--sequence": "32",
    "--batch": "2",
    "--tcp_megabytes": "1",
}


# ----------------------------------------------------------------------------------------------- the worker


def worker_main(cli: argparse.Namespace) -> None:
    """A store site (namespace 1) or a gloo worker (rank 0 in namespace 0, rank 1 in namespace 1)."""
    signal.alarm(int(BOUND_SECONDS))
    torch.set_num_threads(1)
    from benchmarks.elastic_outage import batch_for, build_model
    from hf_diloco import DiLoCo, DiLoCoConfig

    model = build_model(0, cli.layers, cli.vocab, cli.sequence)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3)
    settings = dict(inner_steps=cli.inner_steps, sync_delay=cli.sync_delay, compression=cli.compression,
                    error_feedback=cli.compression != "none", exchange_pattern="all_gather")  # fmt: skip
    counting = None
    if cli.kind == "store":
        from benchmarks.store_counts import CountingStore
        from hf_diloco import open_store
        from hf_diloco.core.settings.secret import job_secret

        config = DiLoCoConfig(**settings, exchange="store", store_url=cli.url, site=f"site{cli.slot}",
                              quorum=cli.sites, grace_seconds=0.0, round_deadline_seconds=300.0,
                              snapshot_every=1000, store_timeout_seconds=120.0)  # fmt: skip
        counting = CountingStore(open_store(cli.url), job_secret())
        engine = DiLoCo(model, optimizer, config, store=counting)
    else:
        import torch.distributed as dist

        from hf_diloco import Topology

        dist.init_process_group("gloo", init_method=cli.url, rank=cli.slot, world_size=2)
        engine = DiLoCo(model, optimizer, DiLoCoConfig(**settings), topology=Topology.from_default_group(1, 1, 300))
    log = (Path(cli.out) / f"events_{cli.slot}.jsonl").open("w")

    def event(kind: str, **fields: object) -> None:
        log.write(json.dumps({"kind": kind, "time": time.time(), **fields}) + "\n")
        log.flush()

    engine.add_observer(lambda record: event(
        "round", step=engine.inner_step, final=record.final, stats=dict(engine.stats),
        counts=None if counting is None else counting.snapshot(),
    ))  # fmt: skip
    event("training", counts=None if counting is None else counting.snapshot(), stats=dict(engine.stats),
          cpu=cpu_seconds())  # fmt: skip
    steps = cli.rounds * cli.inner_steps
    while engine.inner_step < steps:
        started = time.time()
        batch = batch_for(cli.slot, engine.inner_step, cli.batch, cli.sequence, cli.vocab)
        model(**batch).loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        computed = time.time()
        engine.step()
        event("step", step=engine.inner_step, start=started, computed=computed, stepped=time.time())
    event("loop_done", cpu=cpu_seconds())
    engine.close()
    event("closed", stats=dict(engine.stats))


def cpu_seconds(pid: int | None = None) -> float:
    """User and system CPU seconds of this process (every thread), or of process `pid` (from /proc)."""
    if pid is None:
        usage = resource.getrusage(resource.RUSAGE_SELF)
        return usage.ru_utime + usage.ru_stime
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


# ----------------------------------------------------------------------------------------------- the driver


class Processes:
    """Processes started in the link's namespaces, each its own process group, stopped together."""

    def __init__(self, link: netns.SlowLink, work: Path):
        self.link, self.work, self.running = link, work, []

    def start(self, end: int, argv: list[str], name: str, env: dict | None = None) -> subprocess.Popen:
        log = (self.work / f"{name}.log").open("wb")
        process = subprocess.Popen(
            [*self.link.exec_prefix(end), *argv], cwd=ROOT, stdout=log, stderr=subprocess.STDOUT,
            env=dict(os.environ, OMP_NUM_THREADS="1", RUST_LOG="warn", PYTHONPATH=str(ROOT), **(env or {})),
            start_new_session=True,
        )  # fmt: skip
        self.running.append(process)
        return process

    def wait(self, processes: list[subprocess.Popen], what: str) -> None:
        deadline = time.monotonic() + BOUND_SECONDS
        for process in processes:
            try:
                code = process.wait(max(1.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                code = None
            if code != 0:
                self.stop()
                raise RuntimeError(f"{what} failed ({code}); logs in {self.work}")

    def stop(self) -> None:
        for process in self.running:
            if process.poll() is None:
                os.killpg(process.pid, signal.SIGKILL)
                process.wait()
        self.running.clear()


def start_s3_server(processes: Processes, address: str) -> tuple[dict, int]:
    """moto's S3 server in namespace 0 at `address`, its bucket made; the environment a site needs, and the
    server's process id (`ip netns exec` runs it in its own process)."""
    server = processes.start(0, [sys.executable, "-m", "moto.server", "-H", address, "-p", str(S3_PORT)], "s3_server")
    endpoint = f"http://{address}:{S3_PORT}"
    deadline = time.monotonic() + 60
    make_bucket = [*processes.link.exec_prefix(0), sys.executable, "-c",
                   f"import urllib.request; urllib.request.urlopen(urllib.request.Request('{endpoint}/{BUCKET}', "
                   "method='PUT'), timeout=2)"]  # fmt: skip
    while subprocess.run(make_bucket, capture_output=True).returncode != 0:
        if time.monotonic() > deadline:
            raise RuntimeError(f"moto's S3 server did not answer at {endpoint} within 60 s")
        time.sleep(0.3)
    return {"AWS_ACCESS_KEY_ID": "benchmark", "AWS_SECRET_ACCESS_KEY": "benchmark-secret", "AWS_REGION": "us-east-1",
            "AWS_ENDPOINT_URL": endpoint}, server.pid  # fmt: skip


def worker_argv(args: argparse.Namespace, kind: str, slot: int, sync_delay: int, url: str, out: Path) -> list[str]:
    argv = [sys.executable, "-m", "benchmarks.store_link", "worker", "--kind", kind, "--slot", str(slot),
            "--url", url, "--out", str(out), "--sync_delay", str(sync_delay), "--sites", str(args.sites)]  # fmt: skip
    names = ("rounds", "inner_steps", "layers", "vocab", "sequence", "batch", "compression")
    return argv + [f"--{name}={getattr(args, name)}" for name in names]


def run_one(name: str, link: netns.SlowLink, args: argparse.Namespace, work: Path) -> dict:
    kind, overlapped = name.split("_")
    sync_delay = args.sync_delay if overlapped == "overlap" else 0
    out = work / name
    out.mkdir(parents=True, exist_ok=True)
    processes = Processes(link, out)
    server_cpu = None
    try:
        if kind == "store":
            env, server = start_s3_server(processes, link.addresses[0])
            env["HF_DILOCO_JOB_SECRET"] = os.urandom(16).hex()
            before = cpu_seconds(server)
            sites = [processes.start(1, worker_argv(args, kind, slot, sync_delay, f"s3://{BUCKET}/{name}", out),
                                     f"site{slot}", env) for slot in range(args.sites)]  # fmt: skip
        else:
            url = f"tcp://{link.addresses[0]}:{GLOO_PORT}"
            sites = [processes.start(slot, worker_argv(args, kind, slot, sync_delay, url, out), f"site{slot}",
                                     {"GLOO_SOCKET_IFNAME": link.devices[slot]}) for slot in range(2)]  # fmt: skip
        processes.wait(sites, f"the {name} run")
        if kind == "store":
            server_cpu = cpu_seconds(server) - before
    finally:
        processes.stop()
    logs = [[json.loads(line) for line in path.read_text().splitlines()] for path in sorted(out.glob("events_*"))]
    return {**run_figures(name, logs, args), "server_cpu_seconds": server_cpu}


def run_figures(name: str, logs: list[list[dict]], args: argparse.Namespace) -> dict:
    """Per-round bytes, requests and seconds, and the loop's utilization, from each site's event log."""
    store = name.startswith("store")
    per_site = [site_figures(events, store, args.inner_steps) for events in logs]
    rounds = min(len(site["rounds"]) for site in per_site)
    up = [sum(site["rounds"][r]["up"] for site in per_site) for r in range(rounds)]
    down = [sum(site["rounds"][r]["down"] for site in per_site) for r in range(rounds)]
    seconds = [max(site["rounds"][r]["exchange_seconds"] for site in per_site) for r in range(rounds)]
    return {
        "run": name,
        "sites": len(logs),
        "rounds": rounds,
        "utilization": statistics.mean(site["utilization"] for site in per_site),
        "utilization_by_site": [site["utilization"] for site in per_site],
        "loop_seconds": max(site["loop_seconds"] for site in per_site),
        "compute_seconds": statistics.mean(site["compute_seconds"] for site in per_site),
        "cpu_seconds": statistics.mean(site["cpu_seconds"] for site in per_site),
        "up_bytes_per_site_round": statistics.mean(x for site in per_site for x in (r["up"] for r in site["rounds"])),
        "down_bytes_per_site_round": statistics.mean(r["down"] for site in per_site for r in site["rounds"]),
        "link_up_bytes_per_round": up,
        "link_down_bytes_per_round": down,
        "exchange_seconds_per_round": seconds,
        "requests_per_site_round": mean_counts([r["requests"] for site in per_site for r in site["rounds"]])
        if store else {},
        "object_bytes_per_site_round": mean_counts([r["bytes"] for site in per_site for r in site["rounds"]])
        if store else {},
        "requests_as_the_formulas": formula_matches(per_site, len(logs)) if store else None,
    }  # fmt: skip


def formula_matches(per_site: list[dict], sites: int, max_staleness: int = 2) -> list[int]:
    """[site-rounds whose requests are what `benchmarks.store_cost` counts, site-rounds]: with P the leader's polls
    (its manifest gets less the catch-up check, the round's read and a lost race's read), `(P - 1) x bases` lists
    (the bases a poll lists: `max_staleness` + 1, fewer in the first rounds), one put of the share, the record and
    the heartbeat, every site's record and every other site's share read once (sites of one rank)."""
    matches = total = 0
    for site in per_site:
        for number, entry in enumerate(site["rounds"], start=1):
            requests, written = entry["requests"], entry["bytes"]
            lost = requests.get("put/manifest", 0) - (1 if written.get("put/manifest", 0) > 0 else 0)
            polls = requests.get("get/manifest", 0) - 2 - lost
            expected = {"list/record": (polls - 1) * min(max_staleness + 1, number), "put/share": 1, "put/record": 1,
                        "put/heartbeat": 1, "get/record": sites, "get/share": sites - 1}  # fmt: skip
            total += 1
            matches += all(requests.get(key, 0) == value for key, value in expected.items())
    return [matches, total]


def site_figures(events: list[dict], store: bool, inner_steps: int) -> dict:
    """One site's rounds (bytes up and down, requests, the launching step's engine seconds) and utilization."""
    steps = [e for e in events if e["kind"] == "step"]
    start, end = steps[0]["start"], steps[-1]["stepped"]
    compute = sum(e["computed"] - e["start"] for e in steps)
    engine_seconds = {e["step"]: e["stepped"] - e["computed"] for e in steps}
    previous = next(e for e in events if e["kind"] == "training")
    rounds = []
    for entry in (e for e in events if e["kind"] == "round" and not e["final"]):
        stats, before = entry["stats"], previous["stats"]
        if store:
            up = stats["store_bytes_up"] - before["store_bytes_up"]
            down = stats["store_bytes_down"] - before["store_bytes_down"]
        else:
            up = down = stats["bytes_sent"] - before["bytes_sent"]  # all_gather: what a worker sends, it receives
        launch = entry["step"] - (entry["step"] % inner_steps)  # the round's launch step (τ < H)
        counts = {"requests": {}, "bytes": {}}
        if store:
            from benchmarks.store_counts import difference

            counts = difference(entry["counts"], previous["counts"])
        rounds.append({"up": up, "down": down, "exchange_seconds": engine_seconds.get(launch, 0.0), **counts})
        previous = entry
    cpu = (
        next(e for e in events if e["kind"] == "loop_done")["cpu"]
        - next(e for e in events if e["kind"] == "training")["cpu"]
    )
    return {"rounds": rounds, "utilization": compute / (end - start), "loop_seconds": end - start,
            "compute_seconds": compute, "cpu_seconds": cpu}  # fmt: skip


def mean_counts(counts: list[dict]) -> dict:
    keys = sorted({key for count in counts for key in count})
    return {key: sum(count.get(key, 0) for count in counts) / len(counts) for key in keys}


def expected_seconds(run: dict, rate_bytes_per_second: float) -> list[float]:
    """What each round's bytes take at the link's measured rate: a store round's uploads, then its downloads (one
    direction each, one after the other); a gloo round's all_gather, both directions at once."""
    pairs = zip(run["link_up_bytes_per_round"], run["link_down_bytes_per_round"])
    if run["run"].startswith("store"):
        return [(up + down) / rate_bytes_per_second for up, down in pairs]
    return [max(up, down) / run["sites"] / rate_bytes_per_second for up, down in pairs]


# ----------------------------------------------------------------------------------------------- the report


def table(results: dict[str, dict], tcp: dict, args: argparse.Namespace) -> str:
    rate = tcp["bytes_per_second"]
    names = list(results)
    rows = [
        ("bytes up per site and round", lambda r: f"{r['up_bytes_per_site_round']:,.0f}"),
        ("bytes down per site and round", lambda r: f"{r['down_bytes_per_site_round']:,.0f}"),
        ("exchange seconds per round (median)", lambda r: f"{statistics.median(r['exchange_seconds_per_round']):.2f}"
         if not r["run"].endswith("overlap") else "behind compute"),
        ("what its bytes take at the TCP rate, s", lambda r: f"{statistics.median(expected_seconds(r, rate)):.2f}"),
        ("compute utilization", lambda r: pct(r["utilization"])),
        ("loop wall seconds", lambda r: f"{r['loop_seconds']:.1f}"),
        ("a site's compute seconds / CPU seconds in the loop", lambda r: f"{r['compute_seconds']:.1f} / {r['cpu_seconds']:.1f}"),
        ("the S3 server's CPU seconds", lambda r: "-" if r["server_cpu_seconds"] is None else f"{r['server_cpu_seconds']:.1f}"),
    ]  # fmt: skip
    lines = ["| | " + " | ".join(names) + " |", "|---" * (len(names) + 1) + "|"]
    lines += [f"| {label} | " + " | ".join(cell(results[name]) for name in names) + " |" for label, cell in rows]
    store = results.get("store_blocking") or results.get("store_overlap")
    if store is not None:
        lines.append("")
        lines.append("| store requests per site and round | mean |")
        lines.append("|---|---|")
        lines += [f"| {key} | {value:.2f} |" for key, value in store["requests_per_site_round"].items()]
        matches, total = store["requests_as_the_formulas"]
        lines.append(f"\nRequests as `benchmarks.store_cost` counts them: {matches} of {total} site-rounds.")
    return "\n".join(lines) + "\n\n" + caption(args, tcp) + "\n"


def pct(value: float) -> str:
    return f"{100 * value:.1f}%"


def caption(args: argparse.Namespace, tcp: dict) -> str:
    return (
        f"A veth pair shaped to {args.rate_mbit:g} Mbit/s each way (`tc tbf`); one TCP stream of "
        f"{args.tcp_megabytes:g} MB across it: {8 * tcp['bytes_per_second'] / 1e6:.2f} Mbit/s (median of "
        f"{len(tcp['seconds'])}). Store: moto's S3 server on the far end, {args.sites} sites on the near end, quorum "
        f"{args.sites}, no grace; gloo: 2 workers, one on each end. {args.parameters:,}-parameter Llama "
        f"({args.layers} blocks, vocab {args.vocab}), {args.batch} x {args.sequence} random tokens per step, H = "
        f"{args.inner_steps}, {args.compression} with error feedback, all_gather, {args.rounds} rounds; overlapped: "
        f"τ = {args.sync_delay} steps."
    )


# ----------------------------------------------------------------------------------------------- arguments


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_link", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="A smoke run: tiny model, two rounds.")
    parser.add_argument("--rate_mbit", type=float, default=20.0)
    parser.add_argument("--sites", type=int, default=2, help="Store sites (2 or 3); gloo runs 2 workers.")
    parser.add_argument("--runs", default=",".join(RUNS))
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--inner_steps", type=int, default=40)
    parser.add_argument("--sync_delay", type=int, default=20, help="τ of the overlapped runs.")
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--vocab", type=int, default=4096)
    parser.add_argument("--sequence", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--compression", default="fp4")
    parser.add_argument("--tcp_megabytes", type=float, default=4.0)
    parser.add_argument("--out", default=str(Path(RESULTS_DIR) / "store_link"), help="Writes OUT.json and OUT.md.")
    parser.add_argument("--work", default=None, help="Folder for logs (default: a temp dir).")
    return parser


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.store_link worker")
    for name in ("kind", "url", "out", "compression"):
        parser.add_argument(f"--{name}", required=True)
    for name in ("slot", "sites", "rounds", "inner_steps", "sync_delay", "layers", "vocab", "sequence", "batch"):
        parser.add_argument(f"--{name}", type=int, required=True)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    parser = build_parser()
    if "--quick" in argv:
        argv = [*argv, *[item for flag, value in QUICK.items() if flag not in argv for item in (flag, value)]]
    args = parser.parse_args(argv)
    unknown = [name for name in args.runs.split(",") if name not in RUNS]
    if unknown:
        parser.error(f"--runs: {', '.join(unknown)} unknown; choose from {', '.join(RUNS)}")
    if args.sites not in (2, 3):
        parser.error("--sites must be 2 or 3")
    if not 0 < args.sync_delay < args.inner_steps:
        parser.error("--sync_delay must be in (0, --inner_steps): the overlapped runs' exchange runs behind")
    return args


def main(argv: list[str] | None = None) -> dict:
    argv = sys.argv[1:] if argv is None else argv
    if ran_as_worker(argv, worker_main, worker_parser):
        return {}
    args = parse(argv)
    from benchmarks.elastic_outage import build_model
    from benchmarks.link_rate import measure_tcp

    args.parameters = sum(p.numel() for p in build_model(0, args.layers, args.vocab, args.sequence).parameters())
    work = Path(args.work or tempfile.mkdtemp(prefix="store_link_"))
    work.mkdir(parents=True, exist_ok=True)
    netns.cleanup_stale()
    link = netns.SlowLink.create()
    results = {}
    try:
        link.set_rate(args.rate_mbit)
        nbytes = int(args.tcp_megabytes * 1e6)
        seconds = measure_tcp(link, nbytes, 3, "tcp", work)
        tcp = {"bytes": nbytes, "seconds": seconds, "bytes_per_second": nbytes / statistics.median(seconds)}
        for name in args.runs.split(","):
            print(f"{name} ...", flush=True)
            results[name] = run_one(name, link, args, work)
            results[name]["expected_seconds_per_round"] = expected_seconds(results[name], tcp["bytes_per_second"])
    finally:
        link.destroy()
    text = table(results, tcp, args)
    report = {"command": command_line("store_link", argv), "settings": vars(args), "tcp": tcp, "runs": results,
              "table": text}  # fmt: skip
    write_results(args.out, report, text)
    print(f"wrote {args.out}.json and {args.out}.md; logs in {work}")
    return report


if __name__ == "__main__":
    main()
