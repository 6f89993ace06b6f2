"""The peers side by side: hf_diloco's engine, torchft's DiLoCo and Accelerate's LocalSGD on the same run.

    python -m benchmarks.peers --sizes 7 33 --inner-steps 5 --rounds 3

Every implementation trains the same Llama (built from a `LlamaConfig`, random init, the same seed) on 2 worker
processes over gloo on this machine, with the same batches (random tokens, a fixed seed per rank and step), AdamW as
the inner optimizer, fp32 throughout, H inner steps per outer round:

- `hf_diloco`: `hf_diloco.DiLoCo` (codec none; a second row with fp4, which torchft quantizes only on a GPU);
- `torchft`: `torchft.local_sgd.DiLoCo` with a real Lighthouse (in this process) and one `Manager` per worker;
- `reference`: plain DiLoCo written here (all_reduce of the pseudo-gradient, torch's Nesterov SGD on θg);
- `accelerate`: `accelerate.local_sgd.LocalSGD` (the parameters averaged every H steps; no outer optimizer).

The DiLoCo ones use Nesterov SGD outside (lr 0.7, momentum 0.9). Per step each worker records this process's CPU
time (`time.process_time()`, every thread of the process: gloo's and torchft's too) and wall time at five points:
before the forward, after AdamW's update (a step post hook registered before any implementation's), after the
implementation's step, and after `zero_grad` (the step's end; releasing the gradients is the allocator's work, which
varies with what else the process holds, so it counts in the step's time and not in the implementation's). A sync
is what the implementation does after AdamW's update on the last step of a round (for torchft: its quorum,
all_reduce, should_commit and outer step; both workers leave a barrier just before it, so wall time does not count
waiting for the other worker's compute). Reported per implementation: the median CPU time of an inner step without a
sync, the median CPU time the implementation adds to such a step, and the CPU and wall time of
a sync per GB of fp32 model (the median over the rounds after the first; the first builds groups and buffers).
θg after each round is compared between `hf_diloco` (none), `torchft` and `reference` (max abs difference).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from benchmarks.common import RESULTS_DIR, command_line

WORKERS = 2
OUTER_LR, OUTER_MOMENTUM, INNER_LR = 0.7, 0.9, 3e-4
IMPLEMENTATIONS = ["hf_diloco", "hf_diloco_fp4", "torchft", "reference", "accelerate"]
AGREEING = ["hf_diloco", "torchft", "reference"]  # the fp32 DiLoCo ones: the same θg up to fp32 rounding
# Llama shapes by their approximate parameter count in millions (untied head, full key-value heads).
SIZES = {
    7: dict(hidden_size=256, intermediate_size=688, num_hidden_layers=6, num_attention_heads=4, vocab_size=4096),
    33: dict(hidden_size=512, intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8, vocab_size=8192),
    110: dict(hidden_size=768, intermediate_size=2048, num_hidden_layers=12, num_attention_heads=12, vocab_size=16384),
    # For the plumbing test: a few thousand parameters.
    0: dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, vocab_size=64),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--sizes", type=int, nargs="+", default=[7, 33], choices=sorted(SIZES))
    parser.add_argument("--implementations", nargs="+", default=IMPLEMENTATIONS, choices=IMPLEMENTATIONS)
    parser.add_argument("--inner-steps", type=int, default=5, help="H, the inner steps of a round.")
    parser.add_argument("--rounds", type=int, default=3, help="Outer rounds per run (at least 2).")
    parser.add_argument("--batch-size", type=int, default=2)
    parser.add_argument("--seq-len", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1, help="torch threads per worker process.")
    parser.add_argument("--out", default=f"{RESULTS_DIR}/peers", help="Writes OUT.json and OUT.md.")
    return parser


def main(argv: list[str] | None = None) -> dict:
    args = build_parser().parse_args(argv)
    if args.rounds < 2:
        raise SystemExit(f"--rounds {args.rounds}: at least 2 are needed (the first round is not timed)")
    rows, agreement, moved = [], {}, {}
    load_before = os.getloadavg()
    with tempfile.TemporaryDirectory(prefix="peers_") as work:
        for size in args.sizes:
            thetas = {}
            for name in args.implementations:
                row, theta = run_pair(name, size, args, Path(work) / f"{name}_{size}")
                rows.append(row)
                print(_row_line(row), flush=True)
                if name in AGREEING:
                    thetas[name] = theta
            agreement[str(size)] = compare(thetas)
            if thetas:  # how far θg moved in the run: the scale the differences above are small against
                first = next(iter(thetas.values()))
                moved[str(size)] = float((first[-1] - first[0]).abs().max())
    result = {
        "command": command_line("peers", argv),
        "settings": {k: v for k, v in vars(args).items() if k != "out"} | {"workers": WORKERS},
        "versions": versions(),
        "rows": rows,
        "theta_g_max_abs_diff": agreement,
        "theta_g_max_abs_change_first_to_last_round": moved,
        "loadavg_before_after": [load_before, os.getloadavg()],
    }
    write_report(result, Path(args.out))
    return result


def versions() -> dict[str, str]:
    import accelerate
    import torchft
    import transformers

    found = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "accelerate": accelerate.__version__,
    }
    return found | {"torchft": getattr(torchft, "__version__", "0.2.0")}


def run_pair(name: str, size: int, args: argparse.Namespace, work: Path) -> tuple[dict, list[torch.Tensor]]:
    """Both workers of one implementation at one size; returns rank 0's timings and its θg after every round."""
    work.mkdir(parents=True)
    lighthouse = None
    if name == "torchft":
        os.environ.setdefault("RUST_LOG", "warn")
        from torchft._torchft import LighthouseServer

        lighthouse = LighthouseServer(bind="[::]:0", min_replicas=WORKERS, join_timeout_ms=10000)
    spec = dict(vars(args), name=name, size=size, work=str(work), lighthouse=lighthouse and lighthouse.address())
    try:
        mp.start_processes(_worker, args=(spec,), nprocs=WORKERS, start_method="spawn", join=True)
    finally:
        if lighthouse is not None:
            lighthouse.shutdown()
    records = [json.loads((work / f"timings_{rank}.json").read_text()) for rank in range(WORKERS)]
    theta = torch.load(work / "theta_0.pt")
    return summarize(name, size, records), theta


