"""Slow-link benchmark: DDP vs DiLoCo, Streaming DiLoCo and a DiLoCoX-style mode over a rate-limited veth link.

Two workers run in two network namespaces joined by a veth pair (10.201.0.1 <-> 10.201.0.2) whose bandwidth is
limited with `tc qdisc ... tbf rate R` on both ends; gloo (store and collectives) runs over the veth addresses only.
Both train the same small Llama-style model (random init) with AdamW on byte-level tokens of the Python standard
library's source (every byte one token, vocabulary 256: no tokenizer training, so the benchmark spends its time
training) for the same number of steps, so every method sees the same tokens. Methods:

- `ddp`: `DistributedDataParallel` over gloo, gradients all-reduced every step.
- `diloco`: DiLoCo, H inner steps (100), fp32 pseudo-gradients, blocking sync.
- `streaming`: Streaming DiLoCo, P = 4 fragments, tau = 1, fp4 (deflated too with `--entropy-coding`).
- `diloco_x`: the package's DiLoCoX-style mode: one-round overlap with eager updates (Kale et al.) and adaptive
  compression (PowerSGD rank <= `--lowrank-rank` and a codec from fp4 up, picked per sync by the package's default
  policy to fit the compute window; error feedback). No pipeline parallelism (one process per worker).
- `local`: the same two workers with no communication at all (the compute ceiling; independent of R).

Setup traffic (process groups, DDP's and DiLoCo's initial weight broadcast) runs on an unlimited link; only the
timed training loop runs at rate R. Per run it reports tokens/s, compute utilization (time in forward, backward and
optimizer step / wall time of the loop), the bytes each veth end transmitted (`/proc/net/dev` in its namespace)
next to the package's own `bytes_sent`, and the final eval loss (of the global model for DiLoCo methods).

DDP's backward waits for its gradient all-reduce, so DDP's backward compute time is the median backward time of
a few calibration steps run without communication (`no_sync`) right before the timed loop. DDP runs are bounded
by a wall-clock limit (`--ddp-max-seconds`); when DDP stops early, its time per step is extrapolated from the
steps it completed (the output says so). The DiLoCo methods drain their last in-flight exchange at `close()`;
that drain is reported separately: utilization and speedups are steady-state (loop only), `*_incl_drain` too.

Needs root and iproute2 (`apt-get install iproute2`). Run from the repository root:

    python -m benchmarks.wan                      # default sweep, ~15-25 min on 2 CPU cores
    python -m benchmarks.wan --quick              # smoke run: one rate, tiny model, ~1-2 min
    python -m benchmarks.wan --cleanup            # remove namespaces left by a killed run

Outputs (in `--out-dir`, default benchmarks/results/): `wan_results.json`, `wan_results.md`, `wan_utilization.png`.
"""

from __future__ import annotations

import argparse
import atexit
import importlib.util
import json
import math
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from benchmarks.common import RESULTS_DIR, command_line
from benchmarks.netns import SlowLink, cleanup_stale, list_namespaces

REPO_ROOT = Path(__file__).resolve().parents[1]  # the workers run `python -m benchmarks.wan` from here
METHODS = ("ddp", "diloco", "streaming", "diloco_x", "local")
DILOCO_METHODS = ("diloco", "streaming", "diloco_x")
METHOD_LABELS = {
    "ddp": "DDP (all-reduce every step)",
    "diloco": "DiLoCo (H={H}, {diloco_codec}, blocking)",
    "streaming": "Streaming DiLoCo (P={P}, tau=1, {streaming_codec})",
    "diloco_x": "DiLoCoX-style (eager overlap, adaptive PowerSGD rank <= {R} + codec >= fp4, error feedback)",
    "local": "local (no communication)",
}
MASTER_PORT = 29500  # inside our own namespace, so it cannot collide with anything else on the machine
UTILIZATION_TARGET = 0.95

FULL_PROFILE = {
    "rates": "1000,100,10,1",
    "steps": 200,
    "inner_steps": 100,
    "hidden": 128,
    "layers": 4,
    "batch_size": 2,
    "seq_len": 128,
    "ddp_max_seconds": 80.0,
    "regime_rate": "auto",
    "out_dir": RESULTS_DIR,
}
QUICK_PROFILE = {
    "rates": "200",
    "steps": 24,
    "inner_steps": 12,
    "hidden": 64,
    "layers": 4,
    "batch_size": 2,
    "seq_len": 64,
    "ddp_max_seconds": 20.0,
    "regime_rate": "none",
    "out_dir": "outputs/bench_wan_quick",
}


