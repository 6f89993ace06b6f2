"""The GPU lane's checks of hf_diloco, in one command: at most 5 minutes on one CUDA GPU, results as JSON.

    python scripts/gpu_check.py --out gpu_check.json                 # every check, on cuda
    python scripts/gpu_check.py --device cpu --checks workers        # a dry run of some checks on CPU

Checks (`--checks` picks some; each reports `passed` and its numbers, the command exits 1 if one fails):

- `workers`: 2 workers on one device (spawned processes, a gloo default group, θg on the CPU as the engine keeps it)
  in streaming, eager, delayed int8 + error feedback and low rank: θg bitwise equal on both workers, every
  parameter still on the device after the syncs, nothing NaN.
- `bf16_autocast`: the same 2 workers with the forward under `torch.autocast(dtype=torch.bfloat16)`.
- `compile`: 2 workers training a `torch.compile`d model: no graph compiled after the first sync
  (`torch._dynamo.utils.counters`: `stats/unique_graphs` and `frames/ok` do not grow). On CPU it compiles with the
  `aot_eager` backend (no C++ build; the JSON says so).
- `grad_scaler`: fp16 autocast with a real `torch.amp.GradScaler` whose initial scale differs between the workers,
  so they skip different early steps: θg bitwise equal (lock-step). Two loops: the raw one, which hands the engine
  every optimizer-step call, and `DiLoCoPlugin` under an `Accelerator(mixed_precision="fp16")` (CUDA only: Accelerate
  builds no GradScaler on CPU), which is the front-end's own rule for skipped steps.
- `fsdp_resume`: FSDP2 at world size 1 (NCCL on cuda, gloo on CPU; `fully_shard` over `hf_diloco.worker_mesh`),
  a state saved mid-run (engine, model, inner optimizer) resumed in a fresh sharded model: θg and the model bitwise
  equal to the uninterrupted run's.
- `throughput`: `DiLoCoTrainer` against `Trainer` on one worker, tokens per second (target >= 0.97x at H = 50) and peak
  GPU memory (`torch.cuda.max_memory_allocated`, target <= 1.02x). On CPU the ratio is reported, the targets are
  not applied (a shared CPU's timing says nothing about a GPU's) and the memory ratio is "n/a".
- `copy_bandwidth`: device-to-host copies of 256 MB into pinned and pageable memory, GB/s (CUDA only).

On CPU (`--device cpu`) every check runs with a tiny model and a few steps, or says in its `skipped` why not.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import io
import json
import math
import os
import socket
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from contextlib import nullcontext
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

WORKERS = 2
VOCAB = 128
# name -> DiLoCo settings of the `workers` check (H = 4 throughout, 10 inner steps: 2 rounds and a tail)
MODES = {
    "streaming": dict(num_fragments=2, sync_delay=1),
    "eager": dict(num_fragments=2, overlap="eager"),
    "delayed_int8_ef": dict(overlap="delayed", compression="int8", error_feedback=True),
    "lowrank": dict(lowrank_rank=4, error_feedback=True),
}
INNER_STEPS, STEPS = 4, 10
CHECK_TIMEOUT_SECONDS = 240  # a check whose processes have not finished by then fails (a desynchronised run waits)


# ----------------------------------------------------------------------------------------------- shared pieces


def small_llama(hidden: int = 32, layers: int = 2, vocab: int = VOCAB, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised Llama built from a config (nothing downloaded)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=2 * hidden,
        num_hidden_layers=layers,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=256,
        tie_word_embeddings=False,
    )
    return LlamaForCausalLM(config)


def batch(worker: int, step: int, device: torch.device, rows: int = 2, length: int = 16) -> torch.Tensor:
    generator = torch.Generator().manual_seed(1000 * worker + step)
    return torch.randint(0, VOCAB, (rows, length), generator=generator).to(device)


def all_finite(tensors) -> bool:
    return all(bool(torch.isfinite(t).all()) for t in tensors)


def on_device(model: torch.nn.Module, device: torch.device) -> bool:
    return all(p.device.type == device.type for p in model.parameters())


def equal_dicts(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> bool:
    return first.keys() == second.keys() and all(torch.equal(first[n], second[n]) for n in first)


def max_difference(first: dict[str, torch.Tensor], second: dict[str, torch.Tensor]) -> float:
    return max(float((first[n].float() - second[n].float()).abs().max()) for n in first)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def spawn(fn: Callable, world: int, backend: str, *args) -> list:
    """`fn(rank, world, *args)` on `world` spawned processes joined by a `backend` default group; each rank's return
    value. Every rank's LOCAL_RANK is 0: the workers share one GPU, cuda:0. Raises if a process fails or the whole
    run takes longer than `CHECK_TIMEOUT_SECONDS`."""
    context = mp.get_context("spawn")
    port = _free_port()
    with tempfile.TemporaryDirectory() as out:
        processes = [
            context.Process(target=_entry, args=(rank, world, port, backend, out, fn, args)) for rank in range(world)
        ]
        for process in processes:
            process.start()
        deadline = time.monotonic() + CHECK_TIMEOUT_SECONDS
        for process in processes:
            process.join(max(1.0, deadline - time.monotonic()))
        hung = [rank for rank, process in enumerate(processes) if process.is_alive()]
        for rank in hung:
            processes[rank].kill()
            processes[rank].join()
        if hung:
            raise RuntimeError(f"ranks {hung} did not finish within {CHECK_TIMEOUT_SECONDS} s (killed)")
        failed = [rank for rank, process in enumerate(processes) if process.exitcode != 0]
        if failed:
            errors = [(Path(out) / f"rank{rank}.err").read_text()[-2000:] for rank in failed]
            raise RuntimeError(f"ranks {failed} failed:\n" + "\n".join(errors))
        return [torch.load(Path(out) / f"rank{rank}.pt", weights_only=False) for rank in range(world)]


def _entry(rank: int, world: int, port: int, backend: str, out: str, fn: Callable, args: tuple) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK="0"
    )
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    torch.set_num_threads(1)
    try:
        if backend == "nccl":
            torch.cuda.set_device(0)
        dist.init_process_group(backend, rank=rank, world_size=world, timeout=datetime.timedelta(seconds=120))
        result = fn(rank, world, *args)
        torch.save(result, Path(out) / f"rank{rank}.pt")
    except BaseException:
        (Path(out) / f"rank{rank}.err").write_text(traceback.format_exc())
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def _train_worker(
    rank: int, device: torch.device, settings: dict, autocast_dtype: torch.dtype | None = None, compile_backend=None
) -> dict:
    """One worker of the 2-worker checks: a small Llama on `device`, AdamW, the engine, STEPS inner steps, close()."""
    from hf_diloco import DiLoCo, DiLoCoConfig

    model = small_llama().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(inner_steps=INNER_STEPS, sync_timeout_seconds=60, **settings))
    forward = model if compile_backend is None else torch.compile(model, backend=compile_backend)
    graphs_after_first_sync = None
    losses = []
    for t in range(1, STEPS + 1):
        ids = batch(rank, t, device)
        autocast = nullcontext() if autocast_dtype is None else torch.autocast(device.type, dtype=autocast_dtype)
        with autocast:
            loss = forward(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        engine.step()
        losses.append(float(loss.detach()))
        if t == INNER_STEPS:  # the first sync has run: from here on nothing may compile again
            graphs_after_first_sync = _compile_counters()
    engine.close()
    return {
        "global": engine.global_parameters(),
        "on_device": on_device(model, device),
        "finite": all_finite(model.parameters()) and all(math.isfinite(loss) for loss in losses),
        "outer_steps": engine.stats["outer_steps"],
        "losses": losses,
        "graphs": (graphs_after_first_sync, _compile_counters()),
    }


def _compile_counters() -> dict[str, int]:
    from torch._dynamo.utils import counters

    return {"unique_graphs": counters["stats"]["unique_graphs"], "frames_ok": counters["frames"]["ok"]}


def _workers_agree(per_rank: list[dict]) -> dict:
    first, second = per_rank
    return {
        "theta_g_bitwise_equal": equal_dicts(first["global"], second["global"]),
        "parameters_on_device": first["on_device"] and second["on_device"],
        "finite": first["finite"] and second["finite"] and all_finite(first["global"].values()),
        "outer_steps": first["outer_steps"],
    }


# ----------------------------------------------------------------------------------------------------- checks


def _modes_rank(rank: int, world: int, device: str, modes: list[str]) -> dict:
    return {name: _train_worker(rank, torch.device(device), MODES[name]) for name in modes}


def check_workers(device: torch.device, args: argparse.Namespace) -> dict:
    per_rank = spawn(_modes_rank, WORKERS, "gloo", device.type, list(MODES))
    modes = {name: _workers_agree([rank[name] for rank in per_rank]) for name in MODES}
    passed = all(m["theta_g_bitwise_equal"] and m["parameters_on_device"] and m["finite"] for m in modes.values())
    return {"passed": passed, "modes": modes}


def _bf16_rank(rank: int, world: int, device: str) -> dict:
    return _train_worker(rank, torch.device(device), MODES["streaming"], autocast_dtype=torch.bfloat16)


def check_bf16_autocast(device: torch.device, args: argparse.Namespace) -> dict:
    result = _workers_agree(spawn(_bf16_rank, WORKERS, "gloo", device.type))
    return {
        "passed": result["theta_g_bitwise_equal"] and result["parameters_on_device"] and result["finite"],
        **result,
    }


def _compile_rank(rank: int, world: int, device: str, backend: str) -> dict:
    return _train_worker(rank, torch.device(device), MODES["streaming"], compile_backend=backend)


def check_compile(device: torch.device, args: argparse.Namespace) -> dict:
    backend = "inductor" if device.type == "cuda" else "aot_eager"
    per_rank = spawn(_compile_rank, WORKERS, "gloo", device.type, backend)
    result = _workers_agree(per_rank)
    after_first_sync, at_end = per_rank[0]["graphs"]
    recompiles = {key: at_end[key] - after_first_sync[key] for key in at_end}
    result.update(backend=backend, graphs_after_first_sync=after_first_sync, recompiles_after_first_sync=recompiles)
    if device.type != "cuda":
        result["note"] = "CPU dry run: aot_eager backend (inductor on cuda)"
    ok = result["theta_g_bitwise_equal"] and result["parameters_on_device"] and result["finite"]
    return {"passed": ok and all(value == 0 for value in recompiles.values()), **result}


# Initial GradScaler scales: worker 1's makes fp16 gradients overflow for several early steps, worker 0's does not
# (or less often), so the workers skip different steps.
INIT_SCALES = (2.0**8, 2.0**24)


def _scaler_raw_rank(rank: int, world: int, device: str) -> dict:
    """The raw loop: the engine steps on every optimizer-step call, skipped or not (θm did not move, so Δ is right)."""
    from hf_diloco import DiLoCo, DiLoCoConfig

    device = torch.device(device)
    model = small_llama().to(device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    engine = DiLoCo(model, optimizer, DiLoCoConfig(inner_steps=INNER_STEPS, sync_timeout_seconds=60))
    scaler = torch.amp.GradScaler(device.type, init_scale=INIT_SCALES[rank])
    skipped = 0
    for t in range(1, STEPS + 1):
        ids = batch(rank, t, device)
        with torch.autocast(device.type, dtype=torch.float16):
            loss = model(input_ids=ids, labels=ids).loss
        scaler.scale(loss).backward()
        scale = scaler.get_scale()
        scaler.step(optimizer)
        scaler.update()
        skipped += scaler.get_scale() < scale  # the scale drops exactly when the step was skipped
        optimizer.zero_grad()
        engine.step()
    engine.close()
    return {
        "global": engine.global_parameters(),
        "on_device": on_device(model, device),
        "finite": all_finite(model.parameters()),
        "outer_steps": engine.stats["outer_steps"],
        "skipped": skipped,
    }


def _scaler_plugin_rank(rank: int, world: int) -> dict:
    """DiLoCoPlugin under Accelerate's fp16 GradScaler: the front-end decides what a skipped step means."""
    from accelerate import Accelerator
    from accelerate.utils import GradScalerKwargs, InitProcessGroupKwargs

    from hf_diloco import DiLoCoPlugin

    # The default group is the gloo one `spawn` made (both workers on cuda:0); Accelerate is told so, not NCCL.
    handlers = [
        GradScalerKwargs(init_scale=INIT_SCALES[rank], growth_interval=1000),
        InitProcessGroupKwargs(backend="gloo"),
    ]
    accelerator = Accelerator(mixed_precision="fp16", kwargs_handlers=handlers)
    plugin = DiLoCoPlugin(inner_steps=INNER_STEPS, sync_timeout_seconds=60, environ={})
    model = small_llama()
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    model, optimizer = plugin.prepare(accelerator, model, optimizer, max_steps=STEPS)
    skipped = 0
    for t in range(1, STEPS + 1):
        ids = batch(rank, t, accelerator.device)
        with accelerator.autocast():
            loss = model(input_ids=ids, labels=ids).loss
        accelerator.backward(loss)
        optimizer.step()
        skipped += bool(optimizer.step_was_skipped)
        optimizer.zero_grad()
    plugin.close()
    unwrapped = accelerator.unwrap_model(model)
    return {
        "global": plugin.global_parameters(),
        "on_device": on_device(unwrapped, torch.device("cuda")),
        "finite": all_finite(unwrapped.parameters()),
        "outer_steps": plugin.engine.stats["outer_steps"],
        "skipped": skipped,
    }