def summarize(name: str, size: int, records: list[dict]) -> dict:
    """Medians over both workers: steps without a sync after the first round, syncs after the first round."""
    numel = records[0]["numel"]
    gigabytes = numel * 4 / 1e9
    steps, hooks, sync_cpu, sync_wall, first = [], [], [], [], []
    for record in records:
        for step in record["steps"]:
            if step["sync"]:
                (first if step["round"] == 1 else sync_cpu).append(step["hook_cpu"])
                if step["round"] > 1:
                    sync_wall.append(step["hook_wall"])
            elif step["round"] > 1:
                steps.append(step["step_cpu"])
                hooks.append(step["hook_cpu"])
    return {
        "implementation": name,
        "size": size,
        "parameters": numel,
        "step_cpu_s": statistics.median(steps),
        "step_overhead_cpu_s": statistics.median(hooks),
        "sync_cpu_s": statistics.median(sync_cpu),
        "sync_wall_s": statistics.median(sync_wall),
        "sync_cpu_s_per_gb": statistics.median(sync_cpu) / gigabytes,
        "sync_wall_s_per_gb": statistics.median(sync_wall) / gigabytes,
        "first_sync_cpu_s": statistics.median(first),
        "syncs_timed": len(sync_cpu),
    }


def compare(thetas: dict[str, list[torch.Tensor]]) -> dict[str, list[float]]:
    """Max abs difference of θg after every round, for each pair of the fp32 DiLoCo implementations."""
    names = sorted(thetas)
    return {
        f"{a} vs {b}": [float((x - y).abs().max()) for x, y in zip(thetas[a], thetas[b])]
        for i, a in enumerate(names)
        for b in names[i + 1 :]
    }


# ----------------------------------------------------------------------------------------------- worker