# ----------------------------------------------------------------------------------------------- arguments


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="Smoke run: one generous rate, tiny model, few steps.")
    parser.add_argument("--cleanup", action="store_true", help="Remove namespaces/veths of dead runs and exit.")
    parser.add_argument("--rates", help="Comma-separated link rates in Mbit/s (default 1000,100,10,1).")
    parser.add_argument("--methods", default=",".join(METHODS), help="Comma-separated subset of " + ",".join(METHODS))
    parser.add_argument("--steps", type=int, help="Inner optimizer steps per run (default 200).")
    parser.add_argument("--inner-steps", type=int, help="H of the DiLoCo methods (default 100).")
    parser.add_argument("--fragments", type=int, default=4, help="P of Streaming DiLoCo.")
    parser.add_argument("--hidden", type=int, help="Hidden size of the Llama model (default 128).")
    parser.add_argument("--layers", type=int, help="Decoder layers (default 4).")
    parser.add_argument("--batch-size", type=int, help="Sequences per step per worker (default 2).")
    parser.add_argument("--seq-len", type=int, help="Tokens per sequence (default 128).")
    parser.add_argument("--lowrank-rank", type=int, default=32, help="Largest PowerSGD rank of diloco_x.")
    parser.add_argument(
        "--entropy-coding",
        action="store_true",
        help="Deflate the fp4 payloads of streaming and diloco_x (DiLoCoConfig.entropy_coding).",
    )
    parser.add_argument(
        "--codec",
        choices=("none", "bf16", "fp4"),
        help="Codec of diloco and streaming (default: none for diloco, fp4 for streaming).",
    )
    parser.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate.")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--ddp-max-seconds", type=float, help="Wall-clock limit of one DDP timed loop (default 80).")
    parser.add_argument("--run-timeout", type=float, default=300.0, help="Seconds before a stuck run is killed.")
    parser.add_argument("--regime-ratio", type=float, default=300.0, help="Target DDP comm/compute ratio.")
    parser.add_argument(
        "--regime-rate",
        help="Rate (Mbit/s) for the speedup-over-DDP comparison; 'auto' adds one rate after the sweep where DDP's "
        "comm/compute ratio should be --regime-ratio (extrapolated from its slowest run) unless a swept rate is "
        "within 25%% of it (the default); 'none' (the --quick default) uses the closest swept rate.",
    )
    parser.add_argument("--out-dir", help=f"Where results go (default {RESULTS_DIR}, quick: outputs/bench_wan_quick).")
    parser.add_argument("--worker", help=argparse.SUPPRESS)  # internal: path of a worker spec JSON
    parser.add_argument("--rank", type=int, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    profile = QUICK_PROFILE if args.quick else FULL_PROFILE
    for key, value in profile.items():
        if getattr(args, key) is None:
            setattr(args, key, value)
    args.rate_list = [float(r) for r in str(args.rates).split(",") if r.strip()]
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    unknown = sorted(set(args.method_list) - set(METHODS))
    if unknown:
        parser.error(f"unknown methods {unknown}; choose from {', '.join(METHODS)}")
    if not args.rate_list or any(r <= 0 for r in args.rate_list):
        parser.error("--rates must be positive numbers (Mbit/s)")
    if args.steps < 1 or args.inner_steps < 1 or args.inner_steps % args.fragments:
        parser.error("--steps and --inner-steps must be positive and --inner-steps divisible by --fragments")
    return args


def _codec_label(codec: str) -> str:
    return "fp32" if codec == "none" else codec


def diloco_config(method: str, spec: dict):
    """The `DiLoCoConfig` of a DiLoCo method (None for ddp/local)."""
    from hf_diloco import DiLoCoConfig

    common = {"inner_steps": spec["inner_steps"], "sync_timeout_seconds": spec["run_timeout"]}
    codec = spec.get("codec")
    if method == "diloco":
        return DiLoCoConfig(num_fragments=1, sync_delay=0, overlap="streaming", compression=codec or "none", **common)
    common["entropy_coding"] = spec.get("entropy_coding", False)
    if method == "streaming":
        return DiLoCoConfig(
            num_fragments=spec["fragments"], sync_delay=1, overlap="streaming", compression=codec or "fp4", **common
        )
    if method == "diloco_x":
        return DiLoCoConfig(
            num_fragments=1,
            overlap="eager",
            compression="fp4",
            error_feedback=True,
            lowrank_rank=spec["lowrank_rank"],
            lowrank_min_rank=max(1, spec["lowrank_rank"] // 8),
            adaptive_compression=True,
            **common,
        )
    return None


# ----------------------------------------------------------------------------------------------- data


def build_token_blocks(path: Path, num_train: int, num_eval: int, seq_len: int, seed: int) -> None:
    """Write byte-level token blocks of the stdlib's source: `num_train` training blocks, then `num_eval` eval
    blocks cut from other files, as a flat uint8 file of `(num_train + num_eval) x seq_len` tokens."""
    import random

    from hf_diloco.job.data import stdlib_corpus_files

    files = stdlib_corpus_files()
    random.Random(seed).shuffle(files)

    def take(count: int, start: int) -> tuple[bytes, int]:
        stream, index = bytearray(), start
        while len(stream) < count * seq_len and index < len(files):
            stream += files[index].read_bytes() + b"\n"
            index += 1
        if len(stream) < count * seq_len:
            raise RuntimeError(f"the stdlib has too little source for {count} blocks of {seq_len} bytes")
        return bytes(stream[: count * seq_len]), index

    eval_bytes, next_file = take(num_eval, 0)
    train_bytes, _ = take(num_train, next_file)
    path.write_bytes(train_bytes + eval_bytes)


# ----------------------------------------------------------------------------------------------- worker side


def _die_with_parent() -> None:
    """Ask the kernel to kill this worker if the benchmark process dies (even by SIGKILL)."""
    import ctypes

    pr_set_pdeathsig = 1
    ctypes.CDLL("libc.so.6", use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)


def _wait_for(path: Path, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"waited {timeout:.0f}s for {path.name}")
        time.sleep(0.01)


def _build_model(spec: dict):
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(spec["seed"])
    config = LlamaConfig(
        vocab_size=256,
        hidden_size=spec["hidden"],
        intermediate_size=4 * spec["hidden"],
        num_hidden_layers=spec["layers"],
        num_attention_heads=4,
        num_key_value_heads=4,
        max_position_embeddings=spec["seq_len"],
        tie_word_embeddings=False,
    )
    model = LlamaForCausalLM(config)
    optimizer = torch.optim.AdamW(model.parameters(), lr=spec["lr"], betas=(0.9, 0.95), weight_decay=0.01)
    return model, optimizer


class _WorkerRun:
    """One method on one rank: model, optimizer, and the DDP wrapper or DiLoCo engine."""

    def __init__(self, method: str, spec: dict, rank: int, blocks):
        from torch.nn.parallel import DistributedDataParallel

        from hf_diloco import DiLoCo

        self.method, self.spec, self.rank = method, spec, rank
        self.train, self.eval = blocks
        self.model, self.optimizer = _build_model(spec)
        self.forward_module = self.model
        self.ddp = None
        self.engine = None
        if method == "ddp":
            # The rotary inv_freq buffers are constants; broadcasting them every forward would add traffic.
            self.ddp = DistributedDataParallel(self.model, forward_sync_buffers=False)
            self.forward_module = self.ddp
        elif method in DILOCO_METHODS:
            self.engine = DiLoCo(self.model, self.optimizer, diloco_config(method, spec))
        self.grad_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        self.calibration = self._calibrate()

    def batch(self, step: int):
        size, shard = self.spec["batch_size"], self.train[self.rank :: 2]
        index = [(step * size + i) % len(shard) for i in range(size)]
        return shard[index]

    def _calibrate(self) -> dict:
        """Warm-up forward/backward passes without optimizer step or communication; DDP's backward compute time."""
        import contextlib

        forward, backward = [], []
        for _ in range(4):
            context = self.ddp.no_sync() if self.ddp is not None else contextlib.nullcontext()
            with context:
                batch = self.batch(0)
                t0 = time.perf_counter()
                loss = self.forward_module(input_ids=batch, labels=batch).loss
                t1 = time.perf_counter()
                loss.backward()
                t2 = time.perf_counter()
            self.optimizer.zero_grad(set_to_none=True)
            forward.append(t1 - t0)
            backward.append(t2 - t1)
        return {"forward": statistics.median(forward[1:]), "backward": statistics.median(backward[1:])}

    def timed_loop(self) -> dict:
        import torch
        import torch.distributed as dist

        spec = self.spec
        times = {"forward": 0.0, "backward": 0.0, "backward_measured": 0.0, "optimizer": 0.0, "engine_step": 0.0}
        losses: list[float] = []
        stop = torch.zeros(1)
        start = time.perf_counter()
        for step in range(spec["steps"]):
            batch = self.batch(step)
            t0 = time.perf_counter()
            loss = self.forward_module(input_ids=batch, labels=batch).loss
            t1 = time.perf_counter()
            loss.backward()
            t2 = time.perf_counter()
            self.optimizer.step()
            self.optimizer.zero_grad(set_to_none=True)
            t3 = time.perf_counter()
            if self.engine is not None:
                self.engine.step()
            times["engine_step"] += time.perf_counter() - t3
            times["forward"] += t1 - t0
            times["backward_measured"] += t2 - t1
            # DDP's backward includes waiting for the all-reduce; only the calibrated compute part counts.
            times["backward"] += min(t2 - t1, self.calibration["backward"]) if self.ddp else t2 - t1
            times["optimizer"] += t3 - t2
            losses.append(float(loss.detach()))
            if self.ddp is not None and step + 1 < spec["steps"]:
                elapsed = time.perf_counter() - start
                stop.fill_(float(elapsed + elapsed / (step + 1) > spec["ddp_max_seconds"]))
                dist.all_reduce(stop, op=dist.ReduceOp.MAX)  # both ranks stop after the same step
                if stop.item() > 0:
                    break
        loop_seconds = time.perf_counter() - start
        if self.engine is not None:
            self.engine.close()
        drain_seconds = time.perf_counter() - start - loop_seconds
        steps_done = len(losses)
        compute = times["forward"] + times["backward"] + times["optimizer"]
        return {
            "method": self.method,
            "rank": self.rank,
            "steps_done": steps_done,
            "tokens": steps_done * spec["batch_size"] * spec["seq_len"],
            "loop_seconds": loop_seconds,
            "drain_seconds": drain_seconds,
            "compute_seconds": compute,
            "times": times,
            "calibration": self.calibration,
            "package_bytes_sent": None if self.engine is None else int(self.engine.stats["bytes_sent"]),
            "sync_wait_seconds": None if self.engine is None else float(self.engine.stats["sync_wait_seconds"]),
            "outer_steps": None if self.engine is None else int(self.engine.stats["outer_steps"]),
            "compression_choices": [] if self.engine is None else list(getattr(self.engine.exchange, "choices", [])),
            "grad_bytes": self.grad_bytes,
            "train_loss_last": statistics.fmean(losses[-10:]),
            "eval_loss": self.evaluate(),
        }

    def evaluate(self) -> float:
        import contextlib

        import torch

        context = self.engine.global_weights() if self.engine is not None else contextlib.nullcontext()
        self.model.eval()
        total = 0.0
        with torch.no_grad(), context:
            for chunk in self.eval.split(8):
                total += float(self.model(input_ids=chunk, labels=chunk).loss) * len(chunk)
        self.model.train()
        return total / len(self.eval)


def worker_main(spec_path: str, rank: int) -> None:
    """One rank: join the process group over the veth, then run each method when the benchmark says go."""
    import datetime

    import torch
    import torch.distributed as dist

    _die_with_parent()
    torch.set_num_threads(1)
    spec = json.loads(Path(spec_path).read_text())
    control = Path(spec["control_dir"])
    seq_len = spec["seq_len"]
    tokens = torch.frombuffer(bytearray(Path(spec["data_path"]).read_bytes()), dtype=torch.uint8)
    blocks = tokens.view(-1, seq_len).long()
    train, evaluation = blocks[: spec["num_train"]], blocks[spec["num_train"] :]
    dist.init_process_group("gloo", rank=rank, world_size=2, timeout=datetime.timedelta(seconds=spec["run_timeout"]))
    for method in spec["methods"]:
        _wait_for(control / f"{method}.setup", spec["run_timeout"])
        run = _WorkerRun(method, spec, rank, (train, evaluation))
        dist.barrier()
        if rank == 0:
            (control / f"{method}.ready").touch()
        _wait_for(control / f"{method}.go", spec["run_timeout"])
        result = run.timed_loop()
        out = control / f"{method}.rank{rank}.json"
        out.with_suffix(".tmp").write_text(json.dumps(result))
        out.with_suffix(".tmp").rename(out)
        del run
    dist.destroy_process_group()


# ----------------------------------------------------------------------------------------------- benchmark side

_ACTIVE: dict = {"link": None, "procs": []}


class RunFailed(RuntimeError):
    pass


def _stop_workers() -> None:
    for proc in _ACTIVE["procs"]:
        if proc.poll() is None:
            try:
                os.killpg(proc.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
            proc.wait()
    _ACTIVE["procs"] = []


def _cleanup() -> None:
    """Kill our workers, then remove our namespaces (idempotent; runs from finally, atexit and signals)."""
    _stop_workers()
    link = _ACTIVE["link"]
    if link is not None and not link.destroyed:
        link.destroy()
    _ACTIVE["link"] = None


def _raise_on_signal(signum: int, frame) -> None:
    raise SystemExit(128 + signum)


def _start_workers(link: SlowLink, spec_path: Path, control: Path) -> list[subprocess.Popen]:
    procs = []
    for rank in range(2):
        env = dict(
            os.environ,
            MASTER_ADDR=link.addresses[0],
            MASTER_PORT=str(MASTER_PORT),
            GLOO_SOCKET_IFNAME=link.devices[rank],
            OMP_NUM_THREADS="1",
            HF_HUB_OFFLINE="1",
        )
        command = [*link.exec_prefix(rank), sys.executable, "-m", "benchmarks.wan"]
        command += ["--worker", str(spec_path), "--rank", str(rank)]
        log = open(control / f"worker{rank}.log", "w")  # noqa: SIM115 - lives as long as the process
        procs.append(
            subprocess.Popen(
                command, cwd=REPO_ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        )
        _ACTIVE["procs"].append(procs[-1])
    return procs


def _await(paths: list[Path], procs: list[subprocess.Popen], timeout: float, control: Path, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not all(p.exists() for p in paths):
        # A worker that exited 0 has finished every method; only a failure or both gone without results is fatal.
        dead = [(rank, p.returncode) for rank, p in enumerate(procs) if p.poll() not in (None, 0)]
        if not dead and all(p.poll() == 0 for p in procs) and not all(p.exists() for p in paths):
            dead = [(0, 0)]
        if dead:
            rank, code = dead[0]
            tail = (control / f"worker{rank}.log").read_text()[-2000:]
            raise RunFailed(f"worker {rank} exited with {code} during {what}:\n{tail}")
        if time.monotonic() > deadline:
            raise RunFailed(f"{what} did not finish within {timeout:.0f}s")
        time.sleep(0.02)


def run_rate(link: SlowLink, rate: float, methods: list[str], spec: dict, control: Path) -> list[dict]:
    """Start both workers at one rate and run every method; failures are recorded, never raised."""
    control.mkdir(parents=True)
    spec = dict(spec, control_dir=str(control), methods=methods)
    spec_path = control / "spec.json"
    spec_path.write_text(json.dumps(spec))
    link.set_rate(None)
    procs = _start_workers(link, spec_path, control)
    results: list[dict] = []
    try:
        for method in methods:
            link.set_rate(None)
            (control / f"{method}.setup").touch()
            _await([control / f"{method}.ready"], procs, spec["run_timeout"], control, f"{method} setup")
            link.set_rate(rate)
            before = [link.device_bytes(end) for end in range(2)]
            (control / f"{method}.go").touch()
            outputs = [control / f"{method}.rank{r}.json" for r in range(2)]
            _await(outputs, procs, spec["run_timeout"], control, f"{method} at {rate:g} Mbit/s")
            # Read after both ranks evaluated (no traffic): the tail of the last send has left the queues by now.
            after = [link.device_bytes(end) for end in range(2)]
            link.set_rate(None)
            ranks = [json.loads(p.read_text()) for p in outputs]
            for rank, (start, end) in enumerate(zip(before, after)):
                ranks[rank].update(veth_rx_bytes=end[0] - start[0], veth_tx_bytes=end[1] - start[1])
            results.append(combine(ranks, rate, spec))
            print(_progress_line(results[-1]), flush=True)
        for proc in procs:
            proc.wait(timeout=60)
    except (RunFailed, subprocess.TimeoutExpired) as error:
        done = {r["method"] for r in results}
        for method in methods:
            if method not in done:
                results.append({"method": method, "rate_mbit": rate, "status": "failed", "error": str(error)})
        print(f"[bench_wan] rate {rate:g} Mbit/s failed: {error}", file=sys.stderr, flush=True)
    finally:
        _stop_workers()
        link.set_rate(None)
    return results


def combine(ranks: list[dict], rate: float | None, spec: dict) -> dict:
    """Both ranks' measurements of one run -> one row (per-rank byte counts are means over the two ranks)."""
    steps = min(r["steps_done"] for r in ranks)
    loop = max(r["loop_seconds"] for r in ranks)
    drain = max(r["loop_seconds"] + r["drain_seconds"] for r in ranks) - loop
    compute = statistics.fmean(r["compute_seconds"] for r in ranks)
    package = [r["package_bytes_sent"] for r in ranks if r["package_bytes_sent"] is not None]
    method = ranks[0]["method"]
    row = {
        "method": method,
        "rate_mbit": rate,
        "status": "ok",
        "steps_done": steps,
        "steps_target": spec["steps"],
        "truncated": steps < spec["steps"],
        "tokens": sum(r["tokens"] for r in ranks),
        "loop_seconds": loop,
        "drain_seconds": drain,
        "tokens_per_second": sum(r["tokens"] for r in ranks) / loop,
        "tokens_per_second_incl_drain": sum(r["tokens"] for r in ranks) / (loop + drain),
        "utilization": statistics.fmean(r["compute_seconds"] / r["loop_seconds"] for r in ranks),
        "utilization_incl_drain": statistics.fmean(
            r["compute_seconds"] / (r["loop_seconds"] + r["drain_seconds"]) for r in ranks
        ),
        "seconds_per_step": loop / steps,
        "seconds_per_step_incl_drain": (loop + drain) / steps,
        "compute_seconds_per_step": compute / steps,
        "wire_tx_bytes_per_rank": statistics.fmean(r["veth_tx_bytes"] for r in ranks),
        "wire_rx_bytes_per_rank": statistics.fmean(r["veth_rx_bytes"] for r in ranks),
        "package_bytes_sent_per_rank": statistics.fmean(package) if package else None,
        "sync_wait_seconds": statistics.fmean(r["sync_wait_seconds"] or 0.0 for r in ranks),
        "outer_steps": ranks[0]["outer_steps"],
        "compression_choices": ranks[0]["compression_choices"],
        "grad_bytes": ranks[0]["grad_bytes"],
        "train_loss_last10": statistics.fmean(r["train_loss_last"] for r in ranks),
        "eval_loss": statistics.fmean(r["eval_loss"] for r in ranks),
        "ranks": ranks,
    }
    row["comm_seconds_per_step"] = max(0.0, row["seconds_per_step"] - row["compute_seconds_per_step"])
    row["comm_compute_ratio"] = row["comm_seconds_per_step"] / row["compute_seconds_per_step"]
    if method == "ddp":
        # gloo's all-reduce of 2 ranks sends each rank's full gradient once (half in the reduce-scatter, half in
        # the all-gather); the package does not count DDP's traffic, so this analytic payload stands in for it.
        row["analytic_payload_bytes_per_rank"] = steps * row["grad_bytes"]
        row["seconds_for_all_steps_extrapolated"] = row["seconds_per_step"] * spec["steps"]
    return row


def _progress_line(row: dict) -> str:
    rate = "-" if row["rate_mbit"] is None else f"{row['rate_mbit']:g}"
    return (
        f"[bench_wan] {row['method']:>9} @ {rate:>5} Mbit/s: {row['steps_done']}/{row['steps_target']} steps, "
        f"{row['tokens_per_second']:.0f} tok/s, util {row['utilization']:.3f}, "
        f"wire {row['wire_tx_bytes_per_rank'] / 1e6:.2f} MB/rank, eval loss {row['eval_loss']:.3f}"
    )


# ----------------------------------------------------------------------------------------------- summary


def summarize(runs: list[dict], spec: dict) -> dict:
    """Lowest rate at >= 95% utilization per method, DDP's comm/compute regime and the speedups there."""
    ok = [r for r in runs if r.get("status") == "ok"]
    by_method: dict[str, dict[float, dict]] = {}
    for row in ok:
        by_method.setdefault(row["method"], {})[row["rate_mbit"]] = row
    lowest = {}
    for method, rows in by_method.items():
        if method == "local":
            continue
        good = [rate for rate, row in rows.items() if row["utilization"] >= UTILIZATION_TARGET]
        lowest[method] = min(good) if good else None
    summary: dict = {"utilization_target": UTILIZATION_TARGET, "lowest_rate_mbit_at_target": lowest}
    ddp = by_method.get("ddp", {})
    if ddp:
        summary["ddp_rate_mbit_at_target_estimate"] = _ddp_rate_estimate(ddp)
        summary["regime"] = _regime(ddp, by_method, spec["regime_ratio"])
    reference = lowest.get("ddp") or summary.get("ddp_rate_mbit_at_target_estimate")
    summary["bandwidth_ratio_vs_ddp"] = {
        method: (reference / rate if reference and rate else None)
        for method, rate in lowest.items()
        if method != "ddp"
    }
    return summary


def _ddp_rate_estimate(ddp: dict[float, dict]) -> float | None:
    """DDP's rate for 95% utilization, extrapolated from its slowest-rate run (comm time scales as 1/R there)."""
    rate = min(ddp)
    row = ddp[rate]
    allowed = row["compute_seconds_per_step"] * (1 / UTILIZATION_TARGET - 1)
    if row["comm_seconds_per_step"] <= 0:
        return None
    return rate * row["comm_seconds_per_step"] / allowed


def ddp_compute_reference(ddp_rows: list[dict]) -> float:
    """DDP's compute time per step, the median over its runs: it does not depend on the rate, and one run of a
    step or two (the low rates) is at the mercy of whatever else the machine's CPUs are doing."""
    return statistics.median(r["compute_seconds_per_step"] for r in ddp_rows)


def _regime(ddp: dict[float, dict], by_method: dict, target: float) -> dict:
    compute = ddp_compute_reference(list(ddp.values()))
    ratios = {rate: row["comm_seconds_per_step"] / compute for rate, row in ddp.items()}
    rate = min(ddp, key=lambda r: abs(math.log(max(ratios[r], 1e-9) / target)))
    base = ddp[rate]
    regime = {
        "rate_mbit": rate,
        "ddp_comm_compute_ratio": ratios[rate],
        "ddp_compute_seconds_per_step_median": compute,
        "ddp_comm_compute_ratio_own_compute": base["comm_compute_ratio"],
        "ddp_steps_completed": base["steps_done"],
        "ddp_seconds_per_step": base["seconds_per_step"],
        "ddp_seconds_for_all_steps": base["seconds_per_step"] * base["steps_target"],
        "ddp_extrapolated": base["truncated"],
        "speedup_vs_ddp": {},
        "speedup_vs_ddp_incl_drain": {},
    }
    for method, rows in by_method.items():
        row = rows.get(rate) or rows.get(None)  # local runs once, independent of the rate
        if method == "ddp" or row is None:
            continue
        regime["speedup_vs_ddp"][method] = base["seconds_per_step"] / row["seconds_per_step"]
        regime["speedup_vs_ddp_incl_drain"][method] = base["seconds_per_step"] / row["seconds_per_step_incl_drain"]
    return regime


# ----------------------------------------------------------------------------------------------- reports


def _fmt_rate(rate: float | None) -> str:
    return "any (no traffic)" if rate is None else f"{rate:g}"


def write_markdown(path: Path, report: dict) -> None:
    spec, summary = report["settings"], report["summary"]
    lines = [
        "| rate (Mbit/s) | method | steps | tokens/s | utilization | util. incl. drain | wire tx MB/rank "
        "| package MB/rank | eval loss |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in report["runs"]:
        if row.get("status") != "ok":
            reason = row["error"].strip().splitlines()[-1][:100]
            lines.append(f"| {_fmt_rate(row['rate_mbit'])} | {row['method']} | failed: {reason} |||||||")
            continue
        package = row["package_bytes_sent_per_rank"]
        if row["method"] == "ddp":
            package_text = f"({row['analytic_payload_bytes_per_rank'] / 1e6:.2f} analytic)"
        else:
            package_text = "-" if package is None else f"{package / 1e6:.2f}"
        steps = f"{row['steps_done']}/{row['steps_target']}" + (" (time limit)" if row["truncated"] else "")
        lines.append(
            f"| {_fmt_rate(row['rate_mbit'])} | {row['method']} | {steps} | {row['tokens_per_second']:.0f} "
            f"| {row['utilization']:.3f} | {row['utilization_incl_drain']:.3f} "
            f"| {row['wire_tx_bytes_per_rank'] / 1e6:.2f} | {package_text} | {row['eval_loss']:.3f} |"
        )
    lines += ["", f"Lowest swept rate at >= {UTILIZATION_TARGET:.0%} utilization (Mbit/s):", ""]
    for method, rate in summary["lowest_rate_mbit_at_target"].items():
        lines.append(f"- {method}: {'none of the swept rates' if rate is None else f'{rate:g}'}")
    if "ddp_rate_mbit_at_target_estimate" in summary:
        estimate = summary["ddp_rate_mbit_at_target_estimate"]
        lines.append(f"- ddp, extrapolated from its slowest-rate run: {estimate:.0f} Mbit/s")
        for method, ratio in summary["bandwidth_ratio_vs_ddp"].items():
            if ratio is not None:
                lines.append(f"  - {method} needs {ratio:.0f}x less bandwidth than DDP for the same utilization")
    regime = summary.get("regime")
    if regime:
        lines += [
            "",
            f"Regime: at {regime['rate_mbit']:g} Mbit/s DDP's communication per step is "
            f"{regime['ddp_comm_compute_ratio']:.0f}x its compute (median compute "
            f"{regime['ddp_compute_seconds_per_step_median']:.3f} s/step over the DDP runs; "
            f"{regime['ddp_seconds_per_step']:.2f} s/step in all"
            + (
                f", extrapolated from the {regime['ddp_steps_completed']} step(s) it completed within the time limit"
                if regime["ddp_extrapolated"]
                else ""
            )
            + f"; {spec['steps']} steps would take {regime['ddp_seconds_for_all_steps']:.0f} s). Speedup over DDP "
            "(time per step; in brackets with the final drain of the last exchange):",
            "",
        ]
        for method, speedup in regime["speedup_vs_ddp"].items():
            lines.append(f"- {method}: {speedup:.0f}x ({regime['speedup_vs_ddp_incl_drain'][method]:.0f}x)")
    path.write_text("\n".join(lines) + "\n")


def plot(path: Path, report: dict) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ok = [r for r in report["runs"] if r.get("status") == "ok"]
    figure, (left, right) = plt.subplots(1, 2, figsize=(11, 4.2))
    for method in METHODS:
        rows = sorted((r for r in ok if r["method"] == method), key=lambda r: r["rate_mbit"] or 0)
        if not rows:
            continue
        if method == "local":
            for axis, key in ((left, "utilization"), (right, "tokens_per_second")):
                axis.axhline(rows[0][key], color="gray", linestyle="--", label="local (no communication)")
            continue
        rates = [r["rate_mbit"] for r in rows]
        left.plot(rates, [r["utilization"] for r in rows], marker="o", label=method)
        right.plot(rates, [r["tokens_per_second"] for r in rows], marker="o", label=method)
    left.axhline(UTILIZATION_TARGET, color="red", linewidth=0.8, linestyle=":", label="95% target")
    for axis in (left, right):
        axis.set_xscale("log")
        axis.set_xlabel("link rate (Mbit/s, tc tbf on a veth pair)")
        axis.grid(True, which="both", alpha=0.3)
    left.set_ylabel("compute utilization")
    left.set_ylim(0, 1.05)
    right.set_ylabel("tokens / s (2 workers)")
    right.set_yscale("log")
    left.legend(fontsize=8)
    figure.suptitle("Two workers over a rate-limited link")
    figure.tight_layout()
    figure.savefig(path, dpi=120)
    plt.close(figure)


# ----------------------------------------------------------------------------------------------- main


SPEC_KEYS = (
    "steps",
    "inner_steps",
    "fragments",
    "lowrank_rank",
    "entropy_coding",
    "codec",
    "hidden",
    "layers",
    "batch_size",
    "seq_len",
    "lr",
    "seed",
    "ddp_max_seconds",
    "run_timeout",
    "regime_ratio",
)
NOTES = [
    "Setup traffic (process groups, initial weight broadcasts) runs unlimited; only the timed loop runs at R.",
    "DDP compute time uses its backward time measured without communication (no_sync calibration).",
    "DDP runs stop at --ddp-max-seconds; their time per step is extrapolated from the completed steps.",
    "utilization and speedups are steady state (training loop); *_incl_drain adds the final close() drain.",
    "wire bytes: veth tx bytes per rank (payload, TCP/IP headers, ACKs; a GSO super-packet counts one header), "
    "from /proc/net/dev in each namespace.",
    "diloco_x: eager overlap + the package's adaptive low-rank/codec policy; no pipeline parallelism.",
]


def _sweep(args: argparse.Namespace, work: Path) -> tuple[dict, list[dict]]:
    spec = {key: getattr(args, key) for key in SPEC_KEYS}
    num_train, num_eval = 2 * args.steps * args.batch_size, 16
    data_path = work / "tokens.bin"
    build_token_blocks(data_path, num_train, num_eval, args.seq_len, args.seed)
    spec.update(data_path=str(data_path), num_train=num_train, num_eval=num_eval)
    link = SlowLink.create()
    _ACTIVE["link"] = link
    spec.update(devices=list(link.devices), addresses=list(link.addresses))
    runs: list[dict] = []
    for index, rate in enumerate(args.rate_list):
        # The compute ceiling does not depend on the rate: measure it once, with the first rate's workers.
        methods = [m for m in args.method_list if m != "local" or index == 0]
        runs += run_rate(link, rate, methods, spec, work / f"rate_{index}")
    extra = regime_rate(args, runs)
    if extra is not None:
        print(f"[bench_wan] adding {extra:g} Mbit/s, where DDP's comm/compute ratio should be ~{args.regime_ratio:g}")
        methods = [m for m in args.method_list if m != "local"]
        runs += run_rate(link, extra, methods, spec, work / "rate_regime")
    for row in runs:
        if row["method"] == "local":
            row["rate_mbit"] = None
    return spec, runs


def regime_rate(args: argparse.Namespace, runs: list[dict]) -> float | None:
    """The extra rate to run for the speedup comparison, or None when the sweep already has one (see --regime-rate)."""
    if args.regime_rate == "none":
        return None
    if args.regime_rate != "auto":
        rate = float(args.regime_rate)
        return None if rate in args.rate_list else rate
    ddp = [r for r in runs if r["method"] == "ddp" and r.get("status") == "ok"]
    if not ddp:
        return None
    compute = ddp_compute_reference(ddp)
    if any(abs(math.log(max(r["comm_seconds_per_step"] / compute, 1e-9) / args.regime_ratio)) < 0.22 for r in ddp):
        return None
    slowest = min(ddp, key=lambda r: r["rate_mbit"])
    # DDP's time per step at a low rate is all bandwidth, so its comm/compute ratio scales as 1/R.
    ratio = slowest["comm_seconds_per_step"] / compute
    rate = float(f"{slowest['rate_mbit'] * ratio / args.regime_ratio:.2g}")
    return None if rate in args.rate_list else rate


def run_benchmark(args: argparse.Namespace) -> dict:
    """Run the sweep, always removing the namespaces, then write the JSON, markdown and PNG reports."""
    out_dir = Path(args.out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    # The pid in the name lets a test find this run's worker processes.
    work = Path(tempfile.mkdtemp(prefix=f"bench_wan_{os.getpid()}_"))
    started, load_before = time.time(), os.getloadavg()
    try:
        spec, runs = _sweep(args, work)
    finally:
        _cleanup()
        shutil.rmtree(work, ignore_errors=True)
    report = {
        "command": command_line("wan"),
        "settings": spec | {"rates": args.rate_list, "methods": args.method_list},
        "method_labels": {
            m: METHOD_LABELS[m].format(
                H=args.inner_steps,
                P=args.fragments,
                R=args.lowrank_rank,
                diloco_codec=_codec_label(args.codec or "none"),
                streaming_codec=_codec_label(args.codec or "fp4"),
            )
            for m in METHODS
        },
        "host": {"cpus": os.cpu_count(), "loadavg_before": load_before, "loadavg_after": os.getloadavg()},
        "wall_seconds": time.time() - started,
        "runs": runs,
        "summary": summarize(runs, spec),
        "notes": NOTES,
    }
    write_report(out_dir, report)
    return report


def write_report(out_dir: Path, report: dict) -> None:
    """JSON and markdown first, then the plot: a missing plotting library must not lose a finished sweep."""
    (out_dir / "wan_results.json").write_text(json.dumps(report, indent=1))
    write_markdown(out_dir / "wan_results.md", report)
    if importlib.util.find_spec("matplotlib") is None:
        print(f"matplotlib is not installed: no {out_dir / 'wan_utilization.png'} (the results are in {out_dir})")
    else:
        plot(out_dir / "wan_utilization.png", report)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.worker:
        worker_main(args.worker, args.rank)
        return 0
    if args.cleanup:
        removed = cleanup_stale()
        print(f"removed: {', '.join(removed) if removed else 'nothing'}; namespaces now: {list_namespaces()}")
        return 0
    atexit.register(_cleanup)
    for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(signum, _raise_on_signal)
    report = run_benchmark(args)
    print((Path(args.out_dir) / "wan_results.md").read_text())
    failed = [r for r in report["runs"] if r.get("status") != "ok"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