def check_grad_scaler(device: torch.device, args: argparse.Namespace) -> dict:
    loops = {}
    raw = spawn(_scaler_raw_rank, WORKERS, "gloo", device.type)
    loops["raw"] = {**_workers_agree(raw), "skipped_steps": [r["skipped"] for r in raw]}
    if device.type == "cuda":
        try:
            plugin = spawn(_scaler_plugin_rank, WORKERS, "gloo")
            loops["plugin"] = {**_workers_agree(plugin), "skipped_steps": [r["skipped"] for r in plugin]}
        except RuntimeError as error:  # a desynchronised pair times out in close(): that is a failure, reported
            loops["plugin"] = {"theta_g_bitwise_equal": False, "finite": False, "error": str(error)[-1500:]}
    else:
        loops["plugin"] = {"skipped": "Accelerate builds no GradScaler on CPU (fp16 needs CUDA)"}
    ran = [loop for loop in loops.values() if "skipped" not in loop]
    skips_differ = raw[0]["skipped"] != raw[1]["skipped"]
    passed = skips_differ and all(loop["theta_g_bitwise_equal"] and loop["finite"] for loop in ran)
    return {"passed": passed, "skips_differ_between_workers": skips_differ, "loops": loops}


def _fsdp_rank(rank: int, world: int, device: str) -> dict:
    from torch.distributed.fsdp import fully_shard

    from hf_diloco import DiLoCo, DiLoCoConfig, worker_mesh

    device = torch.device(device)
    config = DiLoCoConfig(inner_steps=INNER_STEPS, num_fragments=2, sync_delay=1)

    def sharded(seed: int):
        model = small_llama(seed=seed).to(device)
        mesh = worker_mesh(config)
        for layer in model.model.layers:
            fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
        return model, optimizer, DiLoCo(model, optimizer, config)

    def train(model, optimizer, engine, steps: range) -> None:
        for t in steps:
            ids = batch(0, t, device)
            model(input_ids=ids, labels=ids).loss.backward()
            optimizer.step()
            optimizer.zero_grad()
            engine.step()

    def whole(model) -> dict[str, torch.Tensor]:
        return {n: p.full_tensor().detach().cpu().clone() for n, p in model.named_parameters()}

    save_at = STEPS // 2 + 1  # mid-round, one fragment in flight
    model, optimizer, engine = sharded(seed=0)
    train(model, optimizer, engine, range(1, save_at + 1))
    buffer = io.BytesIO()
    torch.save(engine.state_dict(), buffer)  # θg, θm, the inner optimizer, what is in flight
    train(model, optimizer, engine, range(save_at + 1, STEPS + 1))
    engine.close()
    buffer.seek(0)
    model_b, optimizer_b, engine_b = sharded(seed=7)  # other weights: everything must come from the state
    engine_b.load_state_dict(torch.load(buffer, weights_only=True))
    train(model_b, optimizer_b, engine_b, range(save_at + 1, STEPS + 1))
    engine_b.close()
    return {
        "global_equal": equal_dicts(engine.global_parameters(), engine_b.global_parameters()),
        "model_equal": equal_dicts(whole(model), whole(model_b)),
        "on_device": all(p.to_local().device.type == device.type for p in model_b.parameters()),
        "finite": all_finite(engine_b.global_parameters().values()),
        "outer_steps": engine.stats["outer_steps"],
    }