def _worker(rank: int, spec: dict) -> None:
    torch.set_num_threads(spec["threads"])
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(WORKERS), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(WORKERS))
    os.environ["OMP_NUM_THREADS"] = str(spec["threads"])
    work = Path(spec["work"])
    dist.init_process_group("gloo", init_method=f"file://{work / 'store'}", rank=rank, world_size=WORKERS)
    model = build_model(spec["size"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=INNER_LR)
    clock = StepClock()
    optimizer.register_step_post_hook(clock.after_update)  # before any implementation's hook: it runs first
    start, rounds_done, forward = SETUPS[spec["name"]](model, optimizer, rank, spec)
    H = spec["inner_steps"]
    thetas, steps = [], []
    with start() as after_step:
        for t in range(1, H * spec["rounds"] + 1):
            sync = t % H == 0
            clock.start()
            tokens = batch(rank, t, spec)
            loss = forward(input_ids=tokens, labels=tokens).loss
            loss.backward()
            if sync:
                clock.pause()
                dist.barrier()  # the sync's time then counts no wait for the other worker's compute
                clock.resume()
            optimizer.step()
            after_step()
            clock.implementation_done()  # the gradients' release below is the allocator's, not the implementation's
            optimizer.zero_grad(set_to_none=True)
            steps.append(clock.stop(t, sync, (t - 1) // H + 1))
            if sync:
                thetas.append(rounds_done())
    numel = sum(p.numel() for p in model.parameters())
    (work / f"timings_{rank}.json").write_text(json.dumps({"numel": numel, "steps": steps}))
    if rank == 0:
        torch.save(thetas, work / "theta_0.pt")
    dist.barrier()
    dist.destroy_process_group()


def build_model(size: int) -> torch.nn.Module:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(**SIZES[size], max_position_embeddings=512, tie_word_embeddings=False)
    return LlamaForCausalLM(config).float()


def batch(rank: int, step: int, spec: dict) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * rank + step)
    vocab = SIZES[spec["size"]]["vocab_size"]
    return torch.randint(0, vocab, (spec["batch_size"], spec["seq_len"]), generator=generator)


class StepClock:
    """CPU and wall time of one step: the whole step, and the part after AdamW's update (the implementation's)."""

    def __init__(self):
        self.paused_cpu = self.paused_wall = 0.0

    @staticmethod
    def now() -> tuple[float, float]:
        return time.process_time(), time.perf_counter()

    def start(self) -> None:
        self.begin, self.update, self.paused_cpu, self.paused_wall = self.now(), None, 0.0, 0.0

    def pause(self) -> None:
        self.paused_at = self.now()

    def resume(self) -> None:
        cpu, wall = self.now()
        self.paused_cpu += cpu - self.paused_at[0]
        self.paused_wall += wall - self.paused_at[1]

    def after_update(self, *_args) -> None:
        self.update = self.now()

    def implementation_done(self) -> None:
        self.done = self.now()

    def stop(self, t: int, sync: bool, round_index: int) -> dict:
        cpu, _ = self.now()
        return {
            "t": t,
            "round": round_index,
            "sync": sync,
            "step_cpu": cpu - self.begin[0] - self.paused_cpu,
            "hook_cpu": self.done[0] - self.update[0],
            "hook_wall": self.done[1] - self.update[1],
        }


# Each setup returns (start, rounds_done, forward): `start()` is a context manager yielding the call made after every
# optimizer step, `rounds_done()` the flat fp32 θg after a sync (in named_parameters order), `forward` the module
# the training step calls (the model, or the wrapper the implementation puts around it).
Setup = Callable[[torch.nn.Module, torch.optim.Optimizer, int, dict], tuple[Callable, Callable]]


def _flat(tensors) -> torch.Tensor:
    return torch.cat([t.detach().reshape(-1).float() for t in tensors])


def setup_hf_diloco(model, optimizer, rank: int, spec: dict, compression: str = "none"):
    import contextlib

    from hf_diloco import DiLoCo, DiLoCoConfig

    config = DiLoCoConfig(
        inner_steps=spec["inner_steps"], outer_lr=OUTER_LR, outer_momentum=OUTER_MOMENTUM, compression=compression
    )
    engine = DiLoCo(model, optimizer, config)

    @contextlib.contextmanager
    def start():
        yield engine.step
        engine.close()

    names = [name for name, _ in model.named_parameters()]
    return start, lambda: _flat(engine.global_parameters()[name] for name in names), model


def setup_hf_diloco_fp4(model, optimizer, rank: int, spec: dict):
    return setup_hf_diloco(model, optimizer, rank, spec, compression="fp4")


def setup_torchft(model, optimizer, rank: int, spec: dict):
    import contextlib
    from datetime import timedelta

    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo as TorchftDiLoCo

    store = dist.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    timeout = timedelta(seconds=120)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timeout),
        load_state_dict=None,
        state_dict=None,
        min_replica_size=WORKERS,
        use_async_quorum=False,  # torchft's DiLoCo requires it
        init_sync=False,  # both workers start from the same seed: no copy of the model at the first quorum
        timeout=timeout,
        quorum_timeout=timeout,
        rank=0,
        world_size=1,
        store_addr="localhost",
        store_port=store.port,
        lighthouse_addr=spec["lighthouse"],
        replica_id=f"peer{rank}",
        hostname="localhost",
    )
    outer = torch.optim.SGD(model.parameters(), lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    diloco = TorchftDiLoCo(manager, [model], optimizer, outer, sync_every=spec["inner_steps"])

    @contextlib.contextmanager
    def start():
        with diloco:
            yield lambda: None  # the sync runs inside optimizer.step(), in torchft's post hook
        manager.shutdown(wait=False)
        store_keepalive.clear()

    store_keepalive = [store]
    names = [name for name, _ in model.named_parameters()]
    return start, lambda: _flat(diloco._fragments[0].original_parameters[name] for name in names), model


def setup_reference(model, optimizer, rank: int, spec: dict):
    """Plain DiLoCo: Δ = θg - θm averaged by all_reduce, torch's Nesterov SGD on θg, θm <- θg."""
    import contextlib

    params = list(model.parameters())
    global_params = [p.detach().clone() for p in params]
    outer = torch.optim.SGD(global_params, lr=OUTER_LR, momentum=OUTER_MOMENTUM, nesterov=True)
    counter = {"t": 0}

    def after_step():
        counter["t"] += 1
        if counter["t"] % spec["inner_steps"]:
            return
        with torch.no_grad():
            for g, p in zip(global_params, params):
                delta = g - p
                dist.all_reduce(delta)
                g.grad = delta.div_(WORKERS)
            outer.step()
            for g, p in zip(global_params, params):
                p.copy_(g)

    @contextlib.contextmanager
    def start():
        yield after_step

    return start, lambda: _flat(global_params), model


def setup_accelerate(model, optimizer, rank: int, spec: dict):
    import contextlib

    from accelerate import Accelerator
    from accelerate.local_sgd import LocalSGD

    accelerator = Accelerator(cpu=True)
    wrapped = accelerator.prepare(model)

    @contextlib.contextmanager
    def start():
        with LocalSGD(accelerator, wrapped, local_sgd_steps=spec["inner_steps"]) as local_sgd:
            yield local_sgd.step

    return start, lambda: _flat(model.parameters()), wrapped


SETUPS: dict[str, Setup] = {
    "hf_diloco": setup_hf_diloco,
    "hf_diloco_fp4": setup_hf_diloco_fp4,
    "torchft": setup_torchft,
    "reference": setup_reference,
    "accelerate": setup_accelerate,
}


# ----------------------------------------------------------------------------------------------- report


def _row_line(row: dict) -> str:
    return (
        f"{row['implementation']:>14} {row['parameters'] / 1e6:6.2f} M: step {row['step_cpu_s']:.4f} CPU s "
        f"(+{row['step_overhead_cpu_s'] * 1e3:.3f} ms after AdamW), sync {row['sync_cpu_s']:.3f} CPU s "
        f"{row['sync_wall_s']:.3f} wall s ({row['sync_cpu_s_per_gb']:.2f} / {row['sync_wall_s_per_gb']:.2f} per GB)"
    )


def write_report(result: dict, out: Path) -> None:
    out.parent.mkdir(parents=True, exist_ok=True)
    settings = result["settings"]
    lines = [
        f"`{result['command']}` ({settings['workers']} workers, H = {settings['inner_steps']}, "
        f"{settings['rounds']} rounds, batch {settings['batch_size']} x {settings['seq_len']} tokens, "
        f"{settings['threads']} torch thread(s) per worker; {', '.join(f'{k} {v}' for k, v in result['versions'].items())})",
        "",
        "| implementation | parameters | CPU s per inner step | CPU ms added per step | sync CPU s | sync wall s "
        "| sync CPU s per GB | sync wall s per GB | first sync CPU s |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in result["rows"]:
        lines.append(
            f"| {row['implementation']} | {row['parameters'] / 1e6:.2f} M | {row['step_cpu_s']:.4f} "
            f"| {row['step_overhead_cpu_s'] * 1e3:.3f} | {row['sync_cpu_s']:.3f} | {row['sync_wall_s']:.3f} "
            f"| {row['sync_cpu_s_per_gb']:.2f} | {row['sync_wall_s_per_gb']:.2f} | {row['first_sync_cpu_s']:.3f} |"
        )
    lines += ["", "θg max abs difference after each round:", ""]
    for size, change in result["theta_g_max_abs_change_first_to_last_round"].items():
        lines.append(f"- {size} M: θg moved by up to {change:.2e} from the first round to the last")
    for size, pairs in result["theta_g_max_abs_diff"].items():
        for pair, diffs in pairs.items():
            lines.append(f"- {size} M, {pair}: " + ", ".join(f"{d:.2e}" for d in diffs))
    Path(str(out) + ".json").write_text(json.dumps(result, indent=2))
    Path(str(out) + ".md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