def check_fsdp_resume(device: torch.device, args: argparse.Namespace) -> dict:
    backend = "nccl" if device.type == "cuda" else "gloo"
    (result,) = spawn(_fsdp_rank, 1, backend, device.type)
    passed = result["global_equal"] and result["model_equal"] and result["on_device"] and result["finite"]
    return {"passed": passed, "backend": backend, **result}


def _trainer_run(use_diloco: bool, device: torch.device, steps: int, inner_steps: int, size: dict, out: str) -> dict:
    """One training run of the plain or the DiLoCo Trainer: tokens per second after the warm-up, peak memory."""
    from torch.utils.data import Dataset
    from transformers import Trainer, TrainerCallback, TrainingArguments

    from hf_diloco import DiLoCoTrainer, DiLoCoTrainingArguments

    rows, length, warmup = size["rows"], size["length"], size["warmup"]

    class Tokens(Dataset):
        def __len__(self) -> int:
            return steps * rows

        def __getitem__(self, index: int) -> dict:
            ids = torch.randint(0, size["vocab"], (length,), generator=torch.Generator().manual_seed(index))
            return {"input_ids": ids, "labels": ids}

    class Clock(TrainerCallback):
        """From the end of the warm-up's last step to the end of the last step (not `close()`'s final sync)."""

        started = ended = 0.0

        def on_step_end(self, args, state, control, **kwargs):
            if state.global_step in (warmup, state.max_steps):
                if device.type == "cuda":
                    torch.cuda.synchronize()
                if state.global_step == warmup:
                    Clock.started = time.perf_counter()
                else:
                    Clock.ended = time.perf_counter()

    common = dict(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=rows,
        learning_rate=1e-3,
        logging_steps=10**6,
        save_strategy="no",
        report_to="none",
        seed=0,
        use_cpu=device.type == "cpu",
        bf16=device.type == "cuda",
        disable_tqdm=True,
        dataloader_num_workers=0,
    )
    args = DiLoCoTrainingArguments(inner_steps=inner_steps, **common) if use_diloco else TrainingArguments(**common)
    model = small_llama(size["hidden"], size["layers"], size["vocab"])
    if device.type == "cuda":  # the previous run's memory released, so each peak is this run's own
        gc.collect()
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats()
    trainer = (DiLoCoTrainer if use_diloco else Trainer)(model=model, args=args, train_dataset=Tokens())
    trainer.add_callback(Clock())
    trainer.train()
    seconds = Clock.ended - Clock.started
    peak = torch.cuda.max_memory_allocated() if device.type == "cuda" else None
    del trainer, model
    return {"tokens_per_second": (steps - warmup) * rows * length / seconds, "peak_memory_bytes": peak}


def check_throughput(device: torch.device, args: argparse.Namespace) -> dict:
    if device.type == "cuda":
        size = dict(hidden=512, layers=8, vocab=8192, rows=8, length=256, warmup=10)
        steps, inner_steps, repeats = 160, 50, 2
    else:  # a dry run: the same code path, timings not compared with the targets
        size = dict(hidden=32, layers=2, vocab=VOCAB, rows=2, length=16, warmup=2)
        steps, inner_steps, repeats = 12, 5, 1
    runs: dict[str, list[dict]] = {"trainer": [], "diloco_trainer": []}
    with tempfile.TemporaryDirectory() as out:
        for repeat in range(repeats):  # alternate the order so drift hits both alike
            order = ("trainer", "diloco_trainer") if repeat % 2 == 0 else ("diloco_trainer", "trainer")
            for name in order:
                runs[name].append(_trainer_run(name == "diloco_trainer", device, steps, inner_steps, size, out))
    best = {name: max(r["tokens_per_second"] for r in values) for name, values in runs.items()}
    ratio = best["diloco_trainer"] / best["trainer"]
    result = {"inner_steps": inner_steps, "steps": steps, "tokens_per_second": best, "throughput_ratio": ratio}
    if device.type == "cuda":
        peaks = {name: max(r["peak_memory_bytes"] for r in values) for name, values in runs.items()}
        memory_ratio = peaks["diloco_trainer"] / peaks["trainer"]
        result.update(peak_memory_bytes=peaks, peak_memory_ratio=memory_ratio)
        result["passed"] = ratio >= 0.97 and memory_ratio <= 1.02
    else:
        result.update(peak_memory_ratio="n/a", note="CPU dry run: targets (>= 0.97x, <= 1.02x) apply on cuda only")
        result["passed"] = ratio > 0
    return result


def check_copy_bandwidth(device: torch.device, args: argparse.Namespace) -> dict:
    if device.type != "cuda":
        return {"passed": True, "skipped": "device-to-host copies need CUDA"}
    source = torch.randn(64 * 2**20, device=device)  # 256 MB of fp32
    pinned = torch.empty(source.shape, dtype=source.dtype, pin_memory=True)
    pageable = torch.empty(source.shape, dtype=source.dtype)
    rates = {}
    for name, target in (("pinned", pinned), ("pageable", pageable)):
        target.copy_(source, non_blocking=name == "pinned")  # warm-up
        torch.cuda.synchronize()
        started = time.perf_counter()
        for _ in range(5):
            target.copy_(source, non_blocking=name == "pinned")
        torch.cuda.synchronize()
        rates[name] = 5 * source.numel() * source.element_size() / (time.perf_counter() - started) / 1e9
    exact = torch.equal(pinned, pageable) and torch.equal(pinned, source.cpu())
    return {"passed": exact, "gb_per_second": rates, "pinned_over_pageable": rates["pinned"] / rates["pageable"]}


CHECKS: dict[str, Callable[[torch.device, argparse.Namespace], dict]] = {
    "workers": check_workers,
    "bf16_autocast": check_bf16_autocast,
    "compile": check_compile,
    "grad_scaler": check_grad_scaler,
    "fsdp_resume": check_fsdp_resume,
    "throughput": check_throughput,
    "copy_bandwidth": check_copy_bandwidth,
}


def run_checks(device: torch.device, names: list[str], args: argparse.Namespace) -> dict:
    results = {}
    for name in names:
        started = time.perf_counter()
        try:
            result = CHECKS[name](device, args)
        except Exception as error:  # one broken check is reported and does not hide the others
            result = {"passed": False, "error": f"{type(error).__name__}: {error}"[-3000:]}
        result["seconds"] = round(time.perf_counter() - started, 2)
        results[name] = result
        print(f"{name}: {'pass' if result['passed'] else 'FAIL'} ({result['seconds']} s)", flush=True)
    return results


def _environment(device: torch.device) -> dict:
    info = {"torch": torch.__version__, "device": device.type}
    if device.type == "cuda":
        info.update(gpu=torch.cuda.get_device_name(0), cuda=torch.version.cuda, nccl=list(torch.cuda.nccl.version()))
    return info


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument(
        "--device",
        choices=["cuda", "cpu"],
        default="cuda" if torch.cuda.is_available() else "cpu",
        help="cuda (the real checks) or cpu (a dry run); default cuda when available",
    )
    parser.add_argument("--checks", nargs="+", choices=list(CHECKS), default=list(CHECKS), help="checks to run")
    parser.add_argument("--out", default=None, help="write the results to this JSON file")
    args = parser.parse_args(argv)
    if args.device == "cuda" and not torch.cuda.is_available():
        parser.error("--device cuda: no CUDA device is visible; run a dry run with --device cpu")
    device = torch.device(args.device)
    started = time.perf_counter()
    results = run_checks(device, args.checks, args)
    report = {
        "command": " ".join(["python", "scripts/gpu_check.py", *(sys.argv[1:] if argv is None else argv)]),
        "environment": _environment(device),
        "dry_run": device.type == "cpu",
        "seconds": round(time.perf_counter() - started, 2),
        "passed": all(result["passed"] for result in results.values()),
        "checks": results,
    }
    text = json.dumps(report, indent=1, default=str)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text)
    print(text)
    return 0 if report["passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
